#pragma once
// all_to_all and uneven all_gather over point-to-point, for any HostTransport (transport.hpp): every
// receive and send is posted before waiting on any, so no pair of members can deadlock, and this rank's
// own block is copied while the transfers run.
//
//   generic::all_to_all(transport, in, send_counts, send_displs, out, recv_counts, recv_displs, slot,
//                       deadline);
//   generic::all_gather(transport, in, out, counts, displs, slot, deadline);   // blocks of any size
//
// Counts and displacements are in elements of the buffers' dtype. Zero-sized blocks are skipped on both
// sides. Arguments are the ones Backend's front checked (backends/backend.hpp): one entry per member,
// blocks inside their buffers, equal dtypes, in and out apart.

#include "dtensor/backends/buffer.hpp"
#include "dtensor/backends/generic/transport.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

namespace dtensor::detail::generic {

/// The exchange both ops are: every member sends send_count(dst) elements from in[send_displ(dst)] to each
/// other member and receives recv_count(src) elements into out[recv_displ(src)] from each; its own block is
/// copied. Receives are posted first, in ring order, so opposite transfers never wait on each other.
template <HostTransport T, class SendCount, class SendDispl, class RecvCount, class RecvDispl>
void exchange_blocks(T& t, BufferRef in, BufferRef out, SendCount send_count, SendDispl send_displ,
                     RecvCount recv_count, RecvDispl recv_displ, std::uint64_t slot,
                     Clock::time_point deadline) {
  const int n = t.size();
  const int me = t.rank();
  const std::size_t es = dtype_size(in.dtype);
  std::optional<typename T::Region> ib, ob;
  int nsend = 0, nrecv = 0;
  for (int i = 1; i < n; ++i) {
    const int src = (me - i + n) % n;
    if (recv_count(src) > 0) {
      if (!ob) {
        ob.emplace(t.region(out.data, out.nbytes()));
      }
      t.recv(*ob, src, slot, static_cast<std::size_t>(recv_displ(src)) * es,
             static_cast<std::size_t>(recv_count(src)) * es);
      ++nrecv;
    }
  }
  for (int i = 1; i < n; ++i) {
    const int dst = (me + i) % n;
    if (send_count(dst) > 0) {
      if (!ib) {
        ib.emplace(t.region(in.data, in.nbytes()));
      }
      t.send(*ib, dst, slot, static_cast<std::size_t>(send_displ(dst)) * es,
             static_cast<std::size_t>(send_count(dst)) * es);
      ++nsend;
    }
  }
  if (recv_count(me) > 0) {
    std::memmove(static_cast<char*>(out.data) + recv_displ(me) * es,
                 static_cast<const char*>(in.data) + send_displ(me) * es,
                 static_cast<std::size_t>(recv_count(me)) * es);
  }
  for (int i = 0; i < nrecv; ++i) {
    t.wait_recv(*ob, deadline);
  }
  for (int i = 0; i < nsend; ++i) {
    t.wait_send(*ib, deadline);
  }
}

/// Member i receives in[send_displs[i] .. + send_counts[i]) into its out[recv_displs[me] .. +
/// recv_counts[me]).
/// @pre send_counts[rank] == recv_counts[rank]; in and out do not overlap.
template <HostTransport T>
void all_to_all(T& t, BufferRef in, std::span<const std::int64_t> send_counts,
                std::span<const std::int64_t> send_displs, BufferRef out,
                std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                std::uint64_t slot, Clock::time_point deadline) {
  exchange_blocks(
      t, in, out, [&](int q) { return send_counts[q]; }, [&](int q) { return send_displs[q]; },
      [&](int q) { return recv_counts[q]; }, [&](int q) { return recv_displs[q]; }, slot, deadline);
}

/// out[displs[m] .. + counts[m]) = in of member m, for blocks of any size (empty ones included).
/// @pre in.count == counts[rank].
template <HostTransport T>
void all_gather(T& t, BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                std::span<const std::int64_t> displs, std::uint64_t slot, Clock::time_point deadline) {
  exchange_blocks(
      t, in, out, [&](int) { return in.count; }, [](int) { return std::int64_t{0}; },
      [&](int q) { return counts[q]; }, [&](int q) { return displs[q]; }, slot, deadline);
}

} // namespace dtensor::detail::generic
