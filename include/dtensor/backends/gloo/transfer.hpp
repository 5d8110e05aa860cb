#pragma once
// How the gloo backend moves bytes between members outside gloo's own collectives: the tags ("slots") of
// its messages, and GlooTransport, the generic layer's HostTransport (backends/generic/transport.hpp)
// over a gloo context's unbound buffers, with the group's scratch memory.
//
// Slots are 64-bit. Three spaces, disjoint by their top bits:
//  - gloo's collectives (all_reduce, reduce, broadcast, even all_gather, barrier) use gloo's own prefixes
//    0x01..0x08 with the op's 32-bit tag (op_tag: 12 bits of the group's op sequence number and a 20-bit
//    fingerprint of what must agree across members: the op, element count, dtype, root, reduce op);
//  - dtensor's collectives over point-to-point (generic/) use 0x40 and the same op tag (collective_slot),
//    with the message size folded into the low 24 bits (sized);
//  - point-to-point sets the top bit, then a direction bit, 23 bits of user tag, 20 bits of sequence number
//    per (peer, tag, direction) and a 19-bit fingerprint of the message's size and dtype (p2p_slot), so
//    successive sends a->b with one tag match successive receives in order.
// Members that disagree on a fingerprinted value post different slots, so their messages never match:
// every member times out on that op (and says what each member ran, context.hpp) instead of gloo aborting
// the process on a message longer than the receive (pair.cc: "op.preamble.length <= op.nbytes"), filling
// a longer receive partly, or mixing dtypes of one size. A fingerprint collision (2^-20 for an op, 2^-19
// for a message) lets such a mismatch through as before; DTENSOR_DEBUG=detail checks every field.

#include "dtensor/backends/generic/transport.hpp"
#include "dtensor/core/error.hpp"

#include <gloo/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <typeinfo>
#include <vector>

namespace dtensor::detail {

// gloo::transport::tcp::Pair::tryRecv, declared by its exported symbol for the reason context.hpp gives
// for tcp::Context::signalException (tcp/pair.h includes a header Debian does not install); weak, and
// called only on a pair whose dynamic type is tcp::Pair (whose first base is transport::Pair).
bool gloo_tcp_pair_try_recv(
    void* tcp_pair, ::gloo::transport::UnboundBuffer* buffer, std::uint64_t slot, std::size_t offset,
    std::size_t nbytes) __asm__("_ZN4gloo9transport3tcp4Pair7tryRecvEPNS0_13UnboundBufferEmmm")
    __attribute__((weak));

/// A slot no message uses: top byte 0x20 is in none of the three spaces above.
inline constexpr std::uint64_t quiesce_slot = std::uint64_t{0x20} << 56;

/// Returns once gloo's transport thread is outside every pair's critical section of `context`.
///
/// An op whose buffers a failing pair signals wakes at the first signal, while the transport thread is
/// still signalling the op's other buffers under the pair's lock. gloo's buffer destructor does wait for
/// that thread, but through a relaxed reference count (ShareableNonOwningPtr), which orders nothing in
/// the memory model (TSan reports the destruction racing with the signal). A failed op calls this before
/// its buffers are destroyed: taking each pair's lock once orders the whole signalling before the
/// destruction. tryRecv on a slot nobody uses takes the lock and changes nothing (it throws the pair's
/// failure, if any, after taking it).
inline void quiesce_transport(::gloo::Context& context) {
  if (&gloo_tcp_pair_try_recv == nullptr) {
    return;
  }
  std::unique_ptr<::gloo::transport::UnboundBuffer> probe;
  for (int i = 0; i < context.size; ++i) {
    if (i == context.rank) {
      continue;
    }
    auto& pair = context.getPair(i);
    if (!pair || std::strcmp(typeid(*pair).name(), "N4gloo9transport3tcp4PairE") != 0) {
      continue;
    }
    try {
      if (!probe) {
        probe = context.createUnboundBuffer(nullptr, 0);
      }
      gloo_tcp_pair_try_recv(static_cast<void*>(pair.get()), probe.get(), quiesce_slot, 0, 0);
    } catch (...) { // the pair's own failure: the lock was taken before it was thrown
    }
  }
}

/// Calls quiesce_transport when it is destroyed by an exception: declared after an op's gloo buffers (or
/// the options that own them), so it runs before they are destroyed.
class QuiesceOnThrow {
public:
  explicit QuiesceOnThrow(::gloo::Context& context) : context_(context) {}
  QuiesceOnThrow(const QuiesceOnThrow&) = delete;
  QuiesceOnThrow& operator=(const QuiesceOnThrow&) = delete;
  ~QuiesceOnThrow() {
    if (std::uncaught_exceptions() > exceptions_) {
      quiesce_transport(context_);
    }
  }

private:
  ::gloo::Context& context_;
  int exceptions_ = std::uncaught_exceptions();
};

/// A 64-bit mix of `v` (splitmix64's finalizer): every input bit moves every output bit.
constexpr std::uint64_t mix64(std::uint64_t v) {
  v ^= v >> 30;
  v *= 0xbf58476d1ce4e5b9ULL;
  v ^= v >> 27;
  v *= 0x94d049bb133111ebULL;
  return v ^ (v >> 31);
}

/// The 32-bit tag of a group's op number `seq` whose agreed fields hash to `fingerprint`: the low 12 bits
/// of seq (ops of one group more than 4096 apart are never in flight together) and 20 bits of fingerprint.
constexpr std::uint32_t op_tag(std::uint32_t seq, std::uint64_t fingerprint) {
  return ((seq & 0xFFFu) << 20) | static_cast<std::uint32_t>(mix64(fingerprint) & 0xFFFFFu);
}

/// The slot of dtensor's collective whose op tag is `tag` (top byte 0x40).
constexpr std::uint64_t collective_slot(std::uint32_t tag) {
  return (std::uint64_t{0x40} << 56) | (std::uint64_t{tag} << 24);
}

/// The slot of a point-to-point message: `ascending` (sender's rank < receiver's), the user tag (< 2^23),
/// the sequence number of that (peer, tag, direction), and the message's size and dtype (fingerprinted).
constexpr std::uint64_t p2p_slot(bool ascending, int tag, std::uint32_t seq, std::size_t nbytes, int dtype) {
  const std::uint64_t fp =
      mix64((std::uint64_t{nbytes} << 8) ^ static_cast<std::uint64_t>(dtype) ^ 0x5bd1e995u);
  return (std::uint64_t{1} << 63) | (std::uint64_t{ascending} << 62) |
         (static_cast<std::uint64_t>(tag) << 39) | (std::uint64_t{seq & 0xFFFFFu} << 19) | (fp & 0x7FFFF);
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
    QuiesceOnThrow quiesce(*context_);
    if (!r->waitSend(remaining(deadline))) {
      throw Error("the operation was aborted");
    }
  }
  void wait_recv(Region& r, generic::Clock::time_point deadline) {
    QuiesceOnThrow quiesce(*context_);
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
