#pragma once
// gather and scatter over point-to-point, for any HostTransport (transport.hpp): the root posts one
// transfer per other member straight into / out of that member's block (no staging copy), copies its own
// block while they run, then waits for all of them; every other member makes its one transfer with the
// root.
//
//   generic::gather(transport, in, blocks, root, slot, deadline);    // blocks: root only, one per member
//   generic::scatter(transport, blocks, out, root, slot, deadline);
//
// Arguments are the ones Backend's front checked (backends/backend.hpp): on the root one block per member,
// its own matching this rank's buffer.

#include "dtensor/backends/buffer.hpp"
#include "dtensor/backends/generic/transport.hpp"

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace dtensor::detail::generic {

/// dst = src (same count; the root's own block of gather and scatter).
inline void copy_block(const BufferRef& dst, const BufferRef& src) {
  if (src.count > 0 && dst.data != src.data) {
    std::memmove(dst.data, src.data, src.nbytes());
  }
}

/// A member's one transfer with the root: send `b` (gather) or receive into it (scatter).
template <HostTransport T>
void transfer_with_root(T& t, bool receive, const BufferRef& b, int root, std::uint64_t slot,
                        Clock::time_point deadline) {
  if (b.count == 0) {
    return;
  }
  auto r = t.region(b.data, b.nbytes());
  if (receive) {
    t.recv(r, root, slot, 0, b.nbytes());
    t.wait_recv(r, deadline);
  } else {
    t.send(r, root, slot, 0, b.nbytes());
    t.wait_send(r, deadline);
  }
}

/// The root's side: posts a transfer of blocks[m] with every other member m (receive: gather; send:
/// scatter), runs `own_copy` while they run, then waits for all of them.
template <HostTransport T, class OwnCopy>
void transfers_at_root(T& t, bool receive, std::span<const BufferRef> blocks, std::uint64_t slot,
                       Clock::time_point deadline, OwnCopy&& own_copy) {
  const int n = t.size();
  const int me = t.rank();
  std::vector<typename T::Region> regions;
  for (int i = 1; i < n; ++i) {
    const int m = receive ? (me - i + n) % n : (me + i) % n;
    const BufferRef& b = blocks[static_cast<std::size_t>(m)];
    if (b.count > 0) {
      regions.push_back(t.region(b.data, b.nbytes()));
      if (receive) {
        t.recv(regions.back(), m, slot, 0, b.nbytes());
      } else {
        t.send(regions.back(), m, slot, 0, b.nbytes());
      }
    }
  }
  own_copy();
  for (auto& r : regions) {
    if (receive) {
      t.wait_recv(r, deadline);
    } else {
      t.wait_send(r, deadline);
    }
  }
}

/// On root: blocks[m] = in of member m.
template <HostTransport T>
void gather(T& t, BufferRef in, std::span<const BufferRef> blocks, int root, std::uint64_t slot,
            Clock::time_point deadline) {
  if (t.rank() != root) {
    transfer_with_root(t, /*receive=*/false, in, root, slot, deadline);
    return;
  }
  transfers_at_root(t, /*receive=*/true, blocks, slot, deadline,
                    [&] { copy_block(blocks[static_cast<std::size_t>(root)], in); });
}

/// Member m receives the root's blocks[m] into out.
template <HostTransport T>
void scatter(T& t, std::span<const BufferRef> blocks, BufferRef out, int root, std::uint64_t slot,
             Clock::time_point deadline) {
  if (t.rank() != root) {
    transfer_with_root(t, /*receive=*/true, out, root, slot, deadline);
    return;
  }
  transfers_at_root(t, /*receive=*/false, blocks, slot, deadline,
                    [&] { copy_block(out, blocks[static_cast<std::size_t>(root)]); });
}

} // namespace dtensor::detail::generic
