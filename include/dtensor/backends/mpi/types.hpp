#pragma once
// MPI's names for dtensor's element types and reductions (the counterpart of backends/nccl/types.hpp and
// backends/gloo/types.hpp: what the backend needs to know about the data). Error checking for MPI calls,
// check_mpi, comes with the MPI runtime (rendezvous/detail/mpi.hpp).
//
//   MPI_Datatype t = detail::mpi_type(DType::bfloat16);                 // MPI_UINT16_T (bits only)
//   MPI_Op op = detail::mpi_op(DType::bfloat16, ReduceOp::max);         // a user op reducing in float
//   detail::check_mpi(MPI_Ibarrier(comm, &r), "MPI_Ibarrier", [&] { return where("barrier"); });
//
//  - float32/64, int32/64 and uint8 are MPI's own types and reduce with MPI's own ops (MPI_SUM, MPI_PROD,
//    MPI_MAX, MPI_MIN), which is what a raw MPI program calls. Integer sums and products wrap around.
//  - bfloat16, float16, float8_e4m3 and float8_e5m2 have no MPI type: they move as MPI_UINT16_T /
//    MPI_UINT8_T (their bits) and reduce with user ops (MPI_Op_create, commutative) running the host
//    reductions of backends/generic/reduce.hpp, in float and rounded back after each pairwise step, like
//    the gloo backend.
//  - ReduceOp::avg reduces as sum; the backend divides by the group size afterwards (floats divide,
//    integers truncate toward zero), like the gloo backend.
//  - User ops are made once per process (dtype, op) and freed before MPI_Finalize (MpiRuntime's releases,
//    rendezvous/detail/mpi.hpp).

#include "dtensor/backends/generic/reduce.hpp"
#include "dtensor/backends/type_tables.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/rendezvous/detail/mpi.hpp"

#include <mpi.h>

#include <array>
#include <cstddef>
#include <mutex>
#include <string>
#include <type_traits>

namespace dtensor::detail {

/// The MPI type elements of `dtype` move as (the reduced floats as their bits). Not a constant: MPI's
/// handles need not be constant expressions.
inline MPI_Datatype mpi_type(DType dtype) {
  const DTypeTable<MPI_Datatype> types{.float32 = MPI_FLOAT,
                                       .float64 = MPI_DOUBLE,
                                       .bfloat16 = MPI_UINT16_T,
                                       .float16 = MPI_UINT16_T,
                                       .int32 = MPI_INT32_T,
                                       .int64 = MPI_INT64_T,
                                       .uint8 = MPI_UINT8_T,
                                       .float8_e4m3 = MPI_UINT8_T,
                                       .float8_e5m2 = MPI_UINT8_T};
  return types.at(dtype, "MPI backend");
}

/// Whether MPI reduces `dtype` with its own ops (else a user op, see mpi_op).
constexpr bool mpi_reduces_natively(DType dtype) {
  return dtype == DType::float32 || dtype == DType::float64 || dtype == DType::int32 ||
         dtype == DType::int64 || dtype == DType::uint8;
}

/// MPI_User_function for elements T and `Op`: inout[i] = in[i] op inout[i].
template <class T, ReduceOp Op>
void mpi_user_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_kernel<T, Op>(inout, in, inout, static_cast<std::size_t>(*len));
}

/// The user ops of the reduced floats, made on first use (MPI must be initialised) and freed by
/// free_all() before MPI_Finalize.
class MpiUserOps {
public:
  static MpiUserOps& instance() {
    static MpiUserOps ops;
    return ops;
  }

  MPI_Op get(DType dtype, ReduceOp op) {
    const std::size_t i = static_cast<std::size_t>(dtype) * kOps + op_index(op);
    DTENSOR_CHECK(i < ops_.size(), "MPI backend: no user op for dtype " + std::string(dtype_name(dtype)));
    std::lock_guard lock(m_);
    if (ops_[i] == MPI_OP_NULL) {
      MPI_User_function* fn = visit_dtype(dtype, [op]<class T>(T) {
        const ReduceOpTable<MPI_User_function*> fns{.sum = &mpi_user_reduce<T, ReduceOp::sum>,
                                                    .avg = &mpi_user_reduce<T, ReduceOp::sum>,
                                                    .max = &mpi_user_reduce<T, ReduceOp::max>,
                                                    .min = &mpi_user_reduce<T, ReduceOp::min>,
                                                    .product = &mpi_user_reduce<T, ReduceOp::product>,
                                                    .band = &mpi_user_reduce<T, ReduceOp::band>,
                                                    .bor = &mpi_user_reduce<T, ReduceOp::bor>,
                                                    .bxor = &mpi_user_reduce<T, ReduceOp::bxor>};
        return fns.at(op, "MPI backend");
      });
      const int rc = MPI_Op_create(fn, /*commute=*/1, &ops_[i]);
      DTENSOR_CHECK(rc == MPI_SUCCESS, "MPI backend: MPI_Op_create for " + std::string(dtype_name(dtype)) +
                                           " " + std::string(to_string(op)) + " failed (code " +
                                           std::to_string(rc) + ")");
    }
    return ops_[i];
  }

  /// Frees every op made so far (call before MPI_Finalize).
  void free_all() {
    std::lock_guard lock(m_);
    for (MPI_Op& op : ops_) {
      if (op != MPI_OP_NULL) {
        MPI_Op_free(&op);
        op = MPI_OP_NULL;
      }
    }
  }

private:
  static constexpr std::size_t kOps = 7;   // sum (avg), product, max, min, band, bor, bxor
  static constexpr std::size_t kTypes = 9; // DType's values

  MpiUserOps() {
    ops_.fill(MPI_OP_NULL);
    MpiRuntime::instance().add_release([this] { free_all(); });
  }

  static constexpr std::size_t op_index(ReduceOp op) {
    switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return 0;
    case ReduceOp::product:
      return 1;
    case ReduceOp::max:
      return 2;
    case ReduceOp::min:
      return 3;
    case ReduceOp::band:
      return 4;
    case ReduceOp::bor:
      return 5;
    case ReduceOp::bxor:
      return 6;
    }
    return 0;
  }

  std::mutex m_;
  std::array<MPI_Op, kTypes * kOps> ops_{};
};

/// The MPI op that reduces `dtype` with `op` (avg as sum: the caller divides).
inline MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (!mpi_reduces_natively(dtype)) {
    return MpiUserOps::instance().get(dtype, op);
  }
  const ReduceOpTable<MPI_Op> ops{.sum = MPI_SUM,
                                  .avg = MPI_SUM,
                                  .max = MPI_MAX,
                                  .min = MPI_MIN,
                                  .product = MPI_PROD,
                                  .band = MPI_BAND,
                                  .bor = MPI_BOR,
                                  .bxor = MPI_BXOR};
  return ops.at(op, "MPI backend");
}

} // namespace dtensor::detail
