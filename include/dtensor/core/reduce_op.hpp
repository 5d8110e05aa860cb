#pragma once
// ReduceOp: the reductions every collective supports (torch.distributed.ReduceOp's, but PREMUL_SUM).

#include <cstdint>
#include <string_view>

namespace dtensor {

/// Reduction applied by all_reduce, reduce, reduce_scatter and by Partial placements.
/// `avg` is sum followed by division by the group size (integers: the quotient truncated toward zero,
/// as C++ `/` does). `band`, `bor`, `bxor` (torch's BAND, BOR, BXOR) are bitwise and defined for integer
/// element types only (int32, int64, uint8): a floating tensor is refused with an Error before any
/// communication, as torch refuses it, and NCCL, which has no bitwise reduction, refuses them all.
enum class ReduceOp : std::uint8_t { sum, avg, max, min, product, band, bor, bxor };

/// Whether `op` is bitwise (band, bor, bxor): integer element types only.
constexpr bool is_bitwise(ReduceOp op) noexcept {
  return op == ReduceOp::band || op == ReduceOp::bor || op == ReduceOp::bxor;
}

/// "sum", "avg", "max", "min", "product", "band", "bor", "bxor".
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
  case ReduceOp::band:
    return "band";
  case ReduceOp::bor:
    return "bor";
  case ReduceOp::bxor:
    return "bxor";
  }
  return "?";
}

} // namespace dtensor
