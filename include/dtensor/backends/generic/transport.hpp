#pragma once
// What the host algorithms of backends/generic/ need from a backend's point-to-point engine, and nothing
// more: gloo's unbound buffers provide it (backends/gloo/transfer.hpp); MPI's Isend/Irecv would too.
//
//   template <detail::generic::HostTransport T>
//   void f(T& t) {
//     auto r = t.region(out.data, out.nbytes());            // register a memory range
//     t.recv(r, peer, slot, 0, out.nbytes());               // post (never blocks)
//     t.wait_recv(r, deadline);                             // one posted receive on r completed
//   }
//
// Contract of a transport T:
//  - T::Region is a movable handle over a registered memory range; transfers move byte ranges of it.
//  - region(data, nbytes) registers [data, data + nbytes).
//  - send(r, peer, slot, offset, nbytes) / recv(...) post a transfer of r's bytes [offset, offset + nbytes)
//    to / from group rank `peer`. A send and a receive match when they name each other and agree on slot
//    and nbytes; successive matching transfers pair up in posting order. Posting never blocks.
//  - wait_send(r, deadline) / wait_recv(r, deadline) wait until one more transfer posted on r completed;
//    they throw when it failed, the group was aborted, or `deadline` passed.
//  - scratch(nbytes) is the group's scratch memory: at least nbytes, not zeroed, valid until the next
//    scratch() call; scratch_region(member) is a receive region over the whole current scratch, one per
//    member (so wait_recv on it says that member's block arrived), valid as long as the scratch.
//  - rank() and size() are the group's.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>

namespace dtensor::detail::generic {

using Clock = std::chrono::steady_clock;

template <class T>
concept HostTransport = requires(T& t, const T& ct, typename T::Region& r, void* data, std::size_t n,
                                 int peer, std::uint64_t slot, Clock::time_point deadline) {
  requires std::movable<typename T::Region>;
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  { t.region(data, n) } -> std::same_as<typename T::Region>;
  t.send(r, peer, slot, n, n);
  t.recv(r, peer, slot, n, n);
  t.wait_send(r, deadline);
  t.wait_recv(r, deadline);
  { t.scratch(n) } -> std::same_as<char*>;
  { t.scratch_region(peer) } -> std::same_as<typename T::Region&>;
};

} // namespace dtensor::detail::generic
