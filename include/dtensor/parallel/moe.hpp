#pragma once
// A mixture-of-experts layer over an expert-parallel group: top-k routing, dispatch and combine by
// all_to_all_single with variable splits, the local experts as one GEMM pair each over their contiguous
// tokens, forward and backward.
//
//   MoE<float> moe(ep_group, {.hidden = 64, .ffn = 256, .experts = 8, .top_k = 2, .capacity_factor = 1.25},
//                  /*seed=*/1);                     // experts 2r, 2r+1 on rank r of a 4-rank ep group
//   auto [y, back] = moe.forward(x, with_backward); // x: this rank's tokens (t, hidden)
//   MoEGrads<float> g = back(dy);                   // dx, and the router's / local experts' weight gradients
//
// Forward: router logits x Wr (hidden x experts, replicated), softmax, the top-k experts of each token (ties
// to the lower index) with their gates (k = 1: the probability, as Switch; k > 1: the chosen probabilities
// renormalised to sum 1, as Mixtral); with a capacity factor cf > 0 each expert takes at most
// ceil(cf * t * k / experts) of this rank's assignments, in token order, and the rest are dropped (counted
// in `dropped()`, contributing zero, as in Switch/GShard). The kept assignments, sorted by expert, are
// dispatched: the per-expert counts first (an all_to_all_single of experts integers), then the rows (one
// all_to_all_single with variable splits). Each local expert runs gelu(x W1) W2 on its rows from every
// rank as one contiguous block, and the rows go back by the reverse all_to_all_single (splits swapped);
// each token's output is the gate-weighted sum of its experts' rows. The backward is the same exchange in
// the same two directions (the duality of all_to_all: splits swapped), then the experts' GEMMs, the
// gates' and the router's gradients. The router's weight gradient is this rank's part (a Partial<sum> over
// the ranks that hold tokens: reduce it with the data-parallel gradients); an expert's weight gradients are
// complete on its rank. Weights come from local::randn keyed on (seed, expert), the same for any group
// size. Routing metadata (t x experts) is computed on the host; rows move by the local launcher and the
// GEMMs by the BLAS (cuBLAS for CUDA tensors).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/random.hpp"

namespace dtensor {

struct MoEConfig {
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;
  int experts = 0;
  int top_k = 1;
  double capacity_factor = 0; ///< <= 0: no capacity (no token is dropped)
};

template <class T>
struct MoEGrads {
  Tensor<T, 2> dx;
  Tensor<T, 2> router;              ///< this rank's part of the router's gradient (sum over ranks = total)
  std::vector<Tensor<T, 2>> w1, w2; ///< the local experts' gradients (complete)
};

namespace local {

/// Row i: out[i, :] = in[index[i], :], or zeros where index[i] < 0 (one index per row: the inner loop is a
/// contiguous copy).
template <class T>
struct GatherRows {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const T* in;
  const std::int64_t* index;
  std::int64_t width;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t s = index[r];
    T* o = out + r * width;
    if (s < 0) {
      for (std::int64_t c = 0; c < width; ++c) {
        o[c] = T(0);
      }
      return;
    }
    const T* src = in + s * width;
    for (std::int64_t c = 0; c < width; ++c) {
      o[c] = src[c];
    }
  }
};

/// Row t: out[t, :] = sum over j < k of weight[t, j] * rows[slot[t, j], :] (slot < 0: nothing).
template <class T>
struct CombineRows {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const T* rows;
  const std::int64_t* slot;
  const T* weight;
  std::int64_t k;
  std::int64_t width;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t t) const {
    using C = compute_t<T>;
    T* o = out + t * width;
    for (std::int64_t c = 0; c < width; ++c) {
      o[c] = T(0);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = slot[t * k + j];
      if (s < 0) {
        continue;
      }
      const C w = static_cast<C>(weight[t * k + j]);
      const T* src = rows + s * width;
      for (std::int64_t c = 0; c < width; ++c) {
        o[c] = T(static_cast<C>(o[c]) + w * static_cast<C>(src[c]));
      }
    }
  }
};

/// Row i: out[i, :] = weight[i] * in[index[i], :]: each kept assignment's row of dy, scaled by its gate.
template <class T>
struct ScaledGatherRows {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const T* in;
  const std::int64_t* index;
  const T* weight;
  std::int64_t width;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const C w = static_cast<C>(weight[r]);
    const T* src = in + index[r] * width;
    T* o = out + r * width;
    for (std::int64_t c = 0; c < width; ++c) {
      o[c] = T(w * static_cast<C>(src[c]));
    }
  }
};

} // namespace local

namespace detail {

template <class T>
Tensor<std::int64_t, 1> index_tensor(const std::vector<std::int64_t>& v, const Tensor<T, 2>& like) {
  Tensor<std::int64_t, 1> host({static_cast<std::int64_t>(v.size())});
  std::copy(v.begin(), v.end(), host.data());
  return like.device().is_cpu() ? host : host.to(like.device());
}

template <class T>
Tensor<T, 1> value_tensor(const std::vector<double>& v, const Tensor<T, 2>& like) {
  Tensor<T, 1> host({static_cast<std::int64_t>(v.size())});
  for (std::size_t i = 0; i < v.size(); ++i) {
    host.data()[i] = T(v[i]);
  }
  return like.device().is_cpu() ? host : host.to(like.device());
}

/// rows of `in` picked by `index` (-1: zeros).
template <class T>
Tensor<T, 2> gather_rows(const Tensor<T, 2>& in, const std::vector<std::int64_t>& index) {
  const std::int64_t width = in.shape()[1];
  Tensor<T, 2> out =
      empty_like(std::array<std::int64_t, 2>{static_cast<std::int64_t>(index.size()), width}, in);
  const auto idx = index_tensor(index, in);
  const auto src = in.contiguous();
  local::GatherRows<T> run{{out.shape()[0]}, out.data(), src.data(), idx.data(), width};
  local::launch(run, in.device(), in.stream_handle(), "MoE: gather rows");
  return out;
}

/// Per token, the weighted sum of its k rows (slot -1: none).
template <class T>
Tensor<T, 2> combine_rows(const Tensor<T, 2>& rows, const std::vector<std::int64_t>& slot,
                          const std::vector<double>& weight, std::int64_t tokens, std::int64_t k) {
  const std::int64_t width = rows.shape()[1];
  Tensor<T, 2> out = empty_like(std::array<std::int64_t, 2>{tokens, width}, rows);
  const auto s = index_tensor(slot, rows);
  const auto w = value_tensor<T>(weight, rows);
  const auto src = rows.contiguous();
  local::CombineRows<T> run{{tokens}, out.data(), src.data(), s.data(), w.data(), k, width};
  local::launch(run, rows.device(), rows.stream_handle(), "MoE: combine");
  return out;
}

} // namespace detail

/// The backward context of MoE::forward.
template <class T>
class MoEBackward;

/// The layer (see the top of this file). Holds the router's weight and its local experts' weights.
template <class T>
class MoE {
public:
  MoE(const ProcessGroup& ep, MoEConfig config, std::uint64_t seed, Device device = Device::cpu())
      : ep_(ep), c_(config) {
    const int n = ep.size();
    DTENSOR_CHECK(c_.experts > 0 && c_.experts % n == 0,
                  "MoE: " + std::to_string(c_.experts) +
                      " experts do not divide over an expert-parallel group of " + std::to_string(n));
    DTENSOR_CHECK(c_.top_k >= 1 && c_.top_k <= c_.experts, "MoE: top_k " + std::to_string(c_.top_k) +
                                                               " out of [1, " + std::to_string(c_.experts) +
                                                               "]");
    local_experts_ = c_.experts / n;
    // Weights: normal with std 1 / sqrt(fan_in), keyed on (seed, offset): offset 0 the router, 1 + 2e and
    // 2 + 2e expert e's W1 and W2, so every group size holds the same numbers.
    router = scaled(local::randn<T, 2>({c_.hidden, c_.experts}, seed, 0, device), c_.hidden);
    for (int j = 0; j < local_experts_; ++j) {
      const std::uint64_t e = static_cast<std::uint64_t>(ep.rank() * local_experts_ + j);
      w1.push_back(scaled(local::randn<T, 2>({c_.hidden, c_.ffn}, seed, 1 + 2 * e, device), c_.hidden));
      w2.push_back(scaled(local::randn<T, 2>({c_.ffn, c_.hidden}, seed, 2 + 2 * e, device), c_.ffn));
    }
  }

  Tensor<T, 2> router;          ///< (hidden, experts), the same on every rank
  std::vector<Tensor<T, 2>> w1; ///< local expert j's (hidden, ffn); global expert rank * local + j
  std::vector<Tensor<T, 2>> w2; ///< (ffn, hidden)

  const MoEConfig& config() const noexcept { return c_; }
  int local_experts() const noexcept { return local_experts_; }

  Tensor<T, 2> forward(const Tensor<T, 2>& x) const { return forward(x, with_backward).output; }
  WithBackward<Tensor<T, 2>, MoEBackward<T>> forward(const Tensor<T, 2>& x, WithBackwardTag) const;

private:
  static Tensor<T, 2> scaled(Tensor<T, 2> t, std::int64_t fan_in) {
    return local::map(local::Scale{1.0 / std::sqrt(double(fan_in))}, t);
  }

  ProcessGroup ep_;
  MoEConfig c_;
  int local_experts_ = 0;

  friend class MoEBackward<T>;
};

template <class T>
class MoEBackward {
public:
  /// dx and the weights' gradients from dy (this rank's tokens, (t, hidden)).
  MoEGrads<T> operator()(const Tensor<T, 2>& dy) const;

  /// This rank's dropped assignments (over capacity).
  std::int64_t dropped() const noexcept { return dropped_; }

private:
  friend class MoE<T>;
  const MoE<T>* layer_ = nullptr;
  Tensor<T, 2> x_;
  std::vector<double> probs_;           ///< (t, experts), softmax of the router logits
  std::vector<int> chosen_;             ///< (t, k) experts
  std::vector<double> gates_;           ///< (t, k)
  std::vector<std::int64_t> slot_;      ///< (t, k): the assignment's row in the send order, -1 if dropped
  std::vector<std::int64_t> send_rows_; ///< send order -> token
  std::vector<std::int64_t> send_splits_, recv_splits_;
  std::vector<std::int64_t> group_index_;     ///< expert-grouped row -> received row
  std::vector<std::int64_t> ungroup_;         ///< its inverse: received row -> expert-grouped row
  std::vector<std::int64_t> expert_rows_;     ///< rows per local expert, from all ranks
  std::vector<Tensor<T, 2>> xin_, pre_, act_; ///< per local expert: input rows, x W1, gelu(x W1)
  Tensor<T, 2> expert_out_;                   ///< the returned rows, in send order
  std::int64_t dropped_ = 0;
};

template <class T>
WithBackward<Tensor<T, 2>, MoEBackward<T>> MoE<T>::forward(const Tensor<T, 2>& x, WithBackwardTag) const {
  const std::int64_t t = x.shape()[0];
  const int e_count = c_.experts;
  const int k = c_.top_k;
  const int n = ep_.size();
  const int el = local_experts_;
  DTENSOR_CHECK(x.shape()[1] == c_.hidden, "MoE: tokens of " + std::to_string(x.shape()[1]) +
                                               " features, the layer's hidden size is " +
                                               std::to_string(c_.hidden));
  MoEBackward<T> b;
  b.layer_ = this;
  b.x_ = x.contiguous();
  // Routing, on the host (t x experts).
  const auto logits = local::matmul(b.x_, router).to(Device::cpu());
  b.probs_.assign(static_cast<std::size_t>(t * e_count), 0.0);
  b.chosen_.assign(static_cast<std::size_t>(t * k), 0);
  b.gates_.assign(static_cast<std::size_t>(t * k), 0.0);
  for (std::int64_t i = 0; i < t; ++i) {
    double* p = b.probs_.data() + i * e_count;
    double m = -INFINITY;
    for (int e = 0; e < e_count; ++e) {
      p[e] = double(logits.data()[i * e_count + e]);
      m = std::max(m, p[e]);
    }
    double s = 0;
    for (int e = 0; e < e_count; ++e) {
      p[e] = std::exp(p[e] - m);
      s += p[e];
    }
    for (int e = 0; e < e_count; ++e) {
      p[e] /= s;
    }
    std::vector<int> order(static_cast<std::size_t>(e_count));
    for (int e = 0; e < e_count; ++e) {
      order[static_cast<std::size_t>(e)] = e;
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return p[a] > p[c]; });
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      sum += p[order[static_cast<std::size_t>(j)]];
    }
    for (int j = 0; j < k; ++j) {
      const int e = order[static_cast<std::size_t>(j)];
      b.chosen_[static_cast<std::size_t>(i * k + j)] = e;
      b.gates_[static_cast<std::size_t>(i * k + j)] = k == 1 ? p[e] : p[e] / sum;
    }
  }
  // Capacity, then the send order: by expert, tokens in order.
  const std::int64_t capacity =
      c_.capacity_factor > 0
          ? static_cast<std::int64_t>(std::ceil(c_.capacity_factor * double(t * k) / e_count))
          : -1;
  std::vector<std::int64_t> taken(static_cast<std::size_t>(e_count), 0);
  std::vector<bool> kept(static_cast<std::size_t>(t * k), false);
  for (std::int64_t a = 0; a < t * k; ++a) {
    const int e = b.chosen_[static_cast<std::size_t>(a)];
    if (capacity < 0 || taken[static_cast<std::size_t>(e)] < capacity) {
      ++taken[static_cast<std::size_t>(e)];
      kept[static_cast<std::size_t>(a)] = true;
    } else {
      ++b.dropped_;
    }
  }
  b.slot_.assign(static_cast<std::size_t>(t * k), -1);
  std::vector<std::int64_t> start(static_cast<std::size_t>(e_count + 1), 0);
  for (int e = 0; e < e_count; ++e) {
    start[static_cast<std::size_t>(e + 1)] =
        start[static_cast<std::size_t>(e)] + taken[static_cast<std::size_t>(e)];
  }
  b.send_rows_.assign(static_cast<std::size_t>(start.back()), 0);
  std::vector<std::int64_t> fill = start;
  for (std::int64_t a = 0; a < t * k; ++a) {
    if (kept[static_cast<std::size_t>(a)]) {
      const int e = b.chosen_[static_cast<std::size_t>(a)];
      const std::int64_t s = fill[static_cast<std::size_t>(e)]++;
      b.slot_[static_cast<std::size_t>(a)] = s;
      b.send_rows_[static_cast<std::size_t>(s)] = a / k;
    }
  }
  // The counts per expert to the experts' ranks: recv_counts[src * el + j] = rows for local expert j.
  Tensor<std::int64_t, 1> counts({e_count});
  for (int e = 0; e < e_count; ++e) {
    counts.data()[e] = taken[static_cast<std::size_t>(e)];
  }
  Tensor<std::int64_t, 1> recv_counts({e_count});
  all_to_all_single(recv_counts, counts, ep_);
  b.send_splits_.assign(static_cast<std::size_t>(n), 0);
  b.recv_splits_.assign(static_cast<std::size_t>(n), 0);
  b.expert_rows_.assign(static_cast<std::size_t>(el), 0);
  for (int r = 0; r < n; ++r) {
    for (int j = 0; j < el; ++j) {
      b.send_splits_[static_cast<std::size_t>(r)] += taken[static_cast<std::size_t>(r * el + j)];
      b.recv_splits_[static_cast<std::size_t>(r)] += recv_counts.data()[r * el + j];
      b.expert_rows_[static_cast<std::size_t>(j)] += recv_counts.data()[r * el + j];
    }
  }
  // Dispatch.
  const Tensor<T, 2> send = detail::gather_rows(b.x_, b.send_rows_);
  std::int64_t received = 0;
  for (std::int64_t s : b.recv_splits_) {
    received += s;
  }
  Tensor<T, 2> recv = detail::empty_like(std::array<std::int64_t, 2>{received, c_.hidden}, b.x_);
  all_to_all_single(recv, send, b.recv_splits_, b.send_splits_, ep_);
  // Group the received rows by local expert (from every rank, in rank order), run each expert.
  b.group_index_.clear();
  std::vector<std::int64_t> expert_start(static_cast<std::size_t>(el + 1), 0);
  for (int j = 0; j < el; ++j) {
    expert_start[static_cast<std::size_t>(j + 1)] =
        expert_start[static_cast<std::size_t>(j)] + b.expert_rows_[static_cast<std::size_t>(j)];
    std::int64_t offset = 0; // of source r's block in recv
    for (int r = 0; r < n; ++r) {
      std::int64_t before = 0; // rows of local experts < j from source r
      for (int q = 0; q < j; ++q) {
        before += recv_counts.data()[r * el + q];
      }
      for (std::int64_t i = 0; i < recv_counts.data()[r * el + j]; ++i) {
        b.group_index_.push_back(offset + before + i);
      }
      offset += b.recv_splits_[static_cast<std::size_t>(r)];
    }
  }
  const Tensor<T, 2> grouped = detail::gather_rows(recv, b.group_index_);
  Tensor<T, 2> grouped_out = detail::empty_like(std::array<std::int64_t, 2>{received, c_.hidden}, b.x_);
  for (int j = 0; j < el; ++j) {
    const std::int64_t lo = expert_start[static_cast<std::size_t>(j)];
    const std::int64_t rows = b.expert_rows_[static_cast<std::size_t>(j)];
    const Tensor<T, 2> xin = grouped.narrow(0, lo, rows);
    Tensor<T, 2> pre = local::matmul(xin, w1[static_cast<std::size_t>(j)]);
    Tensor<T, 2> act = local::map(local::Gelu{}, pre);
    local::matmul_into(act, w2[static_cast<std::size_t>(j)], grouped_out.narrow(0, lo, rows));
    b.xin_.push_back(xin);
    b.pre_.push_back(std::move(pre));
    b.act_.push_back(std::move(act));
  }
  // Back to the received order, then to the senders (splits swapped).
  b.ungroup_.assign(static_cast<std::size_t>(received), 0);
  for (std::size_t g = 0; g < b.group_index_.size(); ++g) {
    b.ungroup_[static_cast<std::size_t>(b.group_index_[g])] = static_cast<std::int64_t>(g);
  }
  const Tensor<T, 2> back_rows = detail::gather_rows(grouped_out, b.ungroup_);
  b.expert_out_ = detail::empty_like(std::array<std::int64_t, 2>{start.back(), c_.hidden}, b.x_);
  all_to_all_single(b.expert_out_, back_rows, b.send_splits_, b.recv_splits_, ep_);
  Tensor<T, 2> y = detail::combine_rows(b.expert_out_, b.slot_, b.gates_, t, k);
  return {std::move(y), std::move(b)};
}

template <class T>
MoEGrads<T> MoEBackward<T>::operator()(const Tensor<T, 2>& dy_in) const {
  const MoE<T>& m = *layer_;
  const MoEConfig& c = m.c_;
  const std::int64_t t = x_.shape()[0];
  const int k = c.top_k;
  const int e_count = c.experts;
  const int el = m.local_experts_;
  DTENSOR_CHECK(dy_in.shape() == x_.shape(),
                "MoE backward: dy's shape " + detail::shape_to_string(dy_in.shape()) +
                    " is not the input's " + detail::shape_to_string(x_.shape()));
  const Tensor<T, 2> dy = dy_in.contiguous();
  MoEGrads<T> g;
  // The gates' gradients: dgate[a] = <dy[token], row[slot]> (0 if dropped), on the host (t x k).
  const auto dy_host = dy.to(Device::cpu());
  const auto out_host = expert_out_.to(Device::cpu());
  std::vector<double> dgate(static_cast<std::size_t>(t * k), 0.0);
  std::vector<double> send_gate(send_rows_.size(), 0.0);
  for (std::int64_t a = 0; a < t * k; ++a) {
    const std::int64_t s = slot_[static_cast<std::size_t>(a)];
    if (s < 0) {
      continue;
    }
    send_gate[static_cast<std::size_t>(s)] = gates_[static_cast<std::size_t>(a)];
    double d = 0;
    for (std::int64_t h = 0; h < c.hidden; ++h) {
      d += double(dy_host.data()[(a / k) * c.hidden + h]) * double(out_host.data()[s * c.hidden + h]);
    }
    dgate[static_cast<std::size_t>(a)] = d;
  }
  // The rows' gradients (gate * dy of their token), dispatched to the experts like the rows.
  Tensor<T, 2> d_send = detail::empty_like(
      std::array<std::int64_t, 2>{static_cast<std::int64_t>(send_rows_.size()), c.hidden}, dy);
  {
    const auto idx = detail::index_tensor(send_rows_, dy);
    const auto w = detail::value_tensor<T>(send_gate, dy);
    local::ScaledGatherRows<T> run{{d_send.shape()[0]}, d_send.data(), dy.data(),
                                   idx.data(),          w.data(),      c.hidden};
    local::launch(run, dy.device(), dy.stream_handle(), "MoE backward: rows");
  }
  std::int64_t received = 0;
  for (std::int64_t s : recv_splits_) {
    received += s;
  }
  Tensor<T, 2> d_recv = detail::empty_like(std::array<std::int64_t, 2>{received, c.hidden}, dy);
  all_to_all_single(d_recv, d_send, recv_splits_, send_splits_, m.ep_);
  const Tensor<T, 2> d_grouped = detail::gather_rows(d_recv, group_index_);
  Tensor<T, 2> dx_grouped = detail::empty_like(std::array<std::int64_t, 2>{received, c.hidden}, dy);
  std::int64_t lo = 0;
  for (int j = 0; j < el; ++j) {
    const std::int64_t rows = expert_rows_[static_cast<std::size_t>(j)];
    const Tensor<T, 2> dout = d_grouped.narrow(0, lo, rows);
    const auto& w1 = m.w1[static_cast<std::size_t>(j)];
    const auto& w2 = m.w2[static_cast<std::size_t>(j)];
    g.w2.push_back(local::matmul(act_[static_cast<std::size_t>(j)], dout, true, false)); // act^T dout
    const Tensor<T, 2> dact = local::matmul(dout, w2, false, true);                      // dout W2^T
    const Tensor<T, 2> dpre =
        local::map(local::BackwardOf<local::Gelu>{}, pre_[static_cast<std::size_t>(j)], dact);
    g.w1.push_back(local::matmul(xin_[static_cast<std::size_t>(j)], dpre, true, false)); // x^T dpre
    local::matmul_into(dpre, w1, dx_grouped.narrow(0, lo, rows), false, true);           // dpre W1^T
    lo += rows;
  }
  const Tensor<T, 2> dx_rows = detail::gather_rows(dx_grouped, ungroup_);
  Tensor<T, 2> dx_send = detail::empty_like(
      std::array<std::int64_t, 2>{static_cast<std::int64_t>(send_rows_.size()), c.hidden}, dy);
  all_to_all_single(dx_send, dx_rows, send_splits_, recv_splits_, m.ep_);
  // dx from the experts: each token's rows summed (weight 1).
  const std::vector<double> ones(static_cast<std::size_t>(t * k), 1.0);
  g.dx = detail::combine_rows(dx_send, slot_, ones, t, k);
  // The router: gates -> probabilities -> logits.
  std::vector<double> dlogits(static_cast<std::size_t>(t * e_count), 0.0);
  for (std::int64_t i = 0; i < t; ++i) {
    const double* p = probs_.data() + i * e_count;
    std::vector<double> dp(static_cast<std::size_t>(e_count), 0.0);
    double sum = 0;
    double dot = 0; // sum_j dgate_j gate_j
    for (int j = 0; j < k; ++j) {
      sum += p[chosen_[static_cast<std::size_t>(i * k + j)]];
      dot += dgate[static_cast<std::size_t>(i * k + j)] * gates_[static_cast<std::size_t>(i * k + j)];
    }
    for (int j = 0; j < k; ++j) {
      const int e = chosen_[static_cast<std::size_t>(i * k + j)];
      const double d = dgate[static_cast<std::size_t>(i * k + j)];
      dp[static_cast<std::size_t>(e)] = k == 1 ? d : (d - dot) / sum;
    }
    double pd = 0;
    for (int e = 0; e < e_count; ++e) {
      pd += p[e] * dp[static_cast<std::size_t>(e)];
    }
    for (int e = 0; e < e_count; ++e) {
      dlogits[static_cast<std::size_t>(i * e_count + e)] = p[e] * (dp[static_cast<std::size_t>(e)] - pd);
    }
  }
  Tensor<T, 2> dl_host({t, static_cast<std::int64_t>(e_count)});
  for (std::size_t i = 0; i < dlogits.size(); ++i) {
    dl_host.data()[i] = T(dlogits[i]);
  }
  const Tensor<T, 2> dl = x_.device().is_cpu() ? dl_host : dl_host.to(x_.device());
  g.router = local::matmul(x_, dl, true, false);                 // x^T dlogits
  local::matmul_into(dl, m.router, g.dx, false, true, 1.0, 1.0); // dx += dlogits Wr^T
  return g;
}

} // namespace dtensor
