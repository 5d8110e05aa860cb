#pragma once
// GEMM operands in every layout a matmul must take, for the local GEMM tests (host and CUDA): a (batch,)
// rows x cols view inside a larger buffer, filled with small random integers (gaps included).

#include <dtensor/core/tensor.hpp>

#include <array>
#include <cstdint>
#include <random>

namespace dtensor::test_support {

enum class Layout { contiguous, padded, column_major, strided };
inline constexpr std::array<Layout, 4> layouts{Layout::contiguous, Layout::padded, Layout::column_major,
                                               Layout::strided};

/// `view` lies in `owner` at element `offset` with `strides`; rebuild it over a copy of the owner with
/// `view_of`.
template <class T, int R>
struct Operand {
  Tensor<T, 1> owner;
  Tensor<T, R> view;
  std::int64_t offset = 0;

  /// The same view over `other` (a copy of owner, e.g. on a GPU, ordered on `stream`).
  Tensor<T, R> view_of(const Tensor<T, 1>& other, CUstream_st* stream = nullptr) const {
    return Tensor<T, R>::from_blob(other.data() + offset, view.shape(), view.strides(), other.device(),
                                   stream);
  }
};

/// A view laid out as `layout`: contiguous; padded (a narrow()ed view of a (rows, cols + 3) tensor);
/// column-major (a transposed view of a (cols, rows) tensor); strided (every other column of a
/// (rows, 2 cols) tensor: no unit stride, so a GEMM must copy it). Rank 3 puts `batch` such matrices
/// one after the other.
template <class T, int R>
Operand<T, R> make_operand(std::int64_t batch, std::int64_t rows, std::int64_t cols, Layout layout,
                           std::mt19937& rng) {
  std::int64_t rs = cols, cs = 1, per_matrix = rows * cols;
  Operand<T, R> op;
  switch (layout) {
  case Layout::contiguous:
    break;
  case Layout::padded:
    rs = cols + 3;
    op.offset = 1;
    per_matrix = rows * (cols + 3);
    break;
  case Layout::column_major:
    rs = 1;
    cs = rows;
    break;
  case Layout::strided:
    rs = 2 * cols;
    cs = 2;
    per_matrix = 2 * rows * cols;
    break;
  }
  op.owner = Tensor<T, 1>({batch * per_matrix + op.offset});
  std::uniform_int_distribution<int> value(-3, 3);
  for (std::int64_t i = 0; i < op.owner.numel(); ++i) {
    op.owner.data()[i] = T(static_cast<float>(value(rng)));
  }
  if constexpr (R == 2) {
    op.view = Tensor<T, 2>::from_blob(op.owner.data() + op.offset, {rows, cols}, {rs, cs});
  } else {
    op.view = Tensor<T, 3>::from_blob(op.owner.data() + op.offset, {batch, rows, cols}, {per_matrix, rs, cs});
  }
  return op;
}

} // namespace dtensor::test_support
