#pragma once
// How a (batched) matrix product over strided tensors maps onto one row-major BLAS call: the leading
// dimension and transpose flag of each operand, which operands need a contiguous copy first, and the
// batch strides. Plain constexpr values: the typed matmul (gemm.hpp) fills them in from its tensors, and
// the host (OpenBLAS) and CUDA (cuBLAS) kernels both run the same plan.
//
//   // c (4, 5) = a (4, 3) x b (5, 3)^T, where a is a transposed view (strides (1, 4)):
//   auto p = dtensor::detail::plan_gemm(1, {4, 3, 1, 4, 0}, false, {5, 3, 3, 1, 0}, true, {4, 5, 5, 1, 0});
//   // p.a = {.ld = 4, .trans = true}: a transposed GEMM on a's memory, no copy
//
// A matrix whose elements are unit-stride along one dim is a BLAS operand as it is: unit stride along
// its columns makes it row-major with ld = its row stride; unit stride along its rows makes it the
// transpose of a row-major matrix with ld = its column stride (so a transposed view costs a transposed
// GEMM, never a copy). Anything else (two non-unit strides, overlapping rows, an ld beyond BLAS's int)
// is copied to contiguous memory first. A column-major output is computed as its transpose,
// c^T = op(b)^T op(a)^T, by swapping the operands.

#include <cstdint>
#include <limits>

namespace dtensor::detail {

/// The rows x cols matrix a tensor holds (for a batch: one of them, `batch_stride` elements apart).
/// Strides are in elements.
struct MatrixView {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  std::int64_t col_stride = 1;
  std::int64_t batch_stride = 0;
};

/// A GEMM operand as a row-major BLAS sees it: the stored matrix has `ld` elements between rows, and the
/// logical operand is that matrix, transposed when `trans`. `copy`: the layout fits no BLAS call; the
/// caller copies the tensor to contiguous memory and plans again.
struct BlasOperand {
  std::int64_t ld = 1;
  bool trans = false;
  bool copy = false;
};

/// One strided-batched, row-major GEMM: for i < batch, C_i (m x n) = alpha op(A_i) op(B_i) + beta C_i,
/// where X_i starts `stride_x * i` elements after X's first element. `swapped`: A is the second tensor of
/// the product and B the first (a column-major output computed as its transpose).
struct GemmPlan {
  std::int64_t batch = 1;
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  BlasOperand a, b, c;
  std::int64_t stride_a = 0;
  std::int64_t stride_b = 0;
  std::int64_t stride_c = 0;
  bool swapped = false;

  /// True when some operand must be copied to contiguous memory before the plan can run.
  constexpr bool needs_copy() const noexcept { return a.copy || b.copy || c.copy; }
};

inline constexpr std::int64_t blas_int_max = std::numeric_limits<std::int32_t>::max();

/// `v` viewed as a BLAS operand, `trans` applied on top of its layout. @post copy, or ld >= max(1, stored
/// cols) and ld fits BLAS's int.
constexpr BlasOperand blas_operand(const MatrixView& v, bool trans) noexcept {
  const std::int64_t rows = v.rows;
  const std::int64_t cols = v.cols;
  // Along a dim of size <= 1 the stride is never followed, so it does not constrain the layout.
  if ((cols <= 1 || v.col_stride == 1) && (rows <= 1 || v.row_stride >= (cols > 1 ? cols : 1))) {
    const std::int64_t ld = rows <= 1 ? (cols > 1 ? cols : 1) : v.row_stride;
    return {ld, trans, ld > blas_int_max};
  }
  if ((rows <= 1 || v.row_stride == 1) && (cols <= 1 || v.col_stride >= (rows > 1 ? rows : 1))) {
    const std::int64_t ld = cols <= 1 ? (rows > 1 ? rows : 1) : v.col_stride;
    return {ld, !trans, ld > blas_int_max};
  }
  return {rows > 1 ? rows : 1, trans, true};
}

/// The plan of c = op(a) op(b) over `batch` matrices (a batch stride of 0 shares an operand between
/// batches). @pre the shapes agree: op(a) is m x k, op(b) is k x n, c is m x n.
constexpr GemmPlan plan_gemm(std::int64_t batch, const MatrixView& a, bool trans_a, const MatrixView& b,
                             bool trans_b, const MatrixView& c) noexcept {
  GemmPlan p;
  p.batch = batch;
  p.m = c.rows;
  p.n = c.cols;
  p.k = trans_a ? a.rows : a.cols;
  p.a = blas_operand(a, trans_a);
  p.b = blas_operand(b, trans_b);
  p.c = blas_operand(c, false);
  p.stride_a = a.batch_stride;
  p.stride_b = b.batch_stride;
  p.stride_c = c.batch_stride;
  if (p.c.trans && !p.c.copy) { // column-major c: compute c^T (n x m) = op(b)^T op(a)^T
    p.swapped = true;
    p.c.trans = false;
    const BlasOperand first = p.a;
    p.a = {p.b.ld, !p.b.trans, p.b.copy};
    p.b = {first.ld, !first.trans, first.copy};
    const std::int64_t m = p.m;
    p.m = p.n;
    p.n = m;
    const std::int64_t stride = p.stride_a;
    p.stride_a = p.stride_b;
    p.stride_b = stride;
  }
  // A shared B and an A and C whose matrices follow each other row after row: the batch is one taller
  // GEMM (the linear layer's (batch, m, k) x (k, n)), which BLAS runs better than `batch` small ones.
  if (p.batch > 1 && p.stride_b == 0 && !p.a.trans && !p.needs_copy() && p.stride_a == p.m * p.a.ld &&
      p.stride_c == p.m * p.c.ld && p.m * p.batch <= blas_int_max) {
    p.m *= p.batch;
    p.batch = 1;
  }
  return p;
}

} // namespace dtensor::detail
