#pragma once
// The fake backend: this process plays one rank of a group of any size, and nothing moves between
// processes. Every op completes at once with what this rank would receive if every member held what this
// one holds: ranks of one role behave alike, the premise of a dry run (torch's FakeProcessGroup, with data).
//
//   auto world = dtensor::fake_world(3, 16384);              // comm/init.hpp: rank 3 of 16,384, alone
//   auto mesh = dtensor::init_device_mesh<Mesh>(world, 8);   // axis groups made here, nothing exchanged
//   dtensor::CommDebugMode comm;                             // ... one training step ...
//   std::puts(comm.to_string().c_str());                     // what rank 3 sends and receives, per axis
//
// A program dry-runs unchanged with DTENSOR_BACKEND=fake RANK=r WORLD_SIZE=n (init_process_group then
// makes fake_world(r, n): no store, no launcher). What rank r communicates is exact as long as its control
// flow depends only on sizes and on its own data (the layouts and plans of a training step do);
// CommDebugMode, CommWaitTimer and the flight recorder see every op at the ProcessGroup front as usual.
//
// What each op leaves in this rank's buffers (x: its buffer, n: the group's size):
//   all_reduce      sum: x added n times (by doubling); product: x multiplied n times; avg, max, min: x
//   reduce          the same on the root; elsewhere unchanged
//   broadcast       unchanged (the root's buffer is this one)
//   all_gather      every block from x (a block of another size: x repeated, or cut)
//   reduce_scatter  this member's block of the input, reduced n times as all_reduce does
//   all_to_all      output block i from input block i (what this rank sends, it gets back)
//   gather          on the root every block from x; scatter: the root's own block, elsewhere unchanged
//   send / recv     a recv takes the data of the batch's next unused send of the same size, both host or
//                   both meta (a shift exchange: what this rank sends on, it receives), else is left
//                   unchanged
//   barrier         nothing (monitored_barrier too: every member arrives)
// An op on meta buffers (core/device.hpp: a shape, no data) moves nothing and is recorded as any other: a
// dry run of meta tensors. An op with a meta buffer among its host ones leaves its host buffers as they are.
// new_group makes its group here. split needs every member's colour and key, which the other members are
// not here to tell: Backend::split(color, key, every), as init_device_mesh calls it; the exchanging form
// throws. Buffers are host memory (the data is copied on the host) or meta; in a program built with device
// emulation (DTENSOR_EMULATE_DEVICE, core/config.hpp: tests), CUDA memory of the emulated device too, which
// each op moves as one emulated kernel on the buffer's stream (NCCL's collectives are kernels too).

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/generic/reduce.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/timeout.hpp"
#if DTENSOR_EMULATE_DEVICE
#include "dtensor/local/copy.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

namespace detail {

/// Whether one of `b...` is meta: the op then moves nothing.
template <class... B>
bool any_meta(const B&... b) noexcept {
  return (b.device.is_meta() || ...);
}

/// bytes(p) of one buffer.
inline std::byte* buffer_bytes(const BufferRef& b, std::int64_t at = 0) {
  return static_cast<std::byte*>(b.data) + static_cast<std::size_t>(at) * dtype_size(b.dtype);
}

/// dst's `count` elements from src's `have` elements, repeated (or cut) to fit; zeros when src is empty.
inline void fill_repeating(std::byte* dst, std::int64_t count, const std::byte* src, std::int64_t have,
                           std::size_t elem) {
  const std::size_t want = static_cast<std::size_t>(count) * elem;
  const std::size_t got = static_cast<std::size_t>(have) * elem;
  if (want == 0) {
    return;
  }
  if (got == 0) {
    std::memset(dst, 0, want);
    return;
  }
  for (std::size_t at = 0; at < want; at += got) {
    std::memmove(dst + at, src, std::min(got, want - at));
  }
}

/// data = data op data op ... (n operands), by doubling: log2(n) passes. avg, max, min, band and bor leave
/// data.
inline void reduce_copies(void* data, std::int64_t count, DType dtype, ReduceOp op, int n) {
  if (n <= 1 || count == 0 || op == ReduceOp::avg || op == ReduceOp::max || op == ReduceOp::min ||
      op == ReduceOp::band || op == ReduceOp::bor) {
    return;
  }
  const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
  const ReduceFn f = reduce_function(dtype, op);
  std::vector<std::byte> power(bytes); // data op-ed 2^k times
  std::vector<std::byte> acc;          // the powers taken so far (empty: none)
  std::memcpy(power.data(), data, bytes);
  for (int m = n;; m >>= 1) {
    if (m & 1) {
      if (acc.empty()) {
        acc = power;
      } else {
        f(acc.data(), acc.data(), power.data(), static_cast<std::size_t>(count));
      }
    }
    if (m <= 1) {
      break;
    }
    f(power.data(), power.data(), power.data(), static_cast<std::size_t>(count));
  }
  std::memcpy(data, acc.data(), bytes);
}

} // namespace detail

/// One member of a fake group (see the top of this file).
class FakeBackend final : public Backend {
public:
  /// Member `rank` of the group whose members are the global ranks `global`.
  FakeBackend(std::vector<int> global, int rank, std::chrono::milliseconds timeout = kDefaultOpTimeout)
      : Backend(timeout), global_(std::move(global)), rank_(rank) {
    DTENSOR_CHECK(!global_.empty() && rank_ >= 0 && rank_ < static_cast<int>(global_.size()),
                  "fake backend: rank " + std::to_string(rank_) + " is out of range for a group of " +
                      std::to_string(global_.size()));
  }

  std::string_view name() const noexcept override { return "fake"; }
  bool dry_run() const noexcept override { return true; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(global_.size()); }
  std::span<const int> global_ranks() const noexcept override { return global_; }
  /// "rank 1 (global 2) of fake group [0,2]"; a group of more than 16: its first and last members.
  std::string describe() const override {
    const std::string members = global_.size() <= 16 ? detail::format_list(global_)
                                                     : "[" + std::to_string(global_.front()) + ",...," +
                                                           std::to_string(global_.back()) + "] (" +
                                                           std::to_string(global_.size()) + " ranks)";
    return "rank " + std::to_string(rank_) + " (global " +
           std::to_string(global_[static_cast<std::size_t>(rank_)]) + ") of fake group " + members;
  }

protected:
  WorkPtr do_all_reduce(BufferRef buf, ReduceOp op, const CommOptions&) override {
    if (detail::any_meta(buf)) {
      return done();
    }
    move_data(buf, [&] { detail::reduce_copies(buf.data, buf.count, buf.dtype, op, size()); });
    return done();
  }
  WorkPtr do_reduce(BufferRef buf, int root, ReduceOp op, const CommOptions&) override {
    if (rank_ == root && !detail::any_meta(buf)) {
      move_data(buf, [&] { detail::reduce_copies(buf.data, buf.count, buf.dtype, op, size()); });
    }
    return done();
  }
  WorkPtr do_broadcast(BufferRef, int, const CommOptions&) override { return done(); }
  WorkPtr do_all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                        std::span<const std::int64_t> displs, const CommOptions&) override {
    if (detail::any_meta(in, out)) {
      return done();
    }
    const std::size_t elem = dtype_size(in.dtype);
    // This member's own block first: `in` may be that block of `out` (in place).
    const std::int64_t mine = displs[static_cast<std::size_t>(rank_)];
    move_data(out, [&] {
      std::memmove(detail::buffer_bytes(out, mine), in.data, static_cast<std::size_t>(in.count) * elem);
      for (std::size_t i = 0; i < counts.size(); ++i) {
        if (static_cast<int>(i) != rank_) {
          detail::fill_repeating(detail::buffer_bytes(out, displs[i]), counts[i],
                                 detail::buffer_bytes(out, mine), in.count, elem);
        }
      }
    });
    return done();
  }
  WorkPtr do_reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                            std::span<const std::int64_t> displs, ReduceOp op, const CommOptions&) override {
    if (detail::any_meta(in, out)) {
      return done();
    }
    const auto me = static_cast<std::size_t>(rank_);
    move_data(out, [&] {
      std::memmove(out.data, detail::buffer_bytes(in, displs[me]),
                   static_cast<std::size_t>(counts[me]) * dtype_size(in.dtype));
      detail::reduce_copies(out.data, out.count, out.dtype, op, size());
    });
    return done();
  }
  WorkPtr do_all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, BufferRef out,
                        std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                        const CommOptions&) override {
    if (detail::any_meta(in, out)) {
      return done();
    }
    move_data(out, [&] {
      for (std::size_t i = 0; i < send_counts.size(); ++i) {
        detail::fill_repeating(detail::buffer_bytes(out, recv_displs[i]), recv_counts[i],
                               detail::buffer_bytes(in, send_displs[i]), send_counts[i],
                               dtype_size(in.dtype));
      }
    });
    return done();
  }
  WorkPtr do_gather(BufferRef in, std::span<const BufferRef> blocks, int root, const CommOptions&) override {
    if (rank_ == root && !detail::any_meta(in)) {
      move_data(in, [&] {
        for (const BufferRef& b : blocks) {
          if (detail::any_meta(b)) {
            continue;
          }
          detail::fill_repeating(detail::buffer_bytes(b), b.count, detail::buffer_bytes(in), in.count,
                                 dtype_size(in.dtype));
        }
      });
    }
    return done();
  }
  WorkPtr do_scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                     const CommOptions&) override {
    if (rank_ == root && !detail::any_meta(out, blocks[static_cast<std::size_t>(root)])) {
      move_data(out,
                [&] { std::memmove(out.data, blocks[static_cast<std::size_t>(root)].data, out.nbytes()); });
    }
    return done();
  }
  WorkPtr do_barrier(const CommOptions&) override { return done(); }
  void do_monitored_barrier(std::int64_t, std::chrono::milliseconds) override {} // every member is here
  WorkPtr do_p2p(std::span<const P2PRequest> requests, const CommOptions&) override {
    std::vector<bool> used(requests.size(), false);
    for (const P2PRequest& r : requests) {
      if (r.kind != P2PRequest::Kind::recv) {
        continue;
      }
      for (std::size_t s = 0; s < requests.size(); ++s) {
        const P2PRequest& send = requests[s];
        if (!used[s] && send.kind == P2PRequest::Kind::send && send.buffer.nbytes() == r.buffer.nbytes() &&
            send.buffer.device.is_meta() == r.buffer.device.is_meta()) {
          if (!detail::any_meta(r.buffer)) {
            move_data(r.buffer, [&] { std::memmove(r.buffer.data, send.buffer.data, r.buffer.nbytes()); });
          }
          used[s] = true;
          break;
        }
      }
    }
    return done();
  }
  std::shared_ptr<Backend> do_new_group(std::vector<int> global, int rank) override {
    return std::make_shared<FakeBackend>(std::move(global), rank, timeout());
  }
  std::shared_ptr<Backend> do_split(const SplitGroup& g) override {
    return g.rank < 0 ? nullptr : std::make_shared<FakeBackend>(g.global_ranks, g.rank, timeout());
  }
  std::vector<SplitEntry> exchange_split(const SplitGroup&, const std::string& what) override {
    throw Error(what +
                ": the fake backend cannot learn the other members' colours and keys (they are not "
                "running); call split(color, key, every) with every member's, as init_device_mesh does");
  }
  void check_memory(const char* op, const BufferRef& b, const char* what) const override {
    DTENSOR_CHECK(DTENSOR_EMULATE_DEVICE || !b.device.is_cuda(),
                  where(op) + ": the " + what + " is on " + b.device.to_string() +
                      "; the fake backend copies data on the host: pass host memory (or meta tensors)");
  }

private:
  static WorkPtr done() { return std::make_shared<detail::DoneWork>(); }

  /// Runs `move`, an op's data movement, where it may touch the bytes of `b` and of the op's other buffers:
  /// on the host; for a CUDA buffer of the emulated device, as one kernel on b's stream (see the top).
  template <class F>
  static void move_data(const BufferRef& b, const F& move) {
#if DTENSOR_EMULATE_DEVICE
    if (b.device.is_cuda()) {
      struct Kernel {
        struct {
          std::int64_t count;
        } layout;
        const F* move;
        void operator()(std::int64_t) const { (*move)(); }
      };
      local::launch_kernel(Kernel{{1}, &move}, 1, b.device, static_cast<cudaStream_t>(b.stream),
                           "fake backend");
      return;
    }
#else
    (void)b;
#endif
    move();
  }

  std::vector<int> global_;
  int rank_;
};

namespace detail {

/// Rank `rank` of the group of world ranks 0..size-1, played alone.
inline std::shared_ptr<FakeBackend> make_fake_backend(int rank, int size, std::chrono::milliseconds timeout) {
  DTENSOR_CHECK(size >= 1 && rank >= 0 && rank < size,
                "fake backend: rank " + std::to_string(rank) + " of a world of " + std::to_string(size));
  std::vector<int> global(static_cast<std::size_t>(size));
  std::iota(global.begin(), global.end(), 0);
  return std::make_shared<FakeBackend>(std::move(global), rank, timeout);
}

/// Registered so that DTENSOR_BACKEND=fake names it; "auto" never picks it, and it needs no store.
inline const bool fake_backend_registered = [] {
  register_backend(
      "fake",
      [](std::shared_ptr<Store>, int rank, int size, const BackendOptions& o) -> std::shared_ptr<Backend> {
        return make_fake_backend(rank, size, o.timeout);
      },
      BackendTraits{.usable = [] { return false; }, .priority = -1, .meets_peers = false});
  return true;
}();

} // namespace detail

} // namespace dtensor
