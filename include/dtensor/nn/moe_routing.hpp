#pragma once
// nn::Moe's routing, on the host: value code over the router's logits and the per-expert counts, no
// templates (nn/moe.hpp moves the rows and runs the experts).
//
//   route            softmax of each token's logits, its top-k experts (ties to the lower index) and their
//                    gates: k = 1 the probability (Switch), k > 1 the chosen probabilities renormalised to
//                    sum 1 (Mixtral); the assignments per expert and the probabilities' sums
//   apply_capacity   each expert keeps the batch's first `capacity` assignments in token order (the
//                    assignments of earlier tokens on other ranks counted by `before`), the rest dropped;
//                    the send order is by expert, tokens in order
//   plan_exchange    the all_to_all_single splits and the regrouping of the received rows by local expert
//   router_grad      the logits' gradient from the gates' and the load-balancing loss's
//
// The load-balancing loss (Switch Transformer, GShard): aux = E * sum_e f_e P_e over the whole batch of T
// tokens, f_e = (assignments to e before capacity) / (T k), P_e = (sum over tokens of p_e) / T; 1 for a
// router that spreads evenly. Its gradient flows through P only: d aux / d p_te = E f_e / T.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace dtensor::nn {

/// The sizes and policy of nn::Moe.
struct MoeConfig {
  std::int64_t experts = 0;
  int top_k = 1;
  std::int64_t ffn = 0;       ///< each expert's hidden units (SwiGLU: W1, W3 (ffn, hidden), W2 (hidden, ffn))
  double capacity_factor = 0; ///< > 0: each expert takes at most ceil(cf * T * k / E) of the batch's
                              ///< assignments; <= 0: dropless (every assignment runs)
  double aux_loss_coeff = 0;  ///< the load-balancing loss's weight in the training loss (Switch: 0.01)
  double init_std = 0.02;     ///< the weights normal(0, init_std), the router's too
};

/// What the last forward of an nn::Moe routed, over the whole batch (every rank holds the same numbers).
struct MoeStats {
  double aux_loss = 0;                  ///< the load-balancing loss (unweighted; 1 when perfectly even)
  std::int64_t tokens = 0;              ///< T
  std::int64_t capacity = -1;           ///< per expert (-1: dropless)
  std::int64_t dropped = 0;             ///< assignments over capacity
  std::vector<std::int64_t> per_expert; ///< assignments per expert before capacity
};

namespace detail {

struct MoeRouting {
  std::int64_t tokens = 0;
  int experts = 0;
  int k = 0;
  std::vector<double> probs;           ///< (t, experts)
  std::vector<int> chosen;             ///< (t, k)
  std::vector<double> gates;           ///< (t, k)
  std::vector<std::int64_t> counts;    ///< per expert, assignments before capacity
  std::vector<double> prob_sums;       ///< per expert, the sum of its probability over the tokens
  std::vector<std::int64_t> slot;      ///< (t, k): the assignment's row in the send order, -1 if dropped
  std::vector<std::int64_t> send_rows; ///< send order -> token
  std::vector<std::int64_t> kept;      ///< per expert, rows sent
  std::int64_t dropped = 0;            ///< this rank's assignments over capacity
};

/// Logits that route evenly, for tokens without values (meta tensors: a dry run): token `first + i` picks
/// experts (first + i) k, ..., (first + i) k + k - 1 modulo `experts`, so each expert receives t k / experts
/// assignments of a batch (one more or less), spread over the ranks as the tokens are.
inline std::vector<double> uniform_logits(std::int64_t t, int experts, int k, std::int64_t first) {
  std::vector<double> l(static_cast<std::size_t>(t) * static_cast<std::size_t>(experts), 0.0);
  for (std::int64_t i = 0; i < t; ++i) {
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = ((first + i) * k + j) % experts;
      l[static_cast<std::size_t>(i * experts + e)] = 1.0;
    }
  }
  return l;
}

inline MoeRouting route(const std::vector<double>& logits, std::int64_t t, int experts, int k) {
  MoeRouting r;
  r.tokens = t;
  r.experts = experts;
  r.k = k;
  const auto e_count = static_cast<std::size_t>(experts);
  r.probs.assign(static_cast<std::size_t>(t) * e_count, 0.0);
  r.chosen.assign(static_cast<std::size_t>(t * k), 0);
  r.gates.assign(static_cast<std::size_t>(t * k), 0.0);
  r.counts.assign(e_count, 0);
  r.prob_sums.assign(e_count, 0.0);
  std::vector<int> order(e_count);
  for (std::int64_t i = 0; i < t; ++i) {
    const double* l = logits.data() + static_cast<std::size_t>(i) * e_count;
    double* p = r.probs.data() + static_cast<std::size_t>(i) * e_count;
    const double m = *std::max_element(l, l + experts);
    double s = 0;
    for (std::size_t e = 0; e < e_count; ++e) {
      p[e] = std::exp(l[e] - m);
      s += p[e];
    }
    for (std::size_t e = 0; e < e_count; ++e) {
      p[e] /= s;
      r.prob_sums[e] += p[e];
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return p[a] > p[c]; });
    double sum = 0;
    for (int j = 0; j < k; ++j) {
      sum += p[order[static_cast<std::size_t>(j)]];
    }
    for (int j = 0; j < k; ++j) {
      const int e = order[static_cast<std::size_t>(j)];
      const auto a = static_cast<std::size_t>(i * k + j);
      r.chosen[a] = e;
      r.gates[a] = k == 1 ? p[e] : p[e] / sum;
      ++r.counts[static_cast<std::size_t>(e)];
    }
  }
  return r;
}

/// `before[e]`: assignments to e of the tokens before this rank's in the batch; capacity < 0: keep all.
inline void apply_capacity(MoeRouting& r, const std::vector<std::int64_t>& before, std::int64_t capacity) {
  const auto e_count = static_cast<std::size_t>(r.experts);
  const std::int64_t assignments = r.tokens * r.k;
  std::vector<std::int64_t> taken = before;
  r.kept.assign(e_count, 0);
  r.slot.assign(static_cast<std::size_t>(assignments), -1);
  r.dropped = 0;
  std::vector<char> keep(static_cast<std::size_t>(assignments), 0);
  for (std::int64_t a = 0; a < assignments; ++a) {
    const auto e = static_cast<std::size_t>(r.chosen[static_cast<std::size_t>(a)]);
    if (capacity < 0 || taken[e] < capacity) {
      keep[static_cast<std::size_t>(a)] = 1;
      ++r.kept[e];
    } else {
      ++r.dropped;
    }
    ++taken[e];
  }
  std::vector<std::int64_t> fill(e_count, 0);
  for (std::size_t e = 1; e < e_count; ++e) {
    fill[e] = fill[e - 1] + r.kept[e - 1];
  }
  r.send_rows.assign(static_cast<std::size_t>(std::accumulate(r.kept.begin(), r.kept.end(), std::int64_t{0})),
                     0);
  for (std::int64_t a = 0; a < assignments; ++a) {
    if (keep[static_cast<std::size_t>(a)] != 0) {
      const std::int64_t s = fill[static_cast<std::size_t>(r.chosen[static_cast<std::size_t>(a)])]++;
      r.slot[static_cast<std::size_t>(a)] = s;
      r.send_rows[static_cast<std::size_t>(s)] = a / r.k;
    }
  }
}

/// The exchange with the expert-parallel group of n ranks, el local experts each (expert e on rank
/// e / el): rows sent to and received from each rank, and the received rows regrouped by local expert.
struct MoeExchange {
  std::vector<std::int64_t> send_splits, recv_splits; ///< rows per peer
  std::vector<std::int64_t> expert_rows;              ///< rows per local expert, from every peer
  std::vector<std::int64_t> group_index;              ///< expert-grouped row -> received row
  std::vector<std::int64_t> ungroup;                  ///< received row -> expert-grouped row
  std::int64_t received = 0;
};

/// `kept`: this rank's rows per expert (all experts); `recv_counts[src * el + j]`: the rows rank src sends
/// to local expert j.
inline MoeExchange plan_exchange(const std::vector<std::int64_t>& kept,
                                 const std::vector<std::int64_t>& recv_counts, int n, int el) {
  MoeExchange x;
  const auto at = [el](int r, int j) { return static_cast<std::size_t>(r * el + j); };
  x.send_splits.assign(static_cast<std::size_t>(n), 0);
  x.recv_splits.assign(static_cast<std::size_t>(n), 0);
  x.expert_rows.assign(static_cast<std::size_t>(el), 0);
  for (int r = 0; r < n; ++r) {
    for (int j = 0; j < el; ++j) {
      x.send_splits[static_cast<std::size_t>(r)] += kept[at(r, j)];
      x.recv_splits[static_cast<std::size_t>(r)] += recv_counts[at(r, j)];
      x.expert_rows[static_cast<std::size_t>(j)] += recv_counts[at(r, j)];
    }
  }
  x.received = std::accumulate(x.recv_splits.begin(), x.recv_splits.end(), std::int64_t{0});
  x.group_index.reserve(static_cast<std::size_t>(x.received));
  for (int j = 0; j < el; ++j) {
    std::int64_t offset = 0; // of rank r's block in the received rows
    for (int r = 0; r < n; ++r) {
      std::int64_t before = 0; // rows for local experts < j from rank r
      for (int q = 0; q < j; ++q) {
        before += recv_counts[at(r, q)];
      }
      for (std::int64_t i = 0; i < recv_counts[at(r, j)]; ++i) {
        x.group_index.push_back(offset + before + i);
      }
      offset += x.recv_splits[static_cast<std::size_t>(r)];
    }
  }
  x.ungroup.assign(static_cast<std::size_t>(x.received), 0);
  for (std::size_t g = 0; g < x.group_index.size(); ++g) {
    x.ungroup[static_cast<std::size_t>(x.group_index[g])] = static_cast<std::int64_t>(g);
  }
  return x;
}

/// d loss / d logits (t, experts) from the gates' gradients `dgate` (t, k) and `aux_dprob` (per expert:
/// the load-balancing term's gradient by each token's probability, the same for every token; empty:
/// none).
inline std::vector<double> router_grad(const MoeRouting& r, const std::vector<double>& dgate,
                                       const std::vector<double>& aux_dprob) {
  const auto e_count = static_cast<std::size_t>(r.experts);
  const int k = r.k;
  std::vector<double> dlogits(static_cast<std::size_t>(r.tokens) * e_count, 0.0);
  std::vector<double> dp(e_count);
  for (std::int64_t i = 0; i < r.tokens; ++i) {
    const double* p = r.probs.data() + static_cast<std::size_t>(i) * e_count;
    if (aux_dprob.empty()) {
      std::fill(dp.begin(), dp.end(), 0.0);
    } else {
      dp = aux_dprob;
    }
    double sum = 0;
    double dot = 0; // sum_j dgate_j gate_j
    for (int j = 0; j < k; ++j) {
      const auto a = static_cast<std::size_t>(i * k + j);
      sum += p[r.chosen[a]];
      dot += dgate[a] * r.gates[a];
    }
    for (int j = 0; j < k; ++j) {
      const auto a = static_cast<std::size_t>(i * k + j);
      dp[static_cast<std::size_t>(r.chosen[a])] += k == 1 ? dgate[a] : (dgate[a] - dot) / sum;
    }
    double pd = 0;
    for (std::size_t e = 0; e < e_count; ++e) {
      pd += p[e] * dp[e];
    }
    for (std::size_t e = 0; e < e_count; ++e) {
      dlogits[static_cast<std::size_t>(i) * e_count + e] = p[e] * (dp[e] - pd);
    }
  }
  return dlogits;
}

} // namespace detail
} // namespace dtensor::nn
