#pragma once
// The argument checks every backend needs, written once: Backend's public ops (backends/backend.hpp) call
// them before any hook runs, so every backend rejects the same mistakes with the same messages.
//
//   const auto at = [&] { return describe() + ": all_gather"; };   // called only when a check fails
//   detail::check_layout(at, "counts", counts, displs, out, size);   // one block per member, inside out
//
// Contract: each function throws Error whose message starts with where() -- "<describe()>: <op>" -- and
// says what is wrong with which argument; where() is called only on failure, so a check that passes
// allocates nothing. What a backend decides itself (where its buffers may live, Backend::check_memory) is
// not checked here; check_blocks takes it as `memory`.

#include "dtensor/backends/buffer.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dtensor::detail {

/// A non-negative element count, and data unless the buffer is empty. `what` names it ("input").
template <class Where>
void check_buffer(const Where& where, const BufferRef& b, const char* what) {
  DTENSOR_CHECK(b.count >= 0,
                where() + ": the " + what + " has a negative element count " + std::to_string(b.count));
  DTENSOR_CHECK(b.count == 0 || b.data != nullptr, where() + ": the " + what + " has no data (" +
                                                       std::to_string(b.count) + " elements at nullptr)");
}

template <class Where>
void check_same_dtype(const Where& where, const BufferRef& in, const BufferRef& out) {
  DTENSOR_CHECK(in.dtype == out.dtype, where() + ": input is " + std::string(dtype_name(in.dtype)) +
                                           " but output is " + std::string(dtype_name(out.dtype)));
}

/// A root in [0, size). `what`: "dst" (reduce, gather) or "src" (broadcast, scatter), torch's names.
template <class Where>
void check_root(const Where& where, int root, int size, const char* what) {
  DTENSOR_CHECK(root >= 0 && root < size, where() + ": " + what + " " + std::to_string(root) +
                                              " is out of range for a group of " + std::to_string(size));
}

/// One count and displacement per member of a group of `size`, each block inside `buf`. `what` names the
/// counts ("counts", "input split sizes").
template <class Where>
void check_layout(const Where& where, const char* what, std::span<const std::int64_t> counts,
                  std::span<const std::int64_t> displs, const BufferRef& buf, int size) {
  DTENSOR_CHECK(counts.size() == static_cast<std::size_t>(size) && displs.size() == counts.size(),
                where() + ": " + what + " has " + std::to_string(counts.size()) + " entries (displacements " +
                    std::to_string(displs.size()) + ") for a group of " + std::to_string(size));
  for (std::size_t i = 0; i < counts.size(); ++i) {
    DTENSOR_CHECK(counts[i] >= 0 && displs[i] >= 0, where() + ": negative size in " + what + " " +
                                                        format_list(counts) + " / displacements " +
                                                        format_list(displs));
    DTENSOR_CHECK(displs[i] <= buf.count && counts[i] <= buf.count - displs[i],
                  where() + ": " + what + " " + format_list(counts) + " at displacements " +
                      format_list(displs) + " do not fit a buffer of " + std::to_string(buf.count) +
                      " elements");
  }
}

/// all_gather's input / reduce_scatter's output (`what`) holds this rank's block: counts[rank] elements.
template <class Where>
void check_own_count(const Where& where, const char* what, const BufferRef& mine,
                     std::span<const std::int64_t> counts, int rank) {
  const auto me = static_cast<std::size_t>(rank);
  DTENSOR_CHECK(mine.count == counts[me], where() + ": the " + what + " has " + std::to_string(mine.count) +
                                              " elements but counts[" + std::to_string(rank) + "] is " +
                                              std::to_string(counts[me]) + "; counts " + format_list(counts));
}

/// all_to_all: this rank sends itself what it expects from itself, and `in` and `out` do not overlap (it
/// does not run in place).
template <class Where>
void check_all_to_all(const Where& where, const BufferRef& in, std::span<const std::int64_t> send_counts,
                      const BufferRef& out, std::span<const std::int64_t> recv_counts, int rank) {
  const auto me = static_cast<std::size_t>(rank);
  DTENSOR_CHECK(send_counts[me] == recv_counts[me],
                where() + ": this rank sends itself " + std::to_string(send_counts[me]) +
                    " elements but expects " + std::to_string(recv_counts[me]));
  const auto ib = reinterpret_cast<std::uintptr_t>(in.data);
  const auto ob = reinterpret_cast<std::uintptr_t>(out.data);
  DTENSOR_CHECK(in.nbytes() == 0 || out.nbytes() == 0 || ib + in.nbytes() <= ob || ob + out.nbytes() <= ib,
                where() + ": the input (" + std::to_string(in.count) + " elements) and the output (" +
                    std::to_string(out.count) +
                    " elements) overlap; all_to_all does not run in place: use separate buffers");
}

/// gather's / scatter's blocks on the root: one per member of a group of `size`, each a valid buffer
/// (`memory(block)` first: the backend's rule) of `mine`'s dtype, and this rank's block as long as `mine`
/// (gather's input, scatter's output).
template <class Where, class Memory>
void check_blocks(const Where& where, bool is_gather, std::span<const BufferRef> blocks,
                  const BufferRef& mine, int rank, int size, const Memory& memory) {
  DTENSOR_CHECK(blocks.size() == static_cast<std::size_t>(size),
                where() + ": the root needs one block per member (" + std::to_string(size) + "), got " +
                    std::to_string(blocks.size()));
  for (const BufferRef& b : blocks) {
    memory(b);
    check_buffer(where, b, "block");
    if (is_gather) {
      check_same_dtype(where, mine, b);
    } else {
      check_same_dtype(where, b, mine);
    }
  }
  const BufferRef& own = blocks[static_cast<std::size_t>(rank)];
  DTENSOR_CHECK(own.count == mine.count, where() + ": the root's own block has " + std::to_string(own.count) +
                                             " elements but its " + (is_gather ? "input" : "output") +
                                             " has " + std::to_string(mine.count));
}

/// One point-to-point request of rank `rank` in a group of `size`: a peer in range that is not this rank,
/// a tag in [0, kMaxP2PTag).
template <class Where>
void check_peer_and_tag(const Where& where, const P2PRequest& r, int rank, int size) {
  DTENSOR_CHECK(r.peer >= 0 && r.peer < size && r.peer != rank,
                where() + ": peer " + std::to_string(r.peer) +
                    (r.peer == rank ? " is this rank itself" : " is out of range") + " for a group of " +
                    std::to_string(size));
  DTENSOR_CHECK(r.tag >= 0 && r.tag < kMaxP2PTag, where() + ": tag " + std::to_string(r.tag) +
                                                      " is outside [0, " + std::to_string(kMaxP2PTag) + ")");
}

/// new_group's list: distinct group ranks in [0, size), not empty.
template <class Where>
void check_group_ranks(const Where& where, std::span<const int> ranks, int size) {
  std::vector<int> sorted(ranks.begin(), ranks.end());
  std::sort(sorted.begin(), sorted.end());
  DTENSOR_CHECK(!ranks.empty() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                    sorted.front() >= 0 && sorted.back() < size,
                where() + ": ranks " + format_list(ranks) + " must be distinct group ranks in [0, " +
                    std::to_string(size) + ")");
}

} // namespace dtensor::detail
