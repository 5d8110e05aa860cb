#pragma once
// reduce_scatter as one exchange plus a fold in rank order, for any HostTransport (transport.hpp).
//
//   generic::reduce_scatter(transport, in, out, counts, displs, ReduceOp::sum, slot, deadline);
//
// Each member sends block i of its input straight to member i, which receives the n-1 blocks into the
// group's scratch (so a rank receives (n-1)/n of its input, like a ring, but in one round, with one
// latency instead of n-1) and folds them into `out` in rank order as they arrive: block m is folded once
// blocks 0..m are in, whatever order they came in, so the result is bitwise the same on every run and
// equals a rank-order reduction ((b0 op b1) op b2) op ... . Nothing is allocated per call beyond the
// transport's region handles for the input; the scratch is the group's, reused.
//
// Arguments are the ones Backend's front checked (backends/backend.hpp); `out` may lie inside `in` (in
// place): then this rank's own block is saved to the scratch before it can be overwritten.

#include "dtensor/backends/buffer.hpp"
#include "dtensor/backends/generic/reduce.hpp"
#include "dtensor/backends/generic/transport.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

namespace dtensor::detail::generic {

/// out = block rank() of every member's input, reduced in rank order with `op` (avg: then divided by the
/// group size). @pre out.count == counts[rank()].
template <HostTransport T>
void reduce_scatter(T& t, BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs, ReduceOp op, std::uint64_t slot,
                    Clock::time_point deadline) {
  const int n = t.size();
  const int me = t.rank();
  const std::size_t es = dtype_size(in.dtype);
  const std::int64_t mine = counts[me];
  const std::size_t bytes = static_cast<std::size_t>(mine) * es;
  const auto* in_bytes = static_cast<const char*>(in.data);
  if (n == 1) {
    std::memmove(out.data, in_bytes + displs[0] * es, bytes);
  } else {
    // An output inside the input (in place): keep our own block and the outgoing ones intact until sent.
    const bool overlap = bytes > 0 && in.count > 0 &&
                         static_cast<const char*>(out.data) < in_bytes + in.nbytes() &&
                         in_bytes < static_cast<const char*>(out.data) + bytes;
    // Scratch slots: member m < me at m, m > me at m - 1, and (when overlapping) our own at n - 1.
    char* st = bytes > 0 ? t.scratch(bytes * static_cast<std::size_t>(overlap ? n : n - 1)) : nullptr;
    auto slot_of = [&](int m) { return static_cast<std::size_t>(m < me ? m : m - 1) * bytes; };
    // One receive region per member over the whole scratch: a completion then names its member.
    for (int i = 1; i < n && bytes > 0; ++i) {
      const int src = (me - i + n) % n;
      t.recv(t.scratch_region(src), src, slot, slot_of(src), bytes);
    }
    std::optional<typename T::Region> ib;
    int nsend = 0;
    for (int i = 1; i < n; ++i) {
      const int dst = (me + i) % n;
      if (counts[dst] > 0) {
        if (!ib) {
          ib.emplace(t.region(const_cast<char*>(in_bytes), in.nbytes()));
        }
        t.send(*ib, dst, slot, static_cast<std::size_t>(displs[dst]) * es,
               static_cast<std::size_t>(counts[dst]) * es);
        ++nsend;
      }
    }
    auto wait_sends = [&] {
      for (; nsend > 0; --nsend) {
        t.wait_send(*ib, deadline);
      }
    };
    if (bytes > 0) {
      const char* own = in_bytes + displs[me] * es;
      if (overlap) {
        wait_sends();
        std::memcpy(st + static_cast<std::size_t>(n - 1) * bytes, own, bytes);
        own = st + static_cast<std::size_t>(n - 1) * bytes;
      }
      const auto fn = reduce_function(in.dtype, op);
      const auto count = static_cast<std::size_t>(mine);
      auto block = [&](int m) -> const char* { return m == me ? own : st + slot_of(m); };
      auto wait_for = [&](int m) {
        if (m != me) {
          t.wait_recv(t.scratch_region(m), deadline);
        }
      };
      wait_for(0);
      wait_for(1);
      fn(out.data, block(0), block(1), count);
      for (int m = 2; m < n; ++m) {
        wait_for(m);
        fn(out.data, out.data, block(m), count);
      }
    }
    wait_sends();
  }
  if (op == ReduceOp::avg) {
    divide_in_place(out.data, out.count, out.dtype, n);
  }
}

} // namespace dtensor::detail::generic
