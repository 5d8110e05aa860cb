#pragma once
// Scaled dot-product attention on one device's tensors, forward and backward, blockwise with an online
// softmax (the flash-attention schedule): the seq_q x seq_k score matrix is never held, only one block of
// block_q x block_k scores per head at a time, so memory is O(seq * head_dim) per head.
//
//   auto [o, lse] = dtensor::local::attention_forward(q, k, v, {.causal = true});
//   auto [dq, dk, dv] = dtensor::local::attention_backward(q, k, v, o, lse, d_o, {.causal = true});
//
// Shapes: q (batch, heads, seq_q, head_dim), k (batch, kv_heads, seq_k, head_dim), v (batch, kv_heads,
// seq_k, v_dim); o (batch, heads, seq_q, v_dim). kv_heads divides heads (GQA; MQA is kv_heads 1): q head h
// reads kv head h / (heads / kv_heads). lse (batch, heads, seq_q) is the log-sum-exp of each query row's
// scaled scores (compute type), -inf for a row that sees no key (its output row is 0).
//
// Forward, per head and block of query rows: m (row max) and l (row sum of exp) are carried across key
// blocks, acc = sum exp(s - m) v rescaled by exp(m_old - m) when m grows; o = acc / l, lse = m + log l.
// Backward recomputes each block's probabilities p = exp(s - lse) from lse (nothing seq x seq is stored):
// with D = rowsum(dO * o), dv += p^T dO, dp = dO v^T, ds = p (dp - D), dq += scale ds k,
// dk += scale ds^T q. The block products are BLAS GEMMs (the dtensor::blas target), the exponentials
// local::math::exp over whole rows (they vectorise); bfloat16 and half compute in float (inputs converted
// once, O(seq * head_dim)), float in float, double in double.
//
// Positions (AttentionCoords): the causal mask keeps key j for query i when k_pos[j] <= q_pos[i], with
// positions global (a shard of the sequence passes its rows' global indices), so a sharded or permuted
// sequence is masked as the whole one. Default positions are 0, 1, ... for both, which is torch's
// is_causal (the top-left aligned lower triangle) when seq_q != seq_k. A key block wholly after a query
// block's last position is skipped. Dropout (p > 0, training) drops each probability by the
// sharding-invariant generator (local/random.hpp's dropout_keeps) at the global flat index of (batch,
// head, query position, key position) in a (batch, heads, seq_q, seq_k) tensor, and scales kept ones by
// 1 / (1 - p): any sharding of batch, heads or sequence drops the same weights. It needs dtensor::random.
//
// CUDA tensors (all on one device) run the kernels of local/attention_cuda.hpp, the same attention with one
// thread per row, in translation units compiled by nvcc; in other TUs they are an error saying so.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/attention_cuda.hpp"
#include "dtensor/local/blas.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/math.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/random.hpp"

namespace dtensor::local {

/// What an attention call computes.
struct AttentionParams {
  bool causal = false;
  double scale = 0;   ///< the scores' factor; 0: 1 / sqrt(head_dim)
  double dropout = 0; ///< probability of dropping an attention weight (0: none; needs dtensor::random)
  std::uint64_t seed = 0;
  std::uint64_t offset = 0; ///< the generator's stream (give each call its own, as for dropout)
};

/// Where a local attention problem sits in the global one (defaults: it is the whole problem).
struct AttentionCoords {
  std::int64_t batch0 = 0;             ///< global batch index of local batch 0
  std::int64_t head0 = 0;              ///< global q head of local head 0
  std::int64_t heads = 0;              ///< global q heads; 0: the local count
  std::int64_t kv_heads = 0;           ///< global k/v heads (0: local); local kv head 0 is head0 / group
  std::int64_t seq_q = 0;              ///< global query length; 0: the local one
  std::int64_t seq_k = 0;              ///< global key length; 0: the local one
  const std::int64_t* q_pos = nullptr; ///< global position of each local query row; null: 0, 1, ...
  const std::int64_t* k_pos = nullptr; ///< global position of each local key row; null: 0, 1, ...
};

/// Query rows and key rows handled together (the score block is block_q x block_k of the compute type).
inline constexpr std::int64_t attention_block_q = 128;
inline constexpr std::int64_t attention_block_k = 256;

template <class T>
struct AttentionOut {
  Tensor<T, 4> out;
  Tensor<compute_t<T>, 3> lse;
};

template <class T>
struct AttentionGrads {
  Tensor<T, 4> dq, dk, dv;
};

inline namespace DTENSOR_LOCAL_OPS_NS {
namespace attention_detail {

/// c = alpha op(a) op(b) + beta c, row-major (m x n), k the contracted size.
template <class C>
void gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, C alpha, const C* a,
          std::int64_t lda, const C* b, std::int64_t ldb, C beta, C* c, std::int64_t ldc) {
  static_assert(detail::host_blas_linked_v<C>,
                "attention on host tensors runs its blocks on a BLAS: link the dtensor::blas CMake target");
#if DTENSOR_HAS_BLAS
  if (m == 0 || n == 0) {
    return;
  }
  if (k == 0) { // BLAS wants leading dims >= 1 even for an empty product
    for (std::int64_t r = 0; r < m; ++r) {
      for (std::int64_t j = 0; j < n; ++j) {
        c[r * ldc + j] = beta == C(0) ? C(0) : beta * c[r * ldc + j];
      }
    }
    return;
  }
  const auto ta_ = ta ? CblasTrans : CblasNoTrans;
  const auto tb_ = tb ? CblasTrans : CblasNoTrans;
  const auto i = [](std::int64_t x) { return static_cast<int>(x); };
  if constexpr (std::is_same_v<C, float>) {
    cblas_sgemm(CblasRowMajor, ta_, tb_, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, ta_, tb_, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  }
#endif
}

/// max(init, x[0..n)) and sum(x[0..n)) in host_lanes partial results, so the loops vectorise (a single
/// accumulator would be a serial dependence GCC keeps in order).
template <class C>
C row_max(const C* x, std::int64_t n, C init) {
  C lane[host_lanes];
  std::fill(lane, lane + host_lanes, init);
  std::int64_t c = 0;
  for (; c + host_lanes <= n; c += host_lanes) {
    for (int j = 0; j < host_lanes; ++j) {
      lane[j] = x[c + j] > lane[j] ? x[c + j] : lane[j];
    }
  }
  for (; c < n; ++c) {
    lane[0] = x[c] > lane[0] ? x[c] : lane[0];
  }
  return *std::max_element(lane, lane + host_lanes);
}
template <class C>
C row_sum(const C* x, std::int64_t n) {
  C lane[host_lanes] = {};
  std::int64_t c = 0;
  for (; c + host_lanes <= n; c += host_lanes) {
    for (int j = 0; j < host_lanes; ++j) {
      lane[j] += x[c + j];
    }
  }
  for (; c < n; ++c) {
    lane[0] += x[c];
  }
  C s = 0;
  for (int j = 0; j < host_lanes; ++j) {
    s += lane[j];
  }
  return s;
}

/// x[c] = exp(x[c] - shift) for c < n (exactly 0 where x[c] is -inf, a masked score), in blocks of
/// host_block elements: a loop of fixed trip count over math::exp vectorises, one up to n does not.
template <class C>
void exp_shifted_blocks(C* x, std::int64_t n, C shift) {
  std::int64_t c = 0;
  for (; c + host_block <= n; c += host_block) {
    C* b = x + c;
    for (int j = 0; j < host_block; ++j) {
      b[j] = math::exp(b[j] - shift);
    }
  }
  for (; c < n; ++c) {
    x[c] = math::exp(x[c] - shift);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__AVX2__)
#define DTENSOR_ATTENTION_AVX2_CLONE 1
/// The same loop compiled for AVX2 (8 floats a vector instead of SSE2's 4), chosen at run time where the
/// CPU has it. Without FMA: GCC contracts nothing, so each element is the same IEEE operations and the
/// results are bit-identical to the SSE2 loop's.
[[gnu::target("avx2"), gnu::flatten]] inline void exp_shifted_avx2(float* x, std::int64_t n, float shift) {
  exp_shifted_blocks(x, n, shift);
}
#endif

template <class C>
void exp_shifted(C* x, std::int64_t n, C shift) {
#if DTENSOR_ATTENTION_AVX2_CLONE
  if constexpr (std::is_same_v<C, float>) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) {
      exp_shifted_avx2(x, n, shift);
      return;
    }
  }
#endif
  exp_shifted_blocks(x, n, shift);
}

/// t as a contiguous tensor of the compute type C (t itself when it already is one).
template <class C, class T>
Tensor<C, 4> as_compute(const Tensor<T, 4>& t) {
  if constexpr (std::is_same_v<C, T>) {
    return t.contiguous();
  } else {
    const Tensor<T, 4> c = t.contiguous();
    Tensor<C, 4> out(c.shape(), c.device());
    if (c.device().is_meta()) {
      return out;
    }
    const T* src = c.data();
    C* dst = out.data();
    for (std::int64_t i = 0; i < c.numel(); ++i) {
      dst[i] = static_cast<C>(src[i]);
    }
    return out;
  }
}

template <class T, class C>
Tensor<T, 4> from_compute(Tensor<C, 4> t) {
  if constexpr (std::is_same_v<C, T>) {
    return t;
  } else {
    Tensor<T, 4> out(t.shape(), t.device());
    for (std::int64_t i = 0; i < t.numel() && !t.device().is_meta(); ++i) {
      out.data()[i] = T(t.data()[i]);
    }
    return out;
  }
}

/// The sizes of one call, checked.
struct Dims {
  std::int64_t batch, heads, kv_heads, sq, sk, d, dv, group;
};

template <class T>
Dims check_dims(const char* op, const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                const AttentionCoords& at) {
  const auto s = [](const auto& t) { return ::dtensor::detail::shape_to_string(t.shape()); };
  const std::string shapes = std::string(op) + ": q " + s(q) + ", k " + s(k) + ", v " + s(v);
  DTENSOR_CHECK(k.device() == q.device() && v.device() == q.device(),
                shapes + ": q, k and v must be on one device (q on " + q.device().to_string() + ", k on " +
                    k.device().to_string() + ", v on " + v.device().to_string() + ")");
  const Dims d{q.shape()[0], q.shape()[1], k.shape()[1], q.shape()[2],
               k.shape()[2], q.shape()[3], v.shape()[3], 1};
  DTENSOR_CHECK(k.shape()[0] == d.batch && v.shape()[0] == d.batch,
                shapes + ": q, k and v must have the same batch size (dim 0)");
  DTENSOR_CHECK(k.shape()[3] == d.d, shapes + ": q and k must have the same head_dim (dim 3)");
  DTENSOR_CHECK(v.shape()[1] == d.kv_heads && v.shape()[2] == d.sk,
                shapes + ": k and v must have the same heads and sequence length (dims 1 and 2)");
  const std::int64_t heads = at.heads > 0 ? at.heads : d.heads;
  const std::int64_t kv_heads = at.kv_heads > 0 ? at.kv_heads : d.kv_heads;
  DTENSOR_CHECK((kv_heads == 0 && heads == 0) || (kv_heads > 0 && heads % kv_heads == 0),
                shapes + ": k/v's heads (" + std::to_string(kv_heads) + ") must divide q's heads (" +
                    std::to_string(heads) + "): each group of q heads shares one k/v head");
  Dims r = d;
  r.group = kv_heads > 0 ? heads / kv_heads : 1;
  // local q head h reads local kv head (head0 + h) / group - head0 / group
  const std::int64_t need = d.heads == 0 ? 0 : (at.head0 + d.heads - 1) / r.group - at.head0 / r.group + 1;
  DTENSOR_CHECK(need <= d.kv_heads, shapes + ": q heads [" + std::to_string(at.head0) + ", " +
                                        std::to_string(at.head0 + d.heads) + ") need " +
                                        std::to_string(need) + " k/v heads (groups of " +
                                        std::to_string(r.group) + "), k/v hold " +
                                        std::to_string(d.kv_heads));
  return r;
}

/// Positions of n local rows: `given`, or 0, 1, ...
inline std::vector<std::int64_t> positions(const std::int64_t* given, std::int64_t n) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    p[static_cast<std::size_t>(i)] = given ? given[i] : i;
  }
  return p;
}

/// The smallest and largest position of each block of `block` rows.
struct BlockRange {
  std::int64_t lo, hi;
};
inline std::vector<BlockRange> block_ranges(const std::vector<std::int64_t>& pos, std::int64_t block) {
  std::vector<BlockRange> r;
  for (std::size_t i = 0; i < pos.size(); i += static_cast<std::size_t>(block)) {
    const auto end = std::min(pos.size(), i + static_cast<std::size_t>(block));
    const auto [lo, hi] = std::minmax_element(pos.begin() + static_cast<std::ptrdiff_t>(i),
                                              pos.begin() + static_cast<std::ptrdiff_t>(end));
    r.push_back({*lo, *hi});
  }
  return r;
}

/// Everything a head's blocks need besides its data: scale, mask, dropout.
template <class C>
struct Problem {
  Dims dims;
  C scale;
  bool causal;
  double p;
  std::uint64_t seed, offset;
  std::int64_t batch0, head0, heads_g, sq_g, sk_g;
  std::vector<std::int64_t> qp, kp;
  std::vector<BlockRange> qb, kb;

  Problem(const Dims& d, const AttentionParams& a, const AttentionCoords& c)
      : dims(d), scale(static_cast<C>(a.scale != 0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(d.d)))),
        causal(a.causal), p(a.dropout), seed(a.seed), offset(a.offset), batch0(c.batch0), head0(c.head0),
        heads_g(c.heads > 0 ? c.heads : d.heads), sq_g(c.seq_q > 0 ? c.seq_q : d.sq),
        sk_g(c.seq_k > 0 ? c.seq_k : d.sk), qp(positions(c.q_pos, d.sq)), kp(positions(c.k_pos, d.sk)),
        qb(block_ranges(qp, attention_block_q)), kb(block_ranges(kp, attention_block_k)) {
    DTENSOR_CHECK(p >= 0 && p <= 1,
                  "attention: dropout probability " + std::to_string(p) + " outside [0, 1]");
  }

  /// Whether key block jb is wholly masked for query block ib.
  bool skipped(std::size_t ib, std::size_t jb) const { return causal && kb[jb].lo > qb[ib].hi; }
  /// Whether some key of block jb is masked for some query of block ib.
  bool partly_masked(std::size_t ib, std::size_t jb) const { return causal && kb[jb].hi > qb[ib].lo; }

  /// Sets masked scores of the block (rows i0.., columns j0..) to -inf.
  void mask(C* s, std::int64_t ld, std::int64_t i0, std::int64_t mi, std::int64_t j0, std::int64_t nj) const {
    constexpr C ninf = -std::numeric_limits<C>::infinity();
    for (std::int64_t r = 0; r < mi; ++r) {
      const std::int64_t q = qp[static_cast<std::size_t>(i0 + r)];
      for (std::int64_t c = 0; c < nj; ++c) {
        s[r * ld + c] = kp[static_cast<std::size_t>(j0 + c)] > q ? ninf : s[r * ld + c];
      }
    }
  }

  /// Multiplies the block's probabilities by the dropout mask / (1 - p) (b, h: local batch and q head).
  void drop(C* s, std::int64_t ld, std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t mi,
            std::int64_t j0, std::int64_t nj) const {
    if (p == 0) {
      return;
    }
#if DTENSOR_HAS_RANDOM123
    {
      const C keep = p < 1 ? static_cast<C>(1.0 / (1.0 - p)) : C(0);
      const auto bh = static_cast<std::uint64_t>((batch0 + b) * heads_g + head0 + h);
      for (std::int64_t r = 0; r < mi; ++r) {
        const auto row = (bh * static_cast<std::uint64_t>(sq_g) +
                          static_cast<std::uint64_t>(qp[static_cast<std::size_t>(i0 + r)])) *
                         static_cast<std::uint64_t>(sk_g);
        for (std::int64_t c = 0; c < nj; ++c) {
          const auto index = row + static_cast<std::uint64_t>(kp[static_cast<std::size_t>(j0 + c)]);
          s[r * ld + c] *= dropout_keeps(seed, offset, index, p) ? keep : C(0);
        }
      }
    }
#else
    (void)s, (void)ld, (void)b, (void)h, (void)i0, (void)mi, (void)j0, (void)nj;
    DTENSOR_CHECK(false, "attention: dropout needs Random123 (link the dtensor::random CMake target)");
#endif
  }
};

/// The flops of `gemm_dims` GEMMs over the query-key pairs the problem computes, per (batch, q head): every
/// pair, or under the causal mask the keys at or before each query. The forward's two GEMMs run over d and
/// dv (gemm_dims = d + dv); the backward's five over 3d + 2dv (scores again, dP, dV, dQ, dK).
template <class C>
double attention_flops(const Problem<C>& pr, std::int64_t gemm_dims) {
  double pairs = 0;
  if (!pr.causal) {
    pairs = static_cast<double>(pr.qp.size()) * static_cast<double>(pr.kp.size());
  } else { // the keys at or before each query: one merge when both are in order (the usual case)
    std::vector<std::int64_t> sorted;
    const std::vector<std::int64_t>* keys = &pr.kp;
    if (!std::is_sorted(pr.kp.begin(), pr.kp.end())) {
      sorted = pr.kp;
      std::sort(sorted.begin(), sorted.end());
      keys = &sorted;
    }
    const bool in_order = std::is_sorted(pr.qp.begin(), pr.qp.end());
    std::size_t seen = 0;
    for (std::int64_t q : pr.qp) {
      if (in_order) {
        while (seen < keys->size() && (*keys)[seen] <= q) {
          ++seen;
        }
      } else {
        seen = static_cast<std::size_t>(std::upper_bound(keys->begin(), keys->end(), q) - keys->begin());
      }
      pairs += static_cast<double>(seen);
    }
  }
  return 2.0 * static_cast<double>(pr.dims.batch * pr.dims.heads) * pairs * static_cast<double>(gemm_dims);
}

#if DTENSOR_LOCAL_OPS_CUDA
/// The kernels' inputs: q, k and v contiguous on q's stream, the positions on the device, and the problem
/// the kernels read (attention_cuda.hpp).
template <class T, class C>
struct CudaInputs {
  Device dev;
  cudaStream_t st;
  Tensor<std::int64_t, 1> qp, kp;
  Tensor<T, 4> q, k, v;
  attention_cuda::Problem<T, C> problem;

  CudaInputs(const Problem<C>& pr, const Tensor<T, 4>& q_, const Tensor<T, 4>& k_, const Tensor<T, 4>& v_)
      : dev(q_.device()), st(q_.stream()),
        qp(attention_cuda::device_positions(pr.qp.data(), pr.dims.sq, dev, st)),
        kp(attention_cuda::device_positions(pr.kp.data(), pr.dims.sk, dev, st)),
        q(attention_cuda::ready(q_, st)), k(attention_cuda::ready(k_, st)), v(attention_cuda::ready(v_, st)) {
    const Dims& d = pr.dims;
    DTENSOR_CHECK(pr.p == 0 || DTENSOR_HAS_RANDOM123,
                  "attention: dropout needs Random123 (link the dtensor::random CMake target)");
    problem = {q.data(), k.data(), v.data(),  d.batch,   d.heads,    d.kv_heads, d.sq,     d.sk,
               d.d,      d.dv,     d.group,   pr.head0,  qp.data(),  kp.data(),  pr.scale, pr.causal,
               pr.p,     pr.seed,  pr.offset, pr.batch0, pr.heads_g, pr.sq_g,    pr.sk_g};
  }
};
#endif

/// Attention of CUDA tensors (attention_cuda.hpp): (o, lse).
template <class T, class C>
AttentionOut<T> forward_cuda(const Problem<C>& pr, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                             const Tensor<T, 4>& v) {
#if DTENSOR_LOCAL_OPS_CUDA
  const Dims& d = pr.dims;
  const CudaInputs<T, C> in(pr, q, k, v);
  const Device dev = in.dev;
  const cudaStream_t st = in.st;
  const std::int64_t rows = d.batch * d.heads * d.sq;
  Tensor<T, 4> out({d.batch, d.heads, d.sq, d.dv}, dev, st);
  Tensor<C, 3> lse({d.batch, d.heads, d.sq}, dev, st);
  Tensor<C, 2> acc({rows, d.dv}, dev, st);
  attention_cuda::launch_rows(
      attention_cuda::ForwardRows<T, C>{in.problem, out.data(), acc.data(), lse.data()}, rows, dev, st,
      "attention");
  return {std::move(out), std::move(lse)};
#else
  (void)pr, (void)k, (void)v;
  DTENSOR_CHECK(false, "attention of CUDA tensors (" + q.device().to_string() +
                           ") runs as kernels in a translation unit compiled by nvcc with the CUDA Toolkit's "
                           "Thrust: compile this file as CUDA");
  return {};
#endif
}

/// The backward of forward_cuda: (dq, dk, dv).
template <class T, class C>
AttentionGrads<T> backward_cuda(const Problem<C>& pr, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                const Tensor<T, 4>& v, const Tensor<T, 4>& o, const Tensor<C, 3>& lse,
                                const Tensor<T, 4>& d_o) {
#if DTENSOR_LOCAL_OPS_CUDA
  const Dims& d = pr.dims;
  DTENSOR_CHECK(o.device() == q.device() && lse.device() == q.device() && d_o.device() == q.device(),
                "attention backward: o, lse and dO must be on q's device, " + q.device().to_string());
  const CudaInputs<T, C> in(pr, q, k, v);
  const Device dev = in.dev;
  const cudaStream_t st = in.st;
  const auto oc = attention_cuda::ready(o, st);
  const auto gc = attention_cuda::ready(d_o, st);
  const auto lc = attention_cuda::ready(lse, st);
  const auto& a = in.problem;
  const std::int64_t rows_q = d.batch * d.heads * d.sq;
  const std::int64_t rows_k = d.batch * d.kv_heads * d.sk;
  Tensor<T, 4> dq(in.q.shape(), dev, st);
  Tensor<T, 4> dk(in.k.shape(), dev, st);
  Tensor<T, 4> dv(in.v.shape(), dev, st);
  Tensor<C, 1> big_d({rows_q}, dev, st);
  Tensor<C, 2> acc_q({rows_q, d.d}, dev, st);
  attention_cuda::launch_rows(attention_cuda::QueryRows<T, C>{a, oc.data(), gc.data(), lc.data(),
                                                              big_d.data(), acc_q.data(), dq.data()},
                              rows_q, dev, st, "attention backward");
  Tensor<C, 2> acc_k({rows_k, d.d}, dev, st);
  Tensor<C, 2> acc_v({rows_k, d.dv}, dev, st);
  attention_cuda::launch_rows(attention_cuda::KeyRows<T, C>{a, gc.data(), lc.data(), big_d.data(),
                                                            acc_k.data(), acc_v.data(), dk.data(), dv.data()},
                              rows_k, dev, st, "attention backward");
  return {std::move(dq), std::move(dk), std::move(dv)};
#else
  (void)pr, (void)k, (void)v, (void)o, (void)lse, (void)d_o;
  DTENSOR_CHECK(false, "attention backward of CUDA tensors (" + q.device().to_string() +
                           ") runs as kernels in a translation unit compiled by nvcc with the CUDA Toolkit's "
                           "Thrust: compile this file as CUDA");
  return {};
#endif
}

} // namespace attention_detail

/// Attention of host tensors: (o, lse); see the top of the file. Throws Error naming the shapes when they
/// do not fit each other.
template <class T>
AttentionOut<T> attention_forward(const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                                  const AttentionParams& params = {}, const AttentionCoords& coords = {}) {
  using namespace attention_detail;
  using C = compute_t<T>;
  static_assert(detail::gemm_element_v<T>, "attention: float, double, bfloat16 or half");
  const Dims d = check_dims("attention", q, k, v, coords);
  const Problem<C> pr(d, params, coords);
  count_flops(attention_flops(pr, d.d + d.dv)); // FlopCounter (core/flop_counter.hpp), meta included
  if (q.device().is_cuda()) {
    return forward_cuda(pr, q, k, v);
  }
  const Tensor<C, 4> qc = as_compute<C>(q);
  const Tensor<C, 4> kc = as_compute<C>(k);
  const Tensor<C, 4> vc = as_compute<C>(v);
  Tensor<C, 4> out({d.batch, d.heads, d.sq, d.dv}, q.device());
  Tensor<C, 3> lse({d.batch, d.heads, d.sq}, q.device());
  if (q.device().is_meta()) { // what the host computes holds, no kernel
    return {from_compute<T>(std::move(out)), std::move(lse)};
  }
  constexpr C ninf = -std::numeric_limits<C>::infinity();
  constexpr std::int64_t bq = attention_block_q;
  constexpr std::int64_t bk = attention_block_k;
  std::vector<C> s(static_cast<std::size_t>(bq * bk));
  std::vector<C> m(bq), l(bq), alpha(bq);
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.heads; ++h) {
      const std::int64_t hk = (pr.head0 + h) / d.group - pr.head0 / d.group;
      const C* Q = qc.data() + (b * d.heads + h) * d.sq * d.d;
      const C* K = kc.data() + (b * d.kv_heads + hk) * d.sk * d.d;
      const C* V = vc.data() + (b * d.kv_heads + hk) * d.sk * d.dv;
      C* O = out.data() + (b * d.heads + h) * d.sq * d.dv;
      C* L = lse.data() + (b * d.heads + h) * d.sq;
      for (std::int64_t i0 = 0, ib = 0; i0 < d.sq; i0 += bq, ++ib) {
        const std::int64_t mi = std::min(bq, d.sq - i0);
        C* acc = O + i0 * d.dv; // accumulated in place
        std::fill(acc, acc + mi * d.dv, C(0));
        std::fill(m.begin(), m.end(), ninf);
        std::fill(l.begin(), l.end(), C(0));
        for (std::int64_t j0 = 0, jb = 0; j0 < d.sk; j0 += bk, ++jb) {
          const std::int64_t nj = std::min(bk, d.sk - j0);
          if (pr.skipped(static_cast<std::size_t>(ib), static_cast<std::size_t>(jb))) {
            continue;
          }
          gemm<C>(false, true, mi, nj, d.d, pr.scale, Q + i0 * d.d, d.d, K + j0 * d.d, d.d, C(0), s.data(),
                  bk);
          if (pr.partly_masked(static_cast<std::size_t>(ib), static_cast<std::size_t>(jb))) {
            pr.mask(s.data(), bk, i0, mi, j0, nj);
          }
          for (std::int64_t r = 0; r < mi; ++r) {
            C* row = s.data() + r * bk;
            const C mx = row_max(row, nj, m[r]);
            if (mx == ninf) { // nothing visible yet: the row's probabilities are all 0
              std::fill(row, row + nj, C(0));
              alpha[r] = C(1);
              continue;
            }
            exp_shifted(row, nj, mx);
            const C sum = row_sum(row, nj);
            alpha[r] = math::exp(m[r] - mx);
            l[r] = l[r] * alpha[r] + sum;
            m[r] = mx;
            if (alpha[r] != C(1)) {
              C* a = acc + r * d.dv;
              for (std::int64_t c = 0; c < d.dv; ++c) {
                a[c] *= alpha[r];
              }
            }
          }
          pr.drop(s.data(), bk, b, h, i0, mi, j0, nj);
          gemm<C>(false, false, mi, d.dv, nj, C(1), s.data(), bk, V + j0 * d.dv, d.dv, C(1), acc, d.dv);
        }
        for (std::int64_t r = 0; r < mi; ++r) {
          C* a = acc + r * d.dv;
          const C inv = l[r] > 0 ? C(1) / l[r] : C(0);
          for (std::int64_t c = 0; c < d.dv; ++c) {
            a[c] *= inv;
          }
          L[i0 + r] = l[r] > 0 ? m[r] + std::log(l[r]) : ninf;
        }
      }
    }
  }
  return {from_compute<T>(std::move(out)), std::move(lse)};
}

/// The gradients of attention_forward: (dq, dk, dv) from the forward's inputs, its o and lse, and dO.
/// The same params and coords as the forward (the mask and the dropout are made again).
template <class T>
AttentionGrads<T> attention_backward(const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                                     const Tensor<T, 4>& o, const Tensor<compute_t<T>, 3>& lse,
                                     const Tensor<T, 4>& d_o, const AttentionParams& params = {},
                                     const AttentionCoords& coords = {}) {
  using namespace attention_detail;
  using C = compute_t<T>;
  const Dims d = check_dims("attention backward", q, k, v, coords);
  const typename Tensor<T, 4>::Shape os{d.batch, d.heads, d.sq, d.dv};
  DTENSOR_CHECK(o.shape() == os && d_o.shape() == os,
                "attention backward: o " + ::dtensor::detail::shape_to_string(o.shape()) + " and dO " +
                    ::dtensor::detail::shape_to_string(d_o.shape()) +
                    " must have the forward output's shape " + ::dtensor::detail::shape_to_string(os));
  DTENSOR_CHECK((lse.shape() == typename Tensor<C, 3>::Shape{d.batch, d.heads, d.sq}),
                "attention backward: lse " + ::dtensor::detail::shape_to_string(lse.shape()) +
                    " is not (batch, heads, seq_q)");
  const Problem<C> pr(d, params, coords);
  count_flops(attention_flops(pr, 3 * d.d + 2 * d.dv));
  if (q.device().is_cuda()) {
    return backward_cuda(pr, q, k, v, o, lse, d_o);
  }
  const Tensor<C, 4> qc = as_compute<C>(q);
  const Tensor<C, 4> kc = as_compute<C>(k);
  const Tensor<C, 4> vc = as_compute<C>(v);
  const Tensor<C, 4> oc = as_compute<C>(o);
  const Tensor<C, 4> gc = as_compute<C>(d_o);
  const Tensor<C, 3> lc = lse.contiguous();
  Tensor<C, 4> dq = Tensor<C, 4>::zeros(qc.shape(), q.device());
  Tensor<C, 4> dk = Tensor<C, 4>::zeros(kc.shape(), q.device());
  Tensor<C, 4> dv = Tensor<C, 4>::zeros(vc.shape(), q.device());
  if (q.device().is_meta()) {
    return {from_compute<T>(std::move(dq)), from_compute<T>(std::move(dk)), from_compute<T>(std::move(dv))};
  }
  constexpr C ninf = -std::numeric_limits<C>::infinity();
  constexpr std::int64_t bq = attention_block_q;
  constexpr std::int64_t bk = attention_block_k;
  std::vector<C> p(static_cast<std::size_t>(bq * bk)), dp(p.size()), pd(params.dropout != 0 ? p.size() : 0);
  std::vector<C> delta(static_cast<std::size_t>(std::max<std::int64_t>(d.sq, 1)));
  for (std::int64_t b = 0; b < d.batch; ++b) {
    for (std::int64_t h = 0; h < d.heads; ++h) {
      const std::int64_t hk = (pr.head0 + h) / d.group - pr.head0 / d.group;
      const std::int64_t qoff = (b * d.heads + h) * d.sq;
      const std::int64_t koff = (b * d.kv_heads + hk) * d.sk;
      const C* Q = qc.data() + qoff * d.d;
      const C* K = kc.data() + koff * d.d;
      const C* V = vc.data() + koff * d.dv;
      const C* O = oc.data() + qoff * d.dv;
      const C* G = gc.data() + qoff * d.dv;
      const C* L = lc.data() + qoff;
      C* dQ = dq.data() + qoff * d.d;
      C* dK = dk.data() + koff * d.d;
      C* dV = dv.data() + koff * d.dv;
      for (std::int64_t i = 0; i < d.sq; ++i) { // D = rowsum(dO * o)
        C s = 0;
        for (std::int64_t c = 0; c < d.dv; ++c) {
          s += G[i * d.dv + c] * O[i * d.dv + c];
        }
        delta[static_cast<std::size_t>(i)] = s;
      }
      for (std::int64_t i0 = 0, ib = 0; i0 < d.sq; i0 += bq, ++ib) {
        const std::int64_t mi = std::min(bq, d.sq - i0);
        for (std::int64_t j0 = 0, jb = 0; j0 < d.sk; j0 += bk, ++jb) {
          const std::int64_t nj = std::min(bk, d.sk - j0);
          if (pr.skipped(static_cast<std::size_t>(ib), static_cast<std::size_t>(jb))) {
            continue;
          }
          gemm<C>(false, true, mi, nj, d.d, pr.scale, Q + i0 * d.d, d.d, K + j0 * d.d, d.d, C(0), p.data(),
                  bk);
          if (pr.partly_masked(static_cast<std::size_t>(ib), static_cast<std::size_t>(jb))) {
            pr.mask(p.data(), bk, i0, mi, j0, nj);
          }
          for (std::int64_t r = 0; r < mi; ++r) { // p = exp(s - lse); 0 for a row that sees nothing
            C* row = p.data() + r * bk;
            const C lr = L[i0 + r];
            if (lr == ninf) {
              std::fill(row, row + nj, C(0));
              continue;
            }
            exp_shifted(row, nj, lr);
          }
          // dp = dO v^T, through the dropout mask as the forward's p was
          gemm<C>(false, true, mi, nj, d.dv, C(1), G + i0 * d.dv, d.dv, V + j0 * d.dv, d.dv, C(0), dp.data(),
                  bk);
          if (pr.p != 0) {
            // z, the forward's dropout factors (0 or 1 / (1 - p)), drawn once into pd: dp *= z, so that dp
            // pairs with the plain p below, and dv += (p z)^T dO, the dropped probabilities
            std::fill(pd.begin(), pd.end(), C(1));
            pr.drop(pd.data(), bk, b, h, i0, mi, j0, nj);
            for (std::int64_t r = 0; r < mi; ++r) {
              C* z = pd.data() + r * bk;
              C* g = dp.data() + r * bk;
              const C* prob = p.data() + r * bk;
              for (std::int64_t c = 0; c < nj; ++c) {
                g[c] *= z[c];
                z[c] *= prob[c];
              }
            }
            gemm<C>(true, false, nj, d.dv, mi, C(1), pd.data(), bk, G + i0 * d.dv, d.dv, C(1), dV + j0 * d.dv,
                    d.dv);
          } else {
            gemm<C>(true, false, nj, d.dv, mi, C(1), p.data(), bk, G + i0 * d.dv, d.dv, C(1), dV + j0 * d.dv,
                    d.dv);
          }
          for (std::int64_t r = 0; r < mi; ++r) { // ds = p (dp - D), in p
            C* row = p.data() + r * bk;
            const C* dr = dp.data() + r * bk;
            const C D = delta[static_cast<std::size_t>(i0 + r)];
            for (std::int64_t c = 0; c < nj; ++c) {
              row[c] = row[c] * (dr[c] - D);
            }
          }
          gemm<C>(false, false, mi, d.d, nj, pr.scale, p.data(), bk, K + j0 * d.d, d.d, C(1), dQ + i0 * d.d,
                  d.d);
          gemm<C>(true, false, nj, d.d, mi, pr.scale, p.data(), bk, Q + i0 * d.d, d.d, C(1), dK + j0 * d.d,
                  d.d);
        }
      }
    }
  }
  return {from_compute<T>(std::move(dq)), from_compute<T>(std::move(dk)), from_compute<T>(std::move(dv))};
}

} // namespace DTENSOR_LOCAL_OPS_NS
} // namespace dtensor::local
