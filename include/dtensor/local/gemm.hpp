#pragma once
// The local matrix product: one rank's GEMM on its own tensors, from a BLAS on the host and cuBLAS on
// CUDA tensors. The sharded ops above it call it on their local shards.
//
//   auto x = dtensor::Tensor<float, 3>::full({8, 128, 512}, 1.0f);   // (batch, tokens, in)
//   auto w = dtensor::Tensor<float, 2>::full({1024, 512}, 0.5f);      // (out, in), as nn.Linear stores it
//   auto y = dtensor::local::matmul(x, w, false, true);               // (8, 128, 1024) = x w^T
//   dtensor::local::matmul_into(x, w, y, false, true, 1.0, 1.0);      // y += x w^T
//
// Element types: float and double through cblas_sgemm / cblas_dgemm (computed in their own precision);
// bfloat16 and half accumulate in float: on the host they are converted to float, multiplied by sgemm and
// rounded back once (Debian's OpenBLAS 0.3.21 declares cblas_sbgemm but is built without it), on CUDA
// cuBLAS reads them as they are (compute type 32F). Strided views are used in place when one of their
// dims has unit stride (a transposed view is a transposed GEMM); other layouts are copied to contiguous
// memory first (see gemm_plan.hpp).
//
// Linking: host tensors need a BLAS, the CMake target dtensor::blas (OpenBLAS; Debian: libopenblas-dev);
// without it instantiating matmul is a compile error that says so. CUDA tensors need cuBLAS, which
// dtensor::cuda links where the CUDA Toolkit has it; without it a CUDA tensor gives an Error naming it.
// With cuBLAS the TU sees CUDA's cuda_fp16.h, whose global `half` makes a plain `half` ambiguous after
// `using namespace dtensor;`: write dtensor::half there (as in nvcc TUs, see local/copy.hpp).

#include <array>
#include <concepts>
#include <cstdint>
#include <string>

#include "dtensor/core/config.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/blas.hpp"
#include "dtensor/local/cublas.hpp"
#include "dtensor/local/gemm_plan.hpp"

namespace dtensor {
namespace detail {

/// The element types local GEMMs support.
template <class T>
inline constexpr bool gemm_element_v =
    std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16> || std::same_as<T, half>;

/// Whether this TU links a host BLAS; a template so that the static_assert below fires only when a GEMM
/// is instantiated, and the header still compiles (and is usable for CUDA-free code) without a BLAS.
template <class T>
inline constexpr bool host_blas_linked_v = DTENSOR_HAS_BLAS != 0;

DTENSOR_COLD inline std::string matmul_shapes(const std::string& a, const std::string& b, bool trans_a,
                                              bool trans_b) {
  return "a " + a + (trans_a ? "^T" : "") + " x b " + b + (trans_b ? "^T" : "");
}

/// A tensor's matrix (for rank 3: its first, the others batch_stride apart) as a MatrixView; a rank-2
/// tensor has batch stride 0: every batch entry shares it.
template <class T, int R>
MatrixView matrix_view(const Tensor<T, R>& t) noexcept {
  if constexpr (R == 2) {
    return {t.shape()[0], t.shape()[1], t.strides()[0], t.strides()[1], 0};
  } else {
    return {t.shape()[1], t.shape()[2], t.strides()[1], t.strides()[2], t.strides()[0]};
  }
}

/// Checks that c = op(a) op(b) is a product of matching shapes on one device; throws an Error naming
/// `op`, the shapes and the transposes otherwise.
template <class T, int R, int R2>
void check_matmul(const char* op, const Tensor<T, R>& a, const Tensor<T, R2>& b, const Tensor<T, R>* c,
                  bool trans_a, bool trans_b) {
  const auto what = [&] {
    return std::string(op) + ": " +
           matmul_shapes(shape_to_string(a.shape()), shape_to_string(b.shape()), trans_a, trans_b);
  };
  DTENSOR_CHECK(a.defined() && b.defined() && (c == nullptr || c->defined()),
                std::string(op) + ": an operand is an undefined tensor");
  const MatrixView va = matrix_view(a);
  const MatrixView vb = matrix_view(b);
  const std::int64_t k_a = trans_a ? va.rows : va.cols;
  const std::int64_t k_b = trans_b ? vb.cols : vb.rows;
  DTENSOR_CHECK(k_a == k_b, what() + ": the inner dims differ (" + std::to_string(k_a) + " vs " +
                                std::to_string(k_b) + ")");
  if constexpr (R == 3 && R2 == 3) {
    DTENSOR_CHECK(a.shape()[0] == b.shape()[0], what() + ": the batch sizes differ (" +
                                                    std::to_string(a.shape()[0]) + " vs " +
                                                    std::to_string(b.shape()[0]) + ")");
  }
  DTENSOR_CHECK(a.device() == b.device(),
                what() + ": a is on " + a.device().to_string() + " but b on " + b.device().to_string());
  if (c != nullptr) {
    typename Tensor<T, R>::Shape expected{};
    expected[R - 2] = trans_a ? va.cols : va.rows;
    expected[R - 1] = trans_b ? vb.rows : vb.cols;
    if constexpr (R == 3) {
      expected[0] = a.shape()[0];
    }
    DTENSOR_CHECK(c->shape() == expected, what() + ": c has shape " + shape_to_string(c->shape()) +
                                              ", the product has " + shape_to_string(expected));
    DTENSOR_CHECK(c->device() == a.device(), what() + ": c is on " + c->device().to_string() +
                                                 " but a and b on " + a.device().to_string());
  }
}

/// The plan of c = op(a) op(b) on these tensors.
template <class T, int R, int R2>
GemmPlan plan_matmul(const Tensor<T, R>& a, const Tensor<T, R2>& b, const Tensor<T, R>& c, bool trans_a,
                     bool trans_b) noexcept {
  const std::int64_t batch = R == 3 ? c.shape()[0] : 1;
  return plan_gemm(batch, matrix_view(a), trans_a, matrix_view(b), trans_b, matrix_view(c));
}

/// A float copy of a bfloat16 or half host tensor (contiguous).
template <class T, int R>
Tensor<float, R> to_float(const Tensor<T, R>& t) {
  Tensor<float, R> r(t.shape());
  float* out = r.data();
  strided_for_each(
      t.shape(), std::array<typename Tensor<T, R>::Shape, 1>{t.strides()},
      [&](const std::array<std::int64_t, 1>& off) { *out++ = static_cast<float>(t.data()[off[0]]); });
  return r;
}

/// The flops of c = op(a) op(b): 2mnk (times the batch of a rank-3 c).
template <class T, int R>
double matmul_flops(const Tensor<T, R>& a, const Tensor<T, R>& c, bool trans_a) {
  const auto k = static_cast<double>(a.shape()[trans_a ? R - 2 : R - 1]);
  return 2.0 * static_cast<double>(c.numel()) * k;
}

/// A contiguous copy of `t` whose memory is ordered on `stream` (c's): on CUDA its release then follows
/// the GEMM that reads it, whichever stream `t` is on.
template <class T, int R>
Tensor<T, R> gemm_copy(const Tensor<T, R>& t, [[maybe_unused]] CUstream_st* stream) {
#if DTENSOR_HAS_CUDA
  if (t.device().is_cuda()) {
    Tensor<T, R> r(t.shape(), t.device(), stream);
    r.copy_from(t);
    return r;
  }
#endif
  return t.clone();
}

/// Runs c = alpha op(a) op(b) + beta c with a plan that copies nothing: operands whose layout no GEMM
/// takes are replaced by contiguous copies first (and c is written back from its copy).
template <class T, int R, int R2, class Kernel>
void run_matmul(const Tensor<T, R>& a, const Tensor<T, R2>& b, const Tensor<T, R>& c, bool trans_a,
                bool trans_b, const Kernel& kernel) {
  GemmPlan plan = plan_matmul(a, b, c, trans_a, trans_b);
  if (!plan.needs_copy()) {
    kernel(plan, a.data(), b.data(), c.data());
    return;
  }
  const bool copy_first = plan.swapped ? plan.b.copy : plan.a.copy;
  const bool copy_second = plan.swapped ? plan.a.copy : plan.b.copy;
  const Tensor<T, R> a2 = copy_first ? gemm_copy(a, c.stream_handle()) : a;
  const Tensor<T, R2> b2 = copy_second ? gemm_copy(b, c.stream_handle()) : b;
  Tensor<T, R> c2 = plan.c.copy ? c.clone() : c; // a clone keeps c's values for beta, and c's stream
  plan = plan_matmul(a2, b2, c2, trans_a, trans_b);
  kernel(plan, a2.data(), b2.data(), c2.data());
  if (c2.data() != c.data()) {
    Tensor<T, R> out = c;
    out.copy_from(c2);
  }
}

} // namespace detail

namespace local {

// One program, one meaning: matmul's body depends on whether the TU has cuBLAS, so TUs built with and
// without it (an nvcc TU that does not link dtensor::cuda next to one that does) get different symbols
// instead of one inline function with two bodies.
#if DTENSOR_HAS_CUDA && DTENSOR_HAS_CUBLAS
#define DTENSOR_GEMM_NS cublas1
#else
#define DTENSOR_GEMM_NS cublas0
#endif
inline namespace DTENSOR_GEMM_NS {

/// c = alpha op(a) op(b) + beta c, where op(x) is x or x^T (`trans_a`, `trans_b`). Rank 2: op(a) is
/// (m, k), op(b) (k, n), c (m, n). Rank 3: a batch over dim 0, a (batch, m, k) and c (batch, m, n), with
/// b either (batch, k, n) or (k, n) shared by every batch entry (a linear layer's weight). Any strides;
/// c must not overlap a or b. beta = 0 ignores c's values (NaN included), as BLAS and torch do; k = 0
/// gives c = beta c. Host tensors need the dtensor::blas target, CUDA tensors dtensor::cuda with cuBLAS;
/// on CUDA the GEMM is enqueued on c's stream (not synchronised; a and b must be ready on it).
/// Throws Error naming the shapes and transposes when they do not match, or when the tensors are on
/// different devices.
template <class T, int R, int R2>
void matmul_into(const Tensor<T, R>& a, const Tensor<T, R2>& b, const Tensor<T, R>& c, bool trans_a = false,
                 bool trans_b = false, double alpha = 1, double beta = 0) {
  static_assert(detail::gemm_element_v<T>, "dtensor::local::matmul: T must be float, double, "
                                           "dtensor::bfloat16 or dtensor::half (no integer or float8 GEMM)");
  static_assert((R == 2 && R2 == 2) || (R == 3 && (R2 == 2 || R2 == 3)),
                "dtensor::local::matmul: a (m, k) x b (k, n), or a batched a (batch, m, k) x b (batch, k, "
                "n) or (k, n)");
  detail::check_matmul("matmul_into", a, b, &c, trans_a, trans_b);
  count_flops(detail::matmul_flops(a, c, trans_a)); // FlopCounter (core/flop_counter.hpp), meta included
  if (c.device().is_meta()) {                       // shapes only
    return;
  }
  if (c.device().is_cuda()) {
#if DTENSOR_HAS_CUDA && DTENSOR_HAS_CUBLAS
    detail::run_matmul(a, b, c, trans_a, trans_b,
                       [&](const detail::GemmPlan& p, const void* x, const void* y, void* z) {
                         detail::cublas_gemm(dtype_v<T>, p, x, y, z, alpha, beta, c.device(), c.stream());
                       });
    return;
#else
    detail::throw_error("matmul_into on " + c.device().to_string() +
                        ": this program has no cuBLAS; link the dtensor::cuda target (with the CUDA "
                        "Toolkit's cuBLAS, CUDA::cublas)");
#endif
  }
  static_assert(!detail::gemm_element_v<T> || detail::host_blas_linked_v<T>, // (T's error is above)
                "dtensor ops need a BLAS: link the dtensor::blas target (Debian: libopenblas-dev)");
#if DTENSOR_HAS_BLAS
  if constexpr (detail::is_reduced_float_v<T>) { // fp32 accumulation: one rounding, at the end
    const Tensor<float, R> c32 = beta != 0 ? detail::to_float(c) : Tensor<float, R>(c.shape());
    detail::run_matmul(detail::to_float(a), detail::to_float(b), c32, trans_a, trans_b,
                       [&](const detail::GemmPlan& p, const void* x, const void* y, void* z) {
                         detail::blas_gemm(DType::float32, p, x, y, z, alpha, beta);
                       });
    const float* in = c32.data();
    detail::strided_for_each(c.shape(), std::array<typename Tensor<T, R>::Shape, 1>{c.strides()},
                             [&](const std::array<std::int64_t, 1>& off) { c.data()[off[0]] = T(*in++); });
  } else {
    detail::run_matmul(a, b, c, trans_a, trans_b,
                       [&](const detail::GemmPlan& p, const void* x, const void* y, void* z) {
                         detail::blas_gemm(dtype_v<T>, p, x, y, z, alpha, beta);
                       });
  }
#endif
}

/// op(a) op(b) as a new tensor on a's device (and stream): (m, n), or (batch, m, n) for a batched a.
/// The same shapes, types and linking as matmul_into.
template <class T, int R, int R2>
Tensor<T, R> matmul(const Tensor<T, R>& a, const Tensor<T, R2>& b, bool trans_a = false,
                    bool trans_b = false) {
  static_assert((R == 2 && R2 == 2) || (R == 3 && (R2 == 2 || R2 == 3)),
                "dtensor::local::matmul: a (m, k) x b (k, n), or a batched a (batch, m, k) x b (batch, k, "
                "n) or (k, n)");
  detail::check_matmul<T, R, R2>("matmul", a, b, nullptr, trans_a, trans_b);
  typename Tensor<T, R>::Shape shape{};
  shape[R - 2] = a.shape()[trans_a ? R - 1 : R - 2];
  shape[R - 1] = b.shape()[trans_b ? R2 - 2 : R2 - 1];
  if constexpr (R == 3) {
    shape[0] = a.shape()[0];
  }
#if DTENSOR_HAS_CUDA
  Tensor<T, R> c =
      a.device().is_cuda() ? Tensor<T, R>(shape, a.device(), a.stream()) : Tensor<T, R>(shape, a.device());
#else
  Tensor<T, R> c(shape, a.device());
#endif
  matmul_into(a, b, c, trans_a, trans_b);
  return c;
}

} // namespace DTENSOR_GEMM_NS
} // namespace local
} // namespace dtensor
