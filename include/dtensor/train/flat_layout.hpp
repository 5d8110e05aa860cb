#pragma once
// FlatLayout: where the parameters of one FSDP group sit in its flat buffer, and which part of each one a
// data-parallel rank holds. Plain value code, no tensors, no element type:
//
//   FlatLayout l({6 * 5, 6, 3 * 6, 3});  // four parameters' local numels: offsets 0, 30, 36, 54; 57 in all
//   l.shard_begin(4, 1);                 // 15: torch.chunk of 57 over 4 ranks gives 15, 15, 15, 12
//   l.shard_numel(4, 3);                 // 12 (uneven last shard, no padding)
//   for (const FlatPiece& p : l.pieces(4, 1)) ...  // rank 1's elements [15, 30): param 0 at 15, 15 of them
//
// The flat buffer is the parameters' local tensors (each the block its tensor-parallel placements give
// this rank, whole over the data-parallel axes) flattened and concatenated in order; it is sharded over the
// data-parallel axis as Shard<0> of a 1-D tensor, in torch.chunk's chunks (layout/algebra.hpp): chunk =
// ceil(N/n), so the last ranks may hold fewer elements or none. Nothing is padded: the all_gather and the
// reduce_scatter use the backends' variable-size collectives, as every uneven redistribute does.

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "dtensor/core/error.hpp"
#include "dtensor/layout/algebra.hpp"

namespace dtensor {

/// A run of elements of one parameter inside a rank's flat shard.
struct FlatPiece {
  int param = 0;             ///< which parameter
  std::int64_t param_at = 0; ///< first element, in the parameter's flattened local tensor
  std::int64_t shard_at = 0; ///< first element, in the rank's flat shard
  std::int64_t numel = 0;    ///< how many

  friend constexpr bool operator==(const FlatPiece&, const FlatPiece&) = default;
};

/// The parameters' places in the flat buffer (offsets, numels) and the chunks of the data-parallel ranks.
class FlatLayout {
public:
  FlatLayout() = default;
  /// `numels[i]`: the number of elements of parameter i's local tensor (>= 0).
  explicit FlatLayout(std::vector<std::int64_t> numels) : numels_(std::move(numels)) {
    offsets_.reserve(numels_.size());
    for (std::int64_t n : numels_) {
      DTENSOR_CHECK(n >= 0, "FlatLayout: a parameter has a negative number of elements");
      offsets_.push_back(total_);
      total_ += n;
    }
  }
  FlatLayout(std::initializer_list<std::int64_t> numels) : FlatLayout(std::vector<std::int64_t>(numels)) {}

  int num_params() const noexcept { return static_cast<int>(numels_.size()); }
  /// Elements of the whole flat buffer (every parameter's local tensor).
  std::int64_t total() const noexcept { return total_; }
  std::int64_t offset(int param) const { return offsets_.at(static_cast<std::size_t>(param)); }
  std::int64_t numel(int param) const { return numels_.at(static_cast<std::size_t>(param)); }

  /// First flat element of shard `i` of `n` (torch.chunk).
  std::int64_t shard_begin(int n, int i) const noexcept { return chunk_offset(total_, n, i); }
  /// Elements of shard `i` of `n`: ceil(N/n), fewer or none for the last ranks.
  std::int64_t shard_numel(int n, int i) const noexcept { return chunk_size(total_, n, i); }

  /// The parameters' runs inside shard `i` of `n`, in flat order (parameters with no element there are
  /// left out).
  /// @post the pieces' numels add up to shard_numel(n, i) and their shard_at are increasing.
  std::vector<FlatPiece> pieces(int n, int i) const {
    const std::int64_t begin = shard_begin(n, i);
    const std::int64_t end = begin + shard_numel(n, i);
    std::vector<FlatPiece> out;
    for (int p = 0; p < num_params(); ++p) {
      const std::int64_t lo = offsets_[p] > begin ? offsets_[p] : begin;
      const std::int64_t hi = offsets_[p] + numels_[p] < end ? offsets_[p] + numels_[p] : end;
      if (lo < hi) {
        out.push_back({p, lo - offsets_[p], lo - begin, hi - lo});
      }
    }
    return out;
  }

private:
  std::vector<std::int64_t> numels_;
  std::vector<std::int64_t> offsets_;
  std::int64_t total_ = 0;
};

} // namespace dtensor
