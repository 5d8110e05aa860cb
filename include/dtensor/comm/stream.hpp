#pragma once
// Which CUDA stream an op is ordered on.
//
//   dtensor::all_reduce(t, dtensor::ReduceOp::sum, group);     // on t's stream
//   {
//     dtensor::StreamGuard on(my_stream);                      // like `with torch.cuda.stream(s):`
//     dtensor::all_reduce(t, dtensor::ReduceOp::sum, group);   // on my_stream
//   }
//
// An op runs after the work already enqueued on its stream and, once waited on (synchronously: when the
// call returns), that stream waits for the op: memory released on it afterwards (cudaFreeAsync of a
// Tensor) is ordered after the op. Its stream is, first found: CommOptions::stream, the stream of the
// innermost StreamGuard of this thread, the stream of its buffers (a Tensor's own stream). When its buffers
// are on different streams, the op's stream waits for the others before the op and, once the op is waited
// on, the others wait for the op (events: the host does not wait, core/cuda_sync.hpp), so none of them can
// be written or released while the op uses it. Host backends ignore streams.

#include "dtensor/backends/backend.hpp"
#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/error.hpp"

#if DTENSOR_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dtensor {

namespace detail {

inline void*& current_stream_slot() noexcept {
  thread_local void* stream = nullptr;
  return stream;
}

} // namespace detail

/// Makes `stream` (a cudaStream_t) the stream of this thread's ops until it goes out of scope. Guards nest.
class StreamGuard {
public:
  explicit StreamGuard(void* stream) noexcept
      : previous_(std::exchange(detail::current_stream_slot(), stream)) {}
  ~StreamGuard() { detail::current_stream_slot() = previous_; }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

private:
  void* previous_;
};

/// The stream of this thread's innermost StreamGuard (nullptr when none).
inline void* current_stream() noexcept {
  return detail::current_stream_slot();
}

namespace detail {

/// `waiter` waits, on the device, for the work enqueued on `producer` (CUDA streams as void*).
inline void order_streams([[maybe_unused]] void* waiter, [[maybe_unused]] void* producer) {
#if DTENSOR_HAS_CUDA
  order_after(static_cast<cudaStream_t>(waiter), static_cast<cudaStream_t>(producer),
              "collective on several streams");
#endif
}

/// Completion of an op whose buffers were on several streams: waiting also makes each of the other streams
/// wait for the op's, so they may release or rewrite their buffers afterwards.
class StreamSyncedWork final : public WorkImpl {
public:
  StreamSyncedWork(std::shared_ptr<WorkImpl> inner, void* stream, std::vector<void*> others)
      : inner_(std::move(inner)), stream_(stream), others_(std::move(others)) {}
  bool is_completed() override { return inner_->is_completed(); }
  void wait() override {
    inner_->wait();
    for (void* other : others_) {
      order_streams(other, stream_);
    }
  }

private:
  std::shared_ptr<WorkImpl> inner_;
  void* stream_;
  std::vector<void*> others_;
};

/// Callables that pass an op's buffers to f one by one, without copying them (for choose_stream).
inline auto each_buffer(const BufferRef& a) {
  return [&a](auto&& f) { f(a); };
}
inline auto each_buffer(const BufferRef& a, const BufferRef& b) {
  return [&a, &b](auto&& f) {
    f(a);
    f(b);
  };
}
inline auto each_buffer(const BufferRef& a, std::span<const BufferRef> more) {
  return [&a, more](auto&& f) {
    f(a);
    for (const BufferRef& b : more) {
      f(b);
    }
  };
}

/// Sets opts.stream for an op whose buffers `each_buffer(f)` passes to f one by one (see the top of this
/// file). Returns the other streams its device buffers are on (the op's stream now waits for them; the
/// caller wraps the op's completion in a StreamSyncedWork when there are any).
template <class EachBuffer>
std::vector<void*> choose_stream(CommOptions& opts, EachBuffer&& each_buffer) {
  if (opts.stream == nullptr) {
    opts.stream = current_stream();
  }
  bool chosen = opts.stream != nullptr;
  std::vector<void*> others;
  each_buffer([&](const BufferRef& b) {
    if (!b.device.is_cuda()) {
      return;
    }
    if (!chosen) {
      opts.stream = b.stream;
      chosen = true;
    } else if (b.stream != opts.stream && std::find(others.begin(), others.end(), b.stream) == others.end()) {
      order_streams(opts.stream, b.stream);
      others.push_back(b.stream);
    }
  });
  return others;
}

} // namespace detail
} // namespace dtensor
