#pragma once
// The local grouped GEMM: many independent products of different sizes in one call, as a mixture of
// experts runs its local experts, each on the rows (tokens) routed to it.
//
//   std::vector<dtensor::Tensor<float, 2>> x, w, y;   // expert e: x[e] (m_e, d), w[e] (f, d), y[e] (m_e, f)
//   dtensor::local::grouped_matmul_into<float>(x, w, y, false, true);   // y[e] = x[e] w[e]^T, every e
//
// Host: a loop of matmul_into, one BLAS call per group. Debian's OpenBLAS 0.3.21 (libopenblas-dev
// 0.3.21+ds-4) has no grouped or batched GEMM entry point: its cblas.h (and the other BLAS headers under
// /usr/include/x86_64-linux-gnu) declares no cblas_sgemm_batch / cblas_?gemm_batch nor anything named
// *batch*, and libopenblas exports no such symbol; so the loop is the host form.
//
// CUDA (with cuBLAS 12.5 or newer): one cublasGemmGroupedBatchedEx on c's stream for every group with a
// non-empty output, each its own group of size 1, in the column-major form cublas.hpp uses (C^T =
// op(B)^T op(A)^T). Operands without a unit-stride dim are copied to contiguous memory first (as
// matmul_into does) and c is written back from its copy. float, bfloat16 and half run it with
// CUBLAS_COMPUTE_32F and float alpha and beta (float computes in float, no TF32, as matmul_into);
// double is not among cublasGemmGroupedBatchedEx's types (cuBLAS has a separate cublasDgemmGroupedBatched),
// so double runs the per-group loop of matmul_into, as does an older cuBLAS. Groups with k = 0 (c = beta c)
// run through matmul_into too, on the same stream.

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/core/config.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/cublas.hpp"
#include "dtensor/local/gemm.hpp"
#include "dtensor/local/gemm_plan.hpp"

// 1 when this TU's cuBLAS has cublasGemmGroupedBatchedEx (cuBLAS 12.5, CUDA 12.5).
#if DTENSOR_HAS_CUDA && DTENSOR_HAS_CUBLAS && defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
#define DTENSOR_HAS_CUBLAS_GROUPED 1
#else
#define DTENSOR_HAS_CUBLAS_GROUPED 0
#endif

namespace dtensor {
namespace detail {

/// "grouped_matmul_into: group <g>", the op name check_matmul puts in front of a group's errors; kept in
/// place so checking a group allocates nothing.
struct GroupOpName {
  std::array<char, 48> text{};

  explicit GroupOpName(std::size_t group) noexcept {
    constexpr std::string_view prefix = "grouped_matmul_into: group ";
    prefix.copy(text.data(), prefix.size());
    char* end = text.data() + text.size() - 1; // keeps the terminating '\0'
    (void)std::to_chars(text.data() + prefix.size(), end, group);
  }
  const char* c_str() const noexcept { return text.data(); }
};

DTENSOR_COLD inline std::string grouped_count_error(std::size_t a, std::size_t b, std::size_t c) {
  return "grouped_matmul_into: a has " + std::to_string(a) + " groups, b " + std::to_string(b) + " and c " +
         std::to_string(c) + "; every group needs one of each";
}

DTENSOR_COLD inline std::string grouped_device_error(std::size_t g, Device dg, Device d0) {
  return "grouped_matmul_into: group " + std::to_string(g) + " is on " + dg.to_string() + " but group 0 on " +
         d0.to_string() + "; every group must be on one device";
}

DTENSOR_COLD inline std::string grouped_stream_error(std::size_t g) {
  return "grouped_matmul_into: group " + std::to_string(g) +
         "'s c is ordered on another CUDA stream than group 0's; the grouped GEMM runs on one stream, so "
         "every c must be on the same one";
}

/// Checks the groups of grouped_matmul_into: as many a, b and c, each group a product matmul_into takes,
/// every group on group 0's device (and, on CUDA, every c on group 0's c's stream). Throws Error naming
/// the counts, or the group and what check_matmul says about it.
template <class T>
void check_grouped_matmul(std::span<const Tensor<T, 2>> a, std::span<const Tensor<T, 2>> b,
                          std::span<const Tensor<T, 2>> c, bool trans_a, bool trans_b) {
  DTENSOR_CHECK(a.size() == b.size() && b.size() == c.size(),
                grouped_count_error(a.size(), b.size(), c.size()));
  for (std::size_t g = 0; g < c.size(); ++g) {
    check_matmul(GroupOpName(g).c_str(), a[g], b[g], &c[g], trans_a, trans_b);
    DTENSOR_CHECK(c[g].device() == c[0].device(), grouped_device_error(g, c[g].device(), c[0].device()));
    DTENSOR_CHECK(c[g].device().is_cpu() || c[g].stream_handle() == c[0].stream_handle(),
                  grouped_stream_error(g));
  }
}

#if DTENSOR_HAS_CUBLAS_GROUPED

/// Whether cublasGemmGroupedBatchedEx takes `dtype` (with CUBLAS_COMPUTE_32F).
constexpr bool cublas_grouped_type(DType dtype) noexcept {
  return dtype == DType::float32 || dtype == DType::bfloat16 || dtype == DType::float16;
}

/// Runs `plans` (one per group, none left to copy, batch 1, m and n > 0) as one
/// cublasGemmGroupedBatchedEx on device memory of `device`, enqueued on `stream` (not synchronised).
/// `first[i]` and `second[i]` are group i's operands in the order the user wrote them, `c[i]` its output.
/// @pre cublas_grouped_type(dtype)
inline void cublas_grouped_gemm(DType dtype, std::span<const GemmPlan> plans,
                                std::span<const void* const> first, std::span<const void* const> second,
                                std::span<void* const> c, double alpha, double beta, Device device,
                                cudaStream_t stream) {
  const std::size_t count = plans.size();
  if (count == 0) {
    return;
  }
  DTENSOR_CHECK(count <= static_cast<std::size_t>(blas_int_max),
                "grouped_matmul_into: " + std::to_string(count) +
                    " groups exceed cuBLAS's 32-bit group count");
  std::vector<cublasOperation_t> trans_a(count), trans_b(count);
  std::vector<int> m(count), n(count), k(count), lda(count), ldb(count), ldc(count);
  // cuBLAS's A array, then B, then C, each starting 128 bytes after the last (an aligned pointer array
  // whatever the count; cuBLAS's pointer-array GEMMs may reject misaligned ones).
  const std::size_t stride = (count + 15) / 16 * 16;
  std::vector<void*> pointers(3 * stride, nullptr);
  for (std::size_t i = 0; i < count; ++i) {
    const GemmPlan& p = plans[i];
    DTENSOR_CHECK(p.m <= blas_int_max && p.n <= blas_int_max && p.k <= blas_int_max &&
                      p.a.ld <= blas_int_max && p.b.ld <= blas_int_max && p.c.ld <= blas_int_max,
                  "grouped_matmul_into: group " + std::to_string(i) + "'s " + std::to_string(p.m) + " x " +
                      std::to_string(p.k) + " x " + std::to_string(p.n) +
                      " product exceeds cuBLAS's 32-bit sizes");
    // Column-major: the row-major C (m x n) is C^T (n x m) = op(B)^T op(A)^T, as cublas_gemm runs it.
    trans_a[i] = cublas_operation(p.b);
    trans_b[i] = cublas_operation(p.a);
    m[i] = static_cast<int>(p.n);
    n[i] = static_cast<int>(p.m);
    k[i] = static_cast<int>(p.k);
    lda[i] = static_cast<int>(p.b.ld);
    ldb[i] = static_cast<int>(p.a.ld);
    ldc[i] = static_cast<int>(p.c.ld);
    const void* pa = p.swapped ? second[i] : first[i];
    const void* pb = p.swapped ? first[i] : second[i];
    pointers[i] = const_cast<void*>(pb); // only read: cuBLAS takes the A and B arrays as const void* const*
    pointers[stride + i] = const_cast<void*>(pa);
    pointers[2 * stride + i] = c[i];
  }
  const std::vector<float> alphas(count, static_cast<float>(alpha));
  const std::vector<float> betas(count, static_cast<float>(beta));
  const std::vector<int> group_size(count, 1);
  TensorDeviceGuard guard(device.index);
  cublasHandle_t handle = cublas_handle(device.index, stream);
  // The pointer arrays must be in device memory: stream-ordered memory on `stream`, freed (in stream order)
  // after the GEMM has read it. The host copy is pageable, which cudaMemcpyAsync stages before it returns
  // (CUDA's documented behaviour, which fill_cuda relies on too), so `pointers` may go when this returns
  // and nothing waits for the stream here.
  const std::size_t bytes = pointers.size() * sizeof(void*);
  const std::shared_ptr<void> device_pointers = allocate_cuda(bytes, device, stream);
  check_tensor_cuda(
      cudaMemcpyAsync(device_pointers.get(), pointers.data(), bytes, cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync", "grouped_matmul_into: the pointer arrays");
  void* const* d = static_cast<void* const*>(device_pointers.get());
  const cudaDataType_t type = cuda_data_type(dtype);
  check_cublas(cublasGemmGroupedBatchedEx(handle, trans_a.data(), trans_b.data(), m.data(), n.data(),
                                          k.data(), alphas.data(), d, type, lda.data(), d + stride, type,
                                          ldb.data(), betas.data(), d + 2 * stride, type, ldc.data(),
                                          static_cast<int>(count), group_size.data(), CUBLAS_COMPUTE_32F),
               "cublasGemmGroupedBatchedEx");
}

#endif // DTENSOR_HAS_CUBLAS_GROUPED

} // namespace detail

namespace local {

// The body depends on whether the TU has cuBLAS, as matmul_into's does: the same inline namespace (gemm.hpp).
inline namespace DTENSOR_GEMM_NS {

/// c[g] = alpha op(a[g]) op(b[g]) + beta c[g] for every g: one grouped GEMM over products whose sizes differ
/// (a mixture of experts' local experts, each on its own rows). Each group is a rank-2 matmul_into, with
/// its shapes, strides, types and linking; trans_a, trans_b, alpha and beta are shared by all groups.
/// Groups with m = 0 or n = 0 are skipped; k = 0 gives c[g] = beta c[g]. No c[g] may overlap another
/// group's c or any a or b. On CUDA every c must be ordered on one stream: the GEMMs are enqueued on it
/// (not synchronised; every a and b must be ready on it), except that a c which had to be copied (no
/// unit-stride dim) is written back synchronously, as matmul_into does.
/// Throws Error before running any group when a, b and c hold different numbers of groups (naming the
/// three), when a group's shapes do not match or its tensors are on different devices (naming the
/// group, its shapes and transposes), or when the groups are on different devices or CUDA streams.
template <class T>
void grouped_matmul_into(std::span<const Tensor<T, 2>> a, std::span<const Tensor<T, 2>> b,
                         std::span<const Tensor<T, 2>> c, bool trans_a = false, bool trans_b = false,
                         double alpha = 1, double beta = 0) {
  static_assert(detail::gemm_element_v<T>, "dtensor::local::grouped_matmul_into: T must be float, double, "
                                           "dtensor::bfloat16 or dtensor::half (no integer or float8 GEMM)");
  detail::check_grouped_matmul(a, b, c, trans_a, trans_b);
  // Counted here where no matmul_into runs (meta, the grouped cuBLAS call); matmul_into counts its own.
  const auto count_groups = [&] {
    for (std::size_t g = 0; g < c.size(); ++g) {
      count_flops(detail::matmul_flops(a[g], c[g], trans_a));
    }
  };
  if (c.empty() || c[0].device().is_meta()) { // meta: shapes only
    count_groups();
    return;
  }
#if DTENSOR_HAS_CUBLAS_GROUPED
  if (c[0].device().is_cuda() && detail::cublas_grouped_type(dtype_v<T>)) {
    cudaStream_t stream = c[0].stream();
    std::vector<detail::GemmPlan> plans;
    std::vector<const void*> first, second;
    std::vector<void*> out;
    std::vector<Tensor<T, 2>> keep;                      // contiguous copies, alive until enqueued
    std::vector<std::array<Tensor<T, 2>, 2>> write_back; // {c, its contiguous copy}
    for (std::size_t g = 0; g < c.size(); ++g) {
      if (c[g].numel() == 0) { // m = 0 or n = 0
        continue;
      }
      if (a[g].shape()[trans_a ? 0 : 1] == 0) { // k = 0: c = beta c, by matmul_into's cublasGemmEx
        matmul_into(a[g], b[g], c[g], trans_a, trans_b, alpha, beta);
        continue;
      }
      detail::GemmPlan plan = detail::plan_matmul(a[g], b[g], c[g], trans_a, trans_b);
      Tensor<T, 2> x = a[g], y = b[g], z = c[g];
      if (plan.needs_copy()) { // as run_matmul: copies ordered on c's stream, c written back below
        if (plan.swapped ? plan.b.copy : plan.a.copy) {
          x = detail::gemm_copy(a[g], stream);
          keep.push_back(x);
        }
        if (plan.swapped ? plan.a.copy : plan.b.copy) {
          y = detail::gemm_copy(b[g], stream);
          keep.push_back(y);
        }
        if (plan.c.copy) {
          z = c[g].clone(); // keeps c's values for beta, and c's stream
          write_back.push_back({c[g], z});
        }
        plan = detail::plan_matmul(x, y, z, trans_a, trans_b);
      }
      plans.push_back(plan);
      first.push_back(x.data());
      second.push_back(y.data());
      out.push_back(z.data());
    }
    detail::cublas_grouped_gemm(dtype_v<T>, plans, first, second, out, alpha, beta, c[0].device(), stream);
    count_groups(); // k = 0 groups (matmul_into above) count 0
    for (const auto& [dst, src] : write_back) {
      Tensor<T, 2> target = dst;
      target.copy_from(src);
    }
    return;
  }
#endif
  for (std::size_t g = 0; g < c.size(); ++g) {
    if (c[g].numel() != 0) {
      matmul_into(a[g], b[g], c[g], trans_a, trans_b, alpha, beta);
    }
  }
}

} // namespace DTENSOR_GEMM_NS
} // namespace local
} // namespace dtensor
