#pragma once
// ReduceOp: the reductions every collective supports (torch.distributed.ReduceOp's common subset).

#include <cstdint>
#include <string_view>

namespace dtensor {

/// Reduction applied by all_reduce, reduce, reduce_scatter and by Partial placements.
/// `avg` is sum followed by division by the group size (integers: the quotient truncated toward zero,
/// as C++ `/` does).
enum class ReduceOp : std::uint8_t { sum, avg, max, min, product };

/// "sum", "avg", "max", "min", "product".
constexpr std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
  case ReduceOp::sum:
    return "sum";
  case ReduceOp::avg:
    return "avg";
  case ReduceOp::max:
    return "max";
  case ReduceOp::min:
    return "min";
  case ReduceOp::product:
    return "product";
  }
  return "?";
}

} // namespace dtensor
