#pragma once
// A backend's names for dtensor's element types and reductions, as tables with one field per DType and per
// ReduceOp: backends/mpi/types.hpp and backends/nccl/types.hpp fill one each, so every mapping is written by
// name, side by side, and the switch over DType / ReduceOp is written here once.
//
//   inline constexpr DTypeTable<ncclDataType_t> nccl_types{.float32 = ncclFloat32, ..., .float8_e5m2 = ...};
//   ncclDataType_t t = nccl_types.at(buf.dtype, "NCCL backend");
//   const ReduceOpTable<MPI_Op> ops{.sum = MPI_SUM, .avg = MPI_SUM, .max = MPI_MAX, .min = MPI_MIN, ...};
//
// Only core/ is included: the NCCL types compile without MPI, and the MPI types without CUDA.

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"

#include <string>
#include <string_view>

namespace dtensor::detail {

/// A backend's value for each of dtensor's element types (DType's fields, in its order).
template <class V>
struct DTypeTable {
  V float32;
  V float64;
  V bfloat16;
  V float16;
  V int32;
  V int64;
  V uint8;
  V float8_e4m3;
  V float8_e5m2;

  /// The entry of `d`; Error("<backend>: unknown dtype <n>") for a value outside DType.
  constexpr V at(DType d, std::string_view backend) const {
    switch (d) {
    case DType::float32:
      return float32;
    case DType::float64:
      return float64;
    case DType::bfloat16:
      return bfloat16;
    case DType::float16:
      return float16;
    case DType::int32:
      return int32;
    case DType::int64:
      return int64;
    case DType::uint8:
      return uint8;
    case DType::float8_e4m3:
      return float8_e4m3;
    case DType::float8_e5m2:
      return float8_e5m2;
    }
    throw Error(std::string(backend) + ": unknown dtype " + std::to_string(static_cast<int>(d)));
  }
};

/// A backend's value for each ReduceOp (ReduceOp's fields, in its order).
template <class V>
struct ReduceOpTable {
  V sum;
  V avg;
  V max;
  V min;
  V product;
  V band;
  V bor;
  V bxor;

  /// The entry of `op`; Error("<backend>: unsupported reduce op <n>") for a value outside ReduceOp.
  constexpr V at(ReduceOp op, std::string_view backend) const {
    switch (op) {
    case ReduceOp::sum:
      return sum;
    case ReduceOp::avg:
      return avg;
    case ReduceOp::max:
      return max;
    case ReduceOp::min:
      return min;
    case ReduceOp::product:
      return product;
    case ReduceOp::band:
      return band;
    case ReduceOp::bor:
      return bor;
    case ReduceOp::bxor:
      return bxor;
    }
    throw Error(std::string(backend) + ": unsupported reduce op " + std::to_string(static_cast<int>(op)));
  }
};

} // namespace dtensor::detail
