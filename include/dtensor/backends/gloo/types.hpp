#pragma once
// What gloo needs to know about dtensor's data (the counterpart of backends/mpi/types.hpp and
// backends/nccl/types.hpp): gloo's algorithms are templates over the element type but use only its size,
// and reduce with a function pointer; dtensor gives them the host reductions of backends/generic/reduce.hpp,
// which cover every DType and ReduceOp (gloo's own cover a few types).
//
//   with_gloo_type(buf.dtype, [&]<class T>(T) { options.setOutput(static_cast<T*>(buf.data), n); });
//   options.setReduceFunction(detail::reduce_function(buf.dtype, op));

#include "dtensor/backends/generic/reduce.hpp"
#include "dtensor/core/element_type.hpp"

#include <utility>

namespace dtensor::detail {

/// Calls f(T{}) with an element type of `dtype`'s size, for gloo's typed options (visit_dtype).
template <class F>
void with_gloo_type(DType dtype, F&& f) {
  visit_dtype(dtype, std::forward<F>(f));
}

} // namespace dtensor::detail
