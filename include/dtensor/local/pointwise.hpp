#pragma once
// Local elementwise maps and reductions over one dim, on a rank's own tensors: the kernels under the
// sharded pointwise ops and reductions (ops/pointwise.hpp, ops/reduce.hpp).
//
//   auto y = dtensor::local::map(dtensor::local::Relu{}, x);              // y = relu(x)
//   auto z = dtensor::local::map(dtensor::local::Add{}, a, bias);         // bias: a's trailing dims
//   auto s = dtensor::local::reduce(dtensor::ReduceOp::sum, x, 1);        // keeps dim 1 with size 1
//
// They run on local/copy.hpp's launcher: a region collapsed into runs (RunLayout), one function
// object per tile, Thrust's cpp system on the host and a kernel on the tensor's stream in an nvcc TU. An
// operand of lower rank is broadcast over the leading dims (stride 0 there), as in torch. Elements are
// computed in float (double for double; the integer types in themselves) and rounded back. NaN propagates
// through max and min wherever it is, as torch's max/min do.
//
// On the host a run is computed in blocks of `host_block` elements: each operand's block is loaded into a
// local array, the element function runs over the arrays, the results are stored. The compute loop then
// has a known trip count and no aliasing, so GCC vectorises it even at -O2 (with the float exp and erf of
// local/math.hpp, which have no branches); the last n % host_block elements run one by one through the
// same function. A reduction over the innermost dim keeps host_lanes partial results (lane j takes
// elements j, j + host_lanes, ...), combined pairwise at the end: sums and products are rounded in that
// order rather than left to right (exact for integers and integer-valued floats, as before); max and min
// are exact in any order. A reduction over an outer dim keeps the left-to-right order for every output.

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/math.hpp"

namespace dtensor::detail {

/// Uninitialised memory of `shape` on `like`'s device, ordered on its stream.
template <class T, std::size_t R, int Rl>
Tensor<T, static_cast<int>(R)> empty_like(const std::array<std::int64_t, R>& shape,
                                          const Tensor<T, Rl>& like) {
#if DTENSOR_HAS_CUDA
  return Tensor<T, static_cast<int>(R)>(shape, like.device(), like.stream());
#else
  return Tensor<T, static_cast<int>(R)>(shape, like.device());
#endif
}

/// `t`'s strides as a rank-R array, broadcast over R - Rt leading dims (stride 0), after checking that its
/// shape is the trailing part of `shape`.
template <int R, class T, int Rt>
std::array<std::int64_t, R> broadcast_strides(const Tensor<T, Rt>& t,
                                              const std::array<std::int64_t, R>& shape, const char* what) {
  static_assert(Rt <= R, "local::map: an operand of higher rank than the first cannot be broadcast");
  std::array<std::int64_t, R> s{};
  for (int d = 0; d < Rt; ++d) {
    DTENSOR_CHECK(t.shape()[d] == shape[R - Rt + d],
                  std::string(what) + ": shape " + shape_to_string(t.shape()) + " does not broadcast to " +
                      shape_to_string(shape) + " (a lower-rank operand must match the trailing dims)");
    s[R - Rt + d] = t.strides()[d];
  }
  return s;
}

} // namespace dtensor::detail

namespace dtensor::local {

/// What an element of T is computed in.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double,
                                     std::conditional_t<std::is_integral_v<T>, T, float>>;

/// Host maps compute a run in blocks of this many elements (see the top of the file).
inline constexpr int host_block = 32;
/// Host reductions over the innermost dim keep this many partial results.
inline constexpr int host_lanes = 16;

// The element functions: value types in, value out. `Backward` forms take the forward's input x (and
// output y where cheaper) and the output's gradient g, and return the input's gradient.
struct Relu {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return math::choose(x > C(0), x, C(0));
  }
  template <class C>
  DTENSOR_HOST_DEVICE C backward(C x, C g) const {
    return math::choose(x > C(0), g, C(0));
  }
};
/// gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact (erf) form, torch's default.
struct Gelu {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return C(0.5) * x * (C(1) + math::erf(x * C(0.70710678118654752440)));
  }
  template <class C>
  DTENSOR_HOST_DEVICE C backward(C x, C g) const {
    const C cdf = C(0.5) * (C(1) + math::erf(x * C(0.70710678118654752440)));
    const C pdf = C(0.39894228040143267794) * math::exp(C(-0.5) * x * x);
    return g * (cdf + x * pdf);
  }
};
/// silu(x) = x * sigmoid(x).
struct Silu {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return x / (C(1) + math::exp(-x));
  }
  template <class C>
  DTENSOR_HOST_DEVICE C backward(C x, C g) const {
    const C s = C(1) / (C(1) + math::exp(-x));
    return g * s * (C(1) + x * (C(1) - s));
  }
};
struct Exp {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return math::exp(x);
  }
  template <class C>
  DTENSOR_HOST_DEVICE C backward(C x, C g) const {
    return g * math::exp(x);
  }
};
/// x * factor.
struct Scale {
  double factor = 1;
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return x * C(factor);
  }
  template <class C>
  DTENSOR_HOST_DEVICE C backward(C, C g) const {
    return g * C(factor);
  }
};
/// a * x + y (a a scalar).
struct Axpy {
  double a = 1;
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C y) const {
    return C(a) * x + y;
  }
};
/// x + value (a scalar).
struct AddScalar {
  double value = 0;
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x) const {
    return x + C(value);
  }
};
struct Add {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C a, C b) const {
    return a + b;
  }
};
struct Sub {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C a, C b) const {
    return a - b;
  }
};
struct Mul {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C a, C b) const {
    return a * b;
  }
};
struct Div {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C a, C b) const {
    return a / b;
  }
};
/// 1 where x equals m (NaN equals NaN), else 0: where a max/min was attained.
struct Attained {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C m) const {
    return math::choose((x == m) | ((x != x) & (m != m)), C(1), C(0));
  }
};
/// The backward of a unary F: (x, g) -> F.backward(x, g).
template <class F>
struct BackwardOf {
  F f;
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C x, C g) const {
    return f.backward(x, g);
  }
};
/// -g * a / (b * b): the divisor's gradient of a / b.
struct DivisorGrad {
  template <class C>
  DTENSOR_HOST_DEVICE C operator()(C g, C a, C b) const {
    return -g * a / (b * b);
  }
};

template <class C, class T, class F, std::size_t... K>
void host_map_row_impl(T* out, std::int64_t n, const F& f, const T* const (&in)[sizeof...(K)],
                       std::index_sequence<K...>) {
  constexpr int m = static_cast<int>(sizeof...(K));
  std::int64_t k = 0;
  for (; k + host_block <= n; k += host_block) {
    C x[m][host_block];
    for (int a = 0; a < m; ++a) {
      for (int j = 0; j < host_block; ++j) {
        x[a][j] = static_cast<C>(in[a][k + j]);
      }
    }
    for (int j = 0; j < host_block; ++j) {
      out[k + j] = T(f(x[K][j]...));
    }
  }
  for (; k < n; ++k) {
    out[k] = T(f(static_cast<C>(in[K][k])...));
  }
}

/// out[k] = T(f(C(in[k])...)) for k < n, on the host: in blocks of host_block elements loaded into local
/// arrays (a compute loop of known trip count over memory nothing else aliases, which vectorises), the
/// last n % host_block one by one. `out` may be one of the inputs.
template <class C, class T, class F, class... In>
void host_map_row(T* out, std::int64_t n, const F& f, const In*... in) {
  static_assert((std::is_same_v<In, T> && ...), "host_map_row: every operand has the output's type");
  const T* const ptrs[sizeof...(In)] = {in...};
  host_map_row_impl<C>(out, n, f, ptrs, std::index_sequence_for<In...>{});
}

inline namespace DTENSOR_LOCAL_OPS_NS {

/// Index i computes tile i of out = f(in...): operand 0 is the output.
template <class T, int R, int N, class F>
struct MapRuns {
  RunLayout<R, N> layout;
  T* out;
  const T* in[N - 1]; // a plain array: std::array's operator[] is host-only in device code (nvcc)
  F f;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<N> t = layout.locate(i);
    apply(t, std::make_index_sequence<N - 1>{});
  }

  template <std::size_t... K>
  DTENSOR_HOST_DEVICE void apply(const Tile<N>& t, std::index_sequence<K...>) const {
    using C = compute_t<T>;
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* o = out + t.offset[0] + r * t.row_stride[0];
      if (DTENSOR_ON_DEVICE) {
        for (std::int64_t k = 0; k < t.n; ++k) {
          o[k] = T(f(static_cast<C>(in[K][t.offset[K + 1] + r * t.row_stride[K + 1] + k])...));
        }
      } else {
#if !defined(__CUDA_ARCH__)
        host_map_row<C>(o, t.n, f, in[K] + t.offset[K + 1] + r * t.row_stride[K + 1]...);
#endif
      }
    }
  }
};

/// Index i reduces the elements of tile i's output positions along the reduced dim (length `len`, stride
/// `stride` in the input, operand 1).
template <class T, int R>
struct ReduceRuns {
  RunLayout<R, 2> layout;
  T* out;
  const T* in;
  std::int64_t len;
  std::int64_t stride;
  ReduceOp op;
  double divide;            ///< 1, or the count a mean divides by
  compute_t<T> empty_value; ///< what an empty dim reduces to: identity(op), computed on the host
                            ///< (std::numeric_limits is host-only in device code)

  /// What an empty dim reduces to: the op's identity, so that an empty shard's Partial is harmless.
  static compute_t<T> identity(ReduceOp op) {
    using C = compute_t<T>;
    switch (op) {
    case ReduceOp::max:
      return std::numeric_limits<C>::has_infinity ? -std::numeric_limits<C>::infinity()
                                                  : std::numeric_limits<C>::lowest();
    case ReduceOp::min:
      return std::numeric_limits<C>::has_infinity ? std::numeric_limits<C>::infinity()
                                                  : std::numeric_limits<C>::max();
    case ReduceOp::product:
      return C(1);
    default:
      return C(0);
    }
  }

  /// acc combined with v by Op (NaN wins in max and min).
  template <ReduceOp Op>
  DTENSOR_HOST_DEVICE static compute_t<T> combine(compute_t<T> acc, compute_t<T> v) {
    if constexpr (Op == ReduceOp::max) {
      return math::choose(((v > acc) | (v != v)) & (acc == acc), v, acc);
    } else if constexpr (Op == ReduceOp::min) {
      return math::choose(((v < acc) | (v != v)) & (acc == acc), v, acc);
    } else if constexpr (Op == ReduceOp::product) {
      return acc * v;
    } else {
      return acc + v;
    }
  }

  /// The reduction of the `len` elements p[0], p[stride], ... left to right.
  template <ReduceOp Op>
  DTENSOR_HOST_DEVICE compute_t<T> in_order(const T* p) const {
    using C = compute_t<T>;
    C acc = len > 0 ? static_cast<C>(p[0]) : empty_value;
    for (std::int64_t j = 1; j < len; ++j) {
      acc = combine<Op>(acc, static_cast<C>(p[j * stride]));
    }
    return acc;
  }

  DTENSOR_HOST_DEVICE compute_t<T> finish(compute_t<T> acc) const {
    using C = compute_t<T>;
    return divide != 1 ? static_cast<C>(acc / static_cast<C>(divide)) : acc;
  }

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<2> t = layout.locate(i);
    switch (op) {
    case ReduceOp::max:
      return run<ReduceOp::max>(t);
    case ReduceOp::min:
      return run<ReduceOp::min>(t);
    case ReduceOp::product:
      return run<ReduceOp::product>(t);
    default:
      return run<ReduceOp::sum>(t);
    }
  }

  template <ReduceOp Op>
  DTENSOR_HOST_DEVICE void run(const Tile<2>& t) const {
    for (std::int64_t r = 0; r < t.rows; ++r) {
      const T* p = in + t.offset[1] + r * t.row_stride[1];
      T* o = out + t.offset[0] + r * t.row_stride[0];
      std::int64_t k = 0;
#if !defined(__CUDA_ARCH__)
      if (!DTENSOR_ON_DEVICE && stride == 1) { // the innermost dim: host_lanes partial results per output
        for (; k < t.n; ++k) {
          o[k] = T(finish(in_lanes<Op>(p + k)));
        }
        continue;
      }
      // An outer dim: a block of outputs at a time, every one reduced left to right.
      for (; !DTENSOR_ON_DEVICE && k + host_block <= t.n && len > 0; k += host_block) {
        compute_t<T> acc[host_block];
        for (int b = 0; b < host_block; ++b) {
          acc[b] = static_cast<compute_t<T>>(p[k + b]);
        }
        for (std::int64_t j = 1; j < len; ++j) {
          const T* q = p + j * stride + k;
          for (int b = 0; b < host_block; ++b) {
            acc[b] = combine<Op>(acc[b], static_cast<compute_t<T>>(q[b]));
          }
        }
        for (int b = 0; b < host_block; ++b) {
          o[k + b] = T(finish(acc[b]));
        }
      }
#endif
      for (; k < t.n; ++k) { // device code: each output left to right
        o[k] = T(finish(in_order<Op>(p + k)));
      }
    }
  }

  /// The reduction of the `len` contiguous elements at p: host_lanes partial results, combined pairwise;
  /// left to right when there are fewer than 2 host_lanes elements.
  template <ReduceOp Op>
  compute_t<T> in_lanes(const T* p) const {
    using C = compute_t<T>;
    if (len < 2 * host_lanes) {
      return in_order<Op>(p);
    }
    C acc[host_lanes];
    for (int j = 0; j < host_lanes; ++j) {
      acc[j] = static_cast<C>(p[j]);
    }
    std::int64_t e = host_lanes;
    for (; e + host_lanes <= len; e += host_lanes) {
      for (int j = 0; j < host_lanes; ++j) {
        acc[j] = combine<Op>(acc[j], static_cast<C>(p[e + j]));
      }
    }
    for (int w = host_lanes / 2; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) {
        acc[j] = combine<Op>(acc[j], acc[j + w]);
      }
    }
    C a = acc[0];
    for (; e < len; ++e) {
      a = combine<Op>(a, static_cast<C>(p[e]));
    }
    return a;
  }
};

template <class F>
void launch(const F& f, const Device& device, CUstream_st* stream, const char* what) {
  if (device.is_meta()) { // shapes only: the output exists, nothing to compute
    return;
  }
  if (device.is_cpu()) {
    run_host(f);
    return;
  }
#if DTENSOR_LOCAL_OPS_CUDA
  run_cuda(f, device, stream, what);
#else
  (void)stream;
  detail::throw_error(std::string(what) + " on " + device.to_string() +
                      ": CUDA tensors need a kernel: compile this translation unit with nvcc (and the CUDA "
                      "Toolkit's Thrust headers)");
#endif
}

} // namespace DTENSOR_LOCAL_OPS_NS

/// out = f(a, rest...) elementwise into an existing tensor of a's shape (rest broadcast over a's leading
/// dims). Every operand on one device. Synchronous.
template <class F, class T, int R, int... Rs>
void map_into(const Tensor<T, R>& out, F f, const Tensor<T, R>& a, const Tensor<T, Rs>&... rest) {
  constexpr int n = 2 + sizeof...(Rs);
  DTENSOR_CHECK(out.shape() == a.shape(),
                "local::map: output shape " + dtensor::detail::shape_to_string(out.shape()) +
                    " is not the input's " + dtensor::detail::shape_to_string(a.shape()));
  DTENSOR_CHECK(((rest.device() == a.device()) && ... && (out.device() == a.device())),
                "local::map: operands on different devices");
  const std::array<std::array<std::int64_t, R>, n> strides{
      out.strides(), a.strides(), detail::broadcast_strides<R>(rest, a.shape(), "local::map")...};
  const bool host = a.device().is_cpu();
  MapRuns<T, R, n, F> run{make_run_layout<R, n>(a.shape(), strides, host ? host_tile : cuda_tile),
                          out.data(),
                          {a.data(), rest.data()...},
                          f};
  launch(run, a.device(), a.stream_handle(), "local::map");
}

/// f(a, rest...) elementwise as a new contiguous tensor of a's shape on a's device.
template <class F, class T, int R, int... Rs>
Tensor<T, R> map(F f, const Tensor<T, R>& a, const Tensor<T, Rs>&... rest) {
  Tensor<T, R> out = detail::empty_like(a.shape(), a);
  map_into(out, f, a, rest...);
  return out;
}

/// f(in) broadcast to `shape`: in's dims of size 1 repeat (stride 0), the others must equal shape's.
template <class F, class T, int R>
Tensor<T, R> expand(F f, const Tensor<T, R>& in, const typename Tensor<T, R>::Shape& shape) {
  auto strides = in.strides();
  for (int d = 0; d < R; ++d) {
    DTENSOR_CHECK(in.shape()[d] == shape[d] || in.shape()[d] == 1,
                  "local::expand: " + dtensor::detail::shape_to_string(in.shape()) + " does not expand to " +
                      dtensor::detail::shape_to_string(shape));
    if (in.shape()[d] != shape[d]) {
      strides[d] = 0;
    }
  }
  Tensor<T, R> out = detail::empty_like(shape, in);
  const bool host = in.device().is_cpu();
  MapRuns<T, R, 2, F> run{
      make_run_layout<R, 2>(shape, {out.strides(), strides}, host ? host_tile : cuda_tile),
      out.data(),
      {in.data()},
      f};
  launch(run, in.device(), in.stream_handle(), "local::expand");
  return out;
}

/// The reduction by `op` of `x` over dim `dim`, keeping it with size 1; `divide` divides the result (a
/// mean over a global count). An empty dim gives the op's identity (0 for sum, mean).
template <class T, int R>
Tensor<T, R> reduce(ReduceOp op, const Tensor<T, R>& x, int dim, double divide = 1) {
  DTENSOR_CHECK(dim >= 0 && dim < R,
                "local::reduce: dim " + std::to_string(dim) + " out of range for rank " + std::to_string(R));
  DTENSOR_CHECK(!is_bitwise(op), "local::reduce: ReduceOp " + std::string(to_string(op)) +
                                     " is a collective's reduction only (sum, avg, max, min, product here)");
  auto shape = x.shape();
  const std::int64_t len = shape[dim];
  shape[dim] = 1;
  Tensor<T, R> out = detail::empty_like(shape, x);
  auto in_strides = x.strides();
  const bool host = x.device().is_cpu();
  ReduceRuns<T, R> run{
      make_run_layout<R, 2>(shape, {out.strides(), in_strides}, host ? host_tile : cuda_tile),
      out.data(),
      x.data(),
      len,
      x.strides()[dim],
      op == ReduceOp::avg ? ReduceOp::sum : op,
      divide,
      ReduceRuns<T, R>::identity(op == ReduceOp::avg ? ReduceOp::sum : op)};
  launch(run, x.device(), x.stream_handle(), "local::reduce");
  return out;
}

/// `g` summed over its leading dims down to rank Rb: the gradient of an operand broadcast by map.
template <int Rb, class T, int R>
Tensor<T, Rb> sum_to_rank(const Tensor<T, R>& g) {
  static_assert(Rb <= R);
  if constexpr (Rb == R) {
    return g;
  } else {
    std::array<std::int64_t, Rb + 1> shape{};
    shape[0] = 1;
    for (int d = 0; d < R - Rb; ++d) {
      shape[0] *= g.shape()[d];
    }
    for (int d = 0; d < Rb; ++d) {
      shape[d + 1] = g.shape()[R - Rb + d];
    }
    const Tensor<T, Rb + 1> flat = g.contiguous().template view<Rb + 1>(shape);
    std::array<std::int64_t, Rb> out_shape{};
    for (int d = 0; d < Rb; ++d) {
      out_shape[d] = shape[d + 1];
    }
    return reduce(ReduceOp::sum, flat, 0).template view<Rb>(out_shape);
  }
}

} // namespace dtensor::local
