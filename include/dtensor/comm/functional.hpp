#pragma once
// dtensor::functional: collectives that return new tensors and leave their inputs untouched
// (torch.distributed._functional_collectives). Synchronous.
//
//   auto sum  = dtensor::functional::all_reduce(x, dtensor::ReduceOp::sum, group);
//   auto full = dtensor::functional::all_gather_into_tensor(shard, group);      // [n*k, ...]
//   auto part = dtensor::functional::reduce_scatter_tensor(full, dtensor::ReduceOp::sum, group);  // [k, ...]

#include "dtensor/comm/collectives.hpp"

#include <span>
#include <vector>

namespace dtensor::functional {

namespace detail {
template <class T, int Rank>
Tensor<T, Rank> fresh_copy(const Tensor<T, Rank>& t) {
  return t.clone(); // contiguous, new memory
}
} // namespace detail

/// op over every member's `input`.
template <class T, int Rank>
Tensor<T, Rank> all_reduce(const Tensor<T, Rank>& input, ReduceOp op, const ProcessGroup& group) {
  auto out = detail::fresh_copy(input);
  dtensor::all_reduce(out, op, group);
  return out;
}

/// `input` of member `src`.
template <class T, int Rank>
Tensor<T, Rank> broadcast(const Tensor<T, Rank>& input, int src, const ProcessGroup& group) {
  auto out = detail::fresh_copy(input);
  dtensor::broadcast(out, src, group);
  return out;
}

/// The inputs of all members concatenated along dim 0: [n*k, ...] from [k, ...].
template <class T, int Rank>
Tensor<T, Rank> all_gather_into_tensor(const Tensor<T, Rank>& input, const ProcessGroup& group) {
  static_assert(Rank >= 1, "functional::all_gather_into_tensor concatenates along dim 0: rank >= 1");
  auto shape = input.shape();
  shape[0] *= group.impl("all_gather_into_tensor").size();
  Tensor<T, Rank> out(shape, input.device());
  dtensor::all_gather_into_tensor(out, input.contiguous(), group);
  return out;
}

/// Block `rank` ([k, ...]) of the reduction of every member's input ([n*k, ...]).
template <class T, int Rank>
Tensor<T, Rank> reduce_scatter_tensor(const Tensor<T, Rank>& input, ReduceOp op, const ProcessGroup& group) {
  static_assert(Rank >= 1, "functional::reduce_scatter_tensor splits dim 0: rank >= 1");
  const int n = group.impl("reduce_scatter_tensor").size();
  DTENSOR_CHECK(input.shape(0) % n == 0,
                dtensor::detail::op_context(group, "reduce_scatter_tensor") + ": the input " +
                    dtensor::detail::shape_to_string(input.shape()) +
                    " has a dim 0 not divisible by the group size " + std::to_string(n));
  auto shape = input.shape();
  shape[0] /= n;
  Tensor<T, Rank> out(shape, input.device());
  dtensor::reduce_scatter_tensor(out, input.contiguous(), op, group);
  return out;
}

/// all_to_all_single with equal splits of dim 0.
template <class T, int Rank>
Tensor<T, Rank> all_to_all_single(const Tensor<T, Rank>& input, const ProcessGroup& group) {
  Tensor<T, Rank> out(input.shape(), input.device());
  dtensor::all_to_all_single(out, input.contiguous(), group);
  return out;
}

/// all_to_all_single with explicit dim-0 splits; the output has sum(output_split_sizes) rows.
template <class T, int Rank>
Tensor<T, Rank>
all_to_all_single(const Tensor<T, Rank>& input, std::span<const std::int64_t> output_split_sizes,
                  std::span<const std::int64_t> input_split_sizes, const ProcessGroup& group) {
  static_assert(Rank >= 1, "functional::all_to_all_single splits dim 0: rank >= 1");
  auto shape = input.shape();
  shape[0] = 0;
  for (auto s : output_split_sizes) {
    shape[0] += s;
  }
  if (output_split_sizes.empty()) {
    shape[0] = input.shape(0);
  }
  DTENSOR_CHECK(shape[0] >= 0, dtensor::detail::op_context(group, "all_to_all_single") +
                                   ": negative output split sizes " +
                                   dtensor::detail::format_list(output_split_sizes, ", "));
  Tensor<T, Rank> out(shape, input.device());
  dtensor::all_to_all_single(out, input.contiguous(), output_split_sizes, input_split_sizes, group);
  return out;
}

/// The inputs of every member, one tensor each; `shapes[i]` is member i's input shape (sizes may differ).
template <class T, int Rank>
std::vector<Tensor<T, Rank>> all_gather(const Tensor<T, Rank>& input,
                                        std::span<const typename Tensor<T, Rank>::Shape> shapes,
                                        const ProcessGroup& group) {
  std::vector<Tensor<T, Rank>> outs;
  for (const auto& s : shapes) {
    outs.emplace_back(s, input.device());
  }
  dtensor::all_gather(outs, input.contiguous(), group);
  return outs;
}

} // namespace dtensor::functional
