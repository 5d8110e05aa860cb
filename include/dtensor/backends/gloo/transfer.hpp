#pragma once
// How the gloo backend moves bytes between members outside gloo's own collectives: the tags ("slots") of
// its messages, and GlooTransport, the generic layer's HostTransport (backends/generic/transport.hpp)
// over a gloo context's unbound buffers, with the group's scratch memory.
//
// Slots are 64-bit. Three spaces, disjoint by their top byte:
//  - gloo's collectives (all_reduce, reduce, broadcast, even all_gather, barrier) use gloo's own prefixes
//    0x01..0x08 with the group's op sequence number as tag;
//  - dtensor's collectives over point-to-point (generic/) use 0x40 and the same sequence number
//    (collective_slot), with the message size folded into the low 24 bits (sized);
//  - point-to-point uses 0x80 | a direction bit, 23 bits of user tag and a 32-bit sequence number per
//    (peer, tag, direction) (p2p_slot), so successive sends a->b with one tag match successive receives
//    in order.

#include "dtensor/backends/generic/transport.hpp"
#include "dtensor/core/error.hpp"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace dtensor::detail {

/// The slot of dtensor's collective number `seq` of a group (top byte 0x40).
constexpr std::uint64_t collective_slot(std::uint32_t seq) {
  return (std::uint64_t{0x40} << 56) | (std::uint64_t{seq} << 24);
}

/// The slot of a point-to-point message: `ascending` (sender's rank < receiver's), the user tag (< 2^23)
/// and the sequence number of that (peer, tag, direction).
constexpr std::uint64_t p2p_slot(bool ascending, int tag, std::uint32_t seq) {
  return (std::uint64_t{0x80} << 56) | (std::uint64_t{ascending} << 55) |
         (static_cast<std::uint64_t>(tag) << 32) | seq;
}

/// A message's slot with its size folded into the low 24 bits (free in collective_slot): a send and a
/// receive match only when both sides agree on the size, so members that disagree get a timeout naming
/// the op instead of a short read (gloo completes a receive larger than the message) or an abort of the
/// process (gloo's loop thread throws on a message larger than the receive).
constexpr std::uint64_t sized(std::uint64_t slot, std::size_t nbytes) {
  const std::uint64_t b = nbytes;
  return slot | ((b ^ (b >> 24) ^ (b >> 48)) & 0xFFFFFF);
}

/// At least 1 ms left until `deadline` (gloo treats 0 as "no limit").
inline std::chrono::milliseconds remaining(generic::Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - generic::Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

/// HostTransport over one gloo context (see generic/transport.hpp); sizes are folded into the slots. Used
/// by one op at a time (the group's executor), like its scratch.
class GlooTransport {
public:
  using Region = std::unique_ptr<::gloo::transport::UnboundBuffer>;

  explicit GlooTransport(std::shared_ptr<::gloo::Context> context) : context_(std::move(context)) {}

  int rank() const { return context_->rank; }
  int size() const { return context_->size; }

  Region region(void* data, std::size_t nbytes) { return context_->createUnboundBuffer(data, nbytes); }

  void send(Region& r, int peer, std::uint64_t slot, std::size_t offset, std::size_t nbytes) {
    r->send(peer, sized(slot, nbytes), offset, nbytes);
  }
  void recv(Region& r, int peer, std::uint64_t slot, std::size_t offset, std::size_t nbytes) {
    r->recv(peer, sized(slot, nbytes), offset, nbytes);
  }
  void wait_send(Region& r, generic::Clock::time_point deadline) {
    if (!r->waitSend(remaining(deadline))) {
      throw Error("the operation was aborted");
    }
  }
  void wait_recv(Region& r, generic::Clock::time_point deadline) {
    if (!r->waitRecv(remaining(deadline))) {
      throw Error("the operation was aborted");
    }
  }

  /// The group's scratch memory, at least `bytes` (not zeroed; grown on demand, kept for later ops: the
  /// group's largest need so far).
  char* scratch(std::size_t bytes) {
    if (bytes > scratch_bytes_) {
      scratch_regions_.clear();
      scratch_.reset();
      scratch_ = std::make_unique_for_overwrite<char[]>(bytes);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

  /// A receive region over the whole scratch for `member`, made once per scratch.
  Region& scratch_region(int member) {
    if (scratch_regions_.empty()) {
      scratch_regions_.resize(static_cast<std::size_t>(size()));
    }
    Region& r = scratch_regions_[static_cast<std::size_t>(member)];
    if (!r) {
      r = context_->createUnboundBuffer(scratch_.get(), scratch_bytes_);
    }
    return r;
  }

private:
  std::shared_ptr<::gloo::Context> context_;
  std::unique_ptr<char[]> scratch_;
  std::size_t scratch_bytes_ = 0;
  std::vector<Region> scratch_regions_; // over scratch_, per member
};

static_assert(generic::HostTransport<GlooTransport>);

} // namespace dtensor::detail
