#pragma once
// Local attention of CUDA tensors (local/attention.hpp hands them here): the same forward and backward as
// the host kernel, as Thrust kernels with one thread per row, in translation units compiled by nvcc with
// the CUDA Toolkit's Thrust, or emulated on the host (DTENSOR_LOCAL_OPS_CUDA, local/copy.hpp); elsewhere
// a CUDA tensor is an error saying so.
//
//   forward, one thread per query row: an online softmax over the row's visible keys (running max m and
//     sum l, the output accumulated in the compute type and rescaled by exp(m_old - m) when m grows);
//     o = acc / l, lse = m + log l (-inf and a zero row when no key is visible);
//   backward, one thread per query row: D = rowsum(dO o), then dq = scale sum_j p (dO.v_j z - D) k_j with
//     p = exp(s - lse) recomputed and z the dropout factor; one thread per key row: dv = sum_i p z dO_i and
//     dk = scale sum_i p (dO_i.v z - D_i) q_i over the q heads of its group.
//
// Positions, the causal mask (key position <= query position), GQA and dropout (the keep of each weight from
// its global (batch, head, query, key) index) are those of the host kernel, so both compute the same
// attention; accumulation is in the compute type (float for bfloat16 and half). The kernels run on q's
// stream, stream-ordered as the other local ops on CUDA tensors. One thread per row keeps memory at
// O(rows x head_dim) and is simple to check; it is not a tiled flash-attention kernel (no shared-memory
// blocks, no tensor cores).

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/core/config.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/random.hpp"

namespace dtensor::local {
inline namespace DTENSOR_LOCAL_OPS_NS {
namespace attention_cuda {

#if DTENSOR_LOCAL_OPS_CUDA

DTENSOR_HOST_DEVICE inline float exp_of(float x) {
  return expf(x);
}
DTENSOR_HOST_DEVICE inline double exp_of(double x) {
  return ::exp(x);
}
DTENSOR_HOST_DEVICE inline float log_of(float x) {
  return logf(x);
}
DTENSOR_HOST_DEVICE inline double log_of(double x) {
  return ::log(x);
}

/// What every thread reads: contiguous (batch, heads, seq, dim) inputs, positions on the device.
template <class T, class C>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  std::int64_t batch, heads, kv_heads, sq, sk, d, dv, group, head0;
  const std::int64_t* qp;
  const std::int64_t* kp;
  C scale;
  bool causal;
  double p;
  std::uint64_t seed, offset;
  std::int64_t batch0, heads_g, sq_g, sk_g;

  /// The local k/v head of local q head h.
  DTENSOR_HOST_DEVICE std::int64_t kv_head(std::int64_t h) const {
    return (head0 + h) / group - head0 / group;
  }
  /// The local q heads [first, end) that read local k/v head hk: kv_head(h) == hk exactly for them.
  DTENSOR_HOST_DEVICE std::int64_t first_head(std::int64_t hk) const {
    const std::int64_t h = (hk + head0 / group) * group - head0;
    return h < 0 ? 0 : h;
  }
  DTENSOR_HOST_DEVICE std::int64_t end_head(std::int64_t hk) const {
    const std::int64_t h = (hk + head0 / group + 1) * group - head0;
    return h > heads ? heads : h;
  }
  DTENSOR_HOST_DEVICE bool visible(std::int64_t i, std::int64_t j) const { return !causal || kp[j] <= qp[i]; }
  DTENSOR_HOST_DEVICE C dot(const T* a, const T* b, std::int64_t n) const {
    C s = 0;
    for (std::int64_t c = 0; c < n; ++c) {
      s += static_cast<C>(a[c]) * static_cast<C>(b[c]);
    }
    return s;
  }
  /// The dropout factor of weight (b, h, i, j): 0 or 1 / (1 - p).
  DTENSOR_HOST_DEVICE C keep(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (p == 0) {
      return C(1);
    }
#if DTENSOR_HAS_RANDOM123
    const auto bh = static_cast<std::uint64_t>((batch0 + b) * heads_g + head0 + h);
    const auto index = (bh * static_cast<std::uint64_t>(sq_g) + static_cast<std::uint64_t>(qp[i])) *
                           static_cast<std::uint64_t>(sk_g) +
                       static_cast<std::uint64_t>(kp[j]);
    return dropout_keeps(seed, offset, index, p) ? (p < 1 ? static_cast<C>(1.0 / (1.0 - p)) : C(0)) : C(0);
#else
    (void)b, (void)h, (void)i, (void)j;
    return C(1); // refused on the host before the launch
#endif
  }
};

template <class C>
DTENSOR_HOST_DEVICE C minus_infinity() {
  return static_cast<C>(-HUGE_VAL);
}

/// Row r of a contiguous (batch, heads, seq, ...) tensor as (b, h, i).
struct RowIndex {
  std::int64_t b, h, i;
};
DTENSOR_HOST_DEVICE inline RowIndex row_index(std::int64_t r, std::int64_t heads, std::int64_t seq) {
  return {r / (seq * heads), (r / seq) % heads, r % seq};
}

/// One query row: o and lse (acc: the row's accumulator, compute type).
template <class T, class C>
struct ForwardRows {
  Problem<T, C> a;
  T* o;
  C* acc;
  C* lse;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    const auto [b, h, i] = row_index(r, a.heads, a.sq);
    const std::int64_t hk = a.kv_head(h);
    const T* qr = a.q + r * a.d;
    const T* K = a.k + (b * a.kv_heads + hk) * a.sk * a.d;
    const T* V = a.v + (b * a.kv_heads + hk) * a.sk * a.dv;
    C* ac = acc + r * a.dv;
    for (std::int64_t c = 0; c < a.dv; ++c) {
      ac[c] = 0;
    }
    const C ninf = minus_infinity<C>();
    C m = ninf;
    C l = 0;
    for (std::int64_t j = 0; j < a.sk; ++j) {
      if (!a.visible(i, j)) {
        continue;
      }
      const C s = a.scale * a.dot(qr, K + j * a.d, a.d);
      if (s > m) {
        const C corr = m == ninf ? C(0) : exp_of(m - s);
        l *= corr;
        for (std::int64_t c = 0; c < a.dv; ++c) {
          ac[c] *= corr;
        }
        m = s;
      }
      const C w = exp_of(s - m);
      l += w;
      const C wz = w * a.keep(b, h, i, j);
      if (wz != C(0)) {
        for (std::int64_t c = 0; c < a.dv; ++c) {
          ac[c] += wz * static_cast<C>(V[j * a.dv + c]);
        }
      }
    }
    const C inv = l > 0 ? C(1) / l : C(0);
    for (std::int64_t c = 0; c < a.dv; ++c) {
      o[r * a.dv + c] = static_cast<T>(ac[c] * inv);
    }
    lse[r] = l > 0 ? m + log_of(l) : ninf;
  }
};

/// One query row of the backward: D = rowsum(dO o) (kept for the key rows) and dq.
template <class T, class C>
struct QueryRows {
  Problem<T, C> a;
  const T* o;
  const T* d_o;
  const C* lse;
  C* big_d;
  C* acc;
  T* dq;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    const auto [b, h, i] = row_index(r, a.heads, a.sq);
    const std::int64_t hk = a.kv_head(h);
    const T* qr = a.q + r * a.d;
    const T* gr = d_o + r * a.dv;
    const T* K = a.k + (b * a.kv_heads + hk) * a.sk * a.d;
    const T* V = a.v + (b * a.kv_heads + hk) * a.sk * a.dv;
    const C dd = a.dot(gr, o + r * a.dv, a.dv);
    big_d[r] = dd;
    C* ac = acc + r * a.d;
    for (std::int64_t c = 0; c < a.d; ++c) {
      ac[c] = 0;
    }
    const C l = lse[r];
    if (l != minus_infinity<C>()) {
      for (std::int64_t j = 0; j < a.sk; ++j) {
        if (!a.visible(i, j)) {
          continue;
        }
        const C pr = exp_of(a.scale * a.dot(qr, K + j * a.d, a.d) - l);
        const C ds = pr * (a.dot(gr, V + j * a.dv, a.dv) * a.keep(b, h, i, j) - dd);
        for (std::int64_t c = 0; c < a.d; ++c) {
          ac[c] += ds * static_cast<C>(K[j * a.d + c]);
        }
      }
    }
    for (std::int64_t c = 0; c < a.d; ++c) {
      dq[r * a.d + c] = static_cast<T>(a.scale * ac[c]);
    }
  }
};

/// One key row of the backward: dk and dv over the queries of the q heads that read its k/v head.
template <class T, class C>
struct KeyRows {
  Problem<T, C> a;
  const T* d_o;
  const C* lse;
  const C* big_d;
  C* acc_k;
  C* acc_v;
  T* dk;
  T* dv;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    const auto [b, hk, j] = row_index(r, a.kv_heads, a.sk);
    const T* kr = a.k + r * a.d;
    const T* vr = a.v + r * a.dv;
    C* ak = acc_k + r * a.d;
    C* av = acc_v + r * a.dv;
    for (std::int64_t c = 0; c < a.d; ++c) {
      ak[c] = 0;
    }
    for (std::int64_t c = 0; c < a.dv; ++c) {
      av[c] = 0;
    }
    for (std::int64_t h = a.first_head(hk); h < a.end_head(hk); ++h) {
      for (std::int64_t i = 0; i < a.sq; ++i) {
        const std::int64_t row = (b * a.heads + h) * a.sq + i;
        const C l = lse[row];
        if (!a.visible(i, j) || l == minus_infinity<C>()) {
          continue;
        }
        const T* qr = a.q + row * a.d;
        const T* gr = d_o + row * a.dv;
        const C pr = exp_of(a.scale * a.dot(qr, kr, a.d) - l);
        const C z = a.keep(b, h, i, j);
        const C pz = pr * z;
        for (std::int64_t c = 0; c < a.dv; ++c) {
          av[c] += pz * static_cast<C>(gr[c]);
        }
        const C ds = pr * (a.dot(gr, vr, a.dv) * z - big_d[row]);
        for (std::int64_t c = 0; c < a.d; ++c) {
          ak[c] += ds * static_cast<C>(qr[c]);
        }
      }
    }
    for (std::int64_t c = 0; c < a.d; ++c) {
      dk[r * a.d + c] = static_cast<T>(a.scale * ak[c]);
    }
    for (std::int64_t c = 0; c < a.dv; ++c) {
      dv[r * a.dv + c] = static_cast<T>(av[c]);
    }
  }
};

/// Runs f(r) for r in [0, rows) on `stream` of `device`, stream-ordered (local/copy.hpp's launcher).
template <class F>
void launch_rows(const F& f, std::int64_t rows, Device device, cudaStream_t stream, const char* what) {
  launch_kernel(f, rows, device, stream, what);
}

/// t, contiguous and on `stream`: t itself, or a copy on `stream` (local::copy joins the two streams), so
/// the kernels' operands live on the stream they run on.
template <class T, int R>
Tensor<T, R> ready(const Tensor<T, R>& t, cudaStream_t stream) {
  if (t.is_contiguous() && t.stream() == stream) {
    return t;
  }
  Tensor<T, R> c(t.shape(), t.device(), stream);
  copy(c, t);
  return c;
}

/// Row positions on the device: `given` (host), or 0, 1, ...
inline Tensor<std::int64_t, 1> device_positions(const std::int64_t* given, std::int64_t n, Device device,
                                                cudaStream_t stream) {
  Tensor<std::int64_t, 1> host({n});
  for (std::int64_t i = 0; i < n; ++i) {
    host.data()[i] = given ? given[i] : i;
  }
  Tensor<std::int64_t, 1> dev({n}, device, stream);
  dev.copy_from(host);
  return dev;
}

#endif // DTENSOR_LOCAL_OPS_CUDA

} // namespace attention_cuda
} // namespace DTENSOR_LOCAL_OPS_NS
} // namespace dtensor::local
