#pragma once
// Element-wise reductions on host memory, for every DType and ReduceOp: what a host backend reduces with
// (gloo calls them inside its algorithms; its own only cover a few types), the fold of
// generic::reduce_scatter, and the avg post-step.
//
//   detail::reduce_function(DType::bfloat16, ReduceOp::max)(out, a, b, n);   // out[i] = max(a[i], b[i])
//   detail::divide_in_place(data, n, DType::int32, group_size);               // avg's last step
//
//  - bfloat16 / float16 / float8_e4m3 / float8_e5m2 are reduced in float and rounded back after each
//    pairwise step (fp8: an e4m3 sum beyond 448 becomes NaN, an e5m2 one beyond 57344 inf, as the
//    conversions in core/element_type.hpp say).
//  - Integer sum and product wrap around (two's complement, like NCCL), never undefined behaviour.
//  - avg = sum, then divide by the group size: floats divide; integers divide with C++ `/`, i.e. the
//    quotient is truncated toward zero. This is what NCCL does for integer ncclAvg (FuncSumPostDiv:
//    wrap-around sum, then x / nranks in the element type). (NCCL scales floats by 1/n before summing
//    instead; with exactly representable values both give the same result.)

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace dtensor::detail {
/// One element of `op` (avg reduces like sum).
template <class T>
T reduce_one(ReduceOp op, T a, T b) {
  if constexpr (is_reduced_float_v<T>) {
    return T(reduce_one<float>(op, static_cast<float>(a), static_cast<float>(b)));
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    case ReduceOp::product:
      return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    case ReduceOp::max:
      return std::max(a, b);
    case ReduceOp::min:
      return std::min(a, b);
    case ReduceOp::band:
      return static_cast<T>(a & b);
    case ReduceOp::bor:
      return static_cast<T>(a | b);
    case ReduceOp::bxor:
      return static_cast<T>(a ^ b);
    }
    return a;
  } else {
    switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return a + b;
    case ReduceOp::product:
      return a * b;
    case ReduceOp::max: // NaN wins, whichever rank holds it (torch's max and min propagate NaN)
      return a != a ? a : b != b ? b : std::max(a, b);
    case ReduceOp::min:
      return a != a ? a : b != b ? b : std::min(a, b);
    case ReduceOp::band: // floating types are refused before any communication (check_reduce_dtype)
    case ReduceOp::bor:
    case ReduceOp::bxor:
      return a;
    }
    return a;
  }
}

template <class T, ReduceOp Op>
void reduce_kernel(void* out, const void* a, const void* b, std::size_t n) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    o[i] = reduce_one<T>(Op, x[i], y[i]);
  }
}

using ReduceFn = void (*)(void*, const void*, const void*, std::size_t);

/// out[i] = a[i] op b[i] for n elements of `dtype` (out may alias a or b).
inline ReduceFn reduce_function(DType dtype, ReduceOp op) {
  return visit_dtype(dtype, [op]<class T>(T) -> ReduceFn {
    switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return &reduce_kernel<T, ReduceOp::sum>;
    case ReduceOp::product:
      return &reduce_kernel<T, ReduceOp::product>;
    case ReduceOp::max:
      return &reduce_kernel<T, ReduceOp::max>;
    case ReduceOp::min:
      return &reduce_kernel<T, ReduceOp::min>;
    case ReduceOp::band:
      return &reduce_kernel<T, ReduceOp::band>;
    case ReduceOp::bor:
      return &reduce_kernel<T, ReduceOp::bor>;
    case ReduceOp::bxor:
      return &reduce_kernel<T, ReduceOp::bxor>;
    }
    return nullptr;
  });
}

/// The avg post-step: data[i] /= divisor (integers: truncated toward zero).
inline void divide_in_place(void* data, std::int64_t count, DType dtype, int divisor) {
  visit_dtype(dtype, [&]<class T>(T) {
    auto* p = static_cast<T*>(data);
    for (std::int64_t i = 0; i < count; ++i) {
      if constexpr (is_reduced_float_v<T>) {
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(divisor));
      } else {
        p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
      }
    }
  });
}

} // namespace dtensor::detail
