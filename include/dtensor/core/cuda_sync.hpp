#pragma once
// How dtensor's CUDA work is ordered, and the one place where it blocks the host.
//
// Device work is stream-ordered: a kernel, copy or fill is enqueued on its tensor's stream and the call
// returns at once. Where two streams meet, one waits for the other on the device (order_after: an event,
// no host wait). The host blocks (host_sync) only where it must: to read a value the device computed
// (a copy to host memory, item()), before a copy out of pinned host memory returns (the caller may reuse
// it), and where a host backend (MPI) touches device memory outside stream order. Every such wait is
// counted, by site:
//
//   const auto before = dtensor::host_sync_counts();
//   trainer.step(ids, targets, opt);
//   const auto syncs = dtensor::host_sync_counts() - before;   // syncs.total, syncs.by_site, to_string()
//
// DTENSOR_CUDA_SYNC_EACH_OP=1 (read once) makes every local op wait for its work before returning, as
// CUDA_LAUNCH_BLOCKING does for kernels: a device error then surfaces in the op that caused it. Those
// waits are counted too (site "<op> (DTENSOR_CUDA_SYNC_EACH_OP)").

#include "dtensor/core/config.hpp"
#include "dtensor/core/error.hpp"

#if DTENSOR_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

namespace dtensor {

/// The host's waits on CUDA streams: in all, and by the site that waited (a snapshot, or a difference of
/// two snapshots).
struct HostSyncCounts {
  std::uint64_t total = 0;
  std::map<std::string, std::uint64_t> by_site;

  /// "12 (Tensor::copy_from (to the host) 8, ...)".
  std::string to_string() const {
    std::string s = std::to_string(total) + " (";
    bool first = true;
    for (const auto& [site, n] : by_site) {
      s += (first ? "" : ", ") + site + " " + std::to_string(n);
      first = false;
    }
    return s + ")";
  }

  friend HostSyncCounts operator-(const HostSyncCounts& a, const HostSyncCounts& b) {
    HostSyncCounts d;
    d.total = a.total - b.total;
    for (const auto& [site, n] : a.by_site) {
      const auto it = b.by_site.find(site);
      const std::uint64_t m = n - (it == b.by_site.end() ? 0 : it->second);
      if (m != 0) {
        d.by_site.emplace(site, m);
      }
    }
    return d;
  }
};

namespace detail {

struct HostSyncLog {
  std::mutex mutex;
  HostSyncCounts counts;
};

inline HostSyncLog& host_sync_log() {
  static HostSyncLog log;
  return log;
}

/// The innermost HostSyncScope of this thread (nullptr when none).
inline const char*& host_sync_scope() noexcept {
  thread_local const char* scope = nullptr;
  return scope;
}

/// Names the op on whose behalf the host waits inside it ("clip_grad_norm: a gradient's local norm"), so the
/// counts say which op a generic wait (a copy to the host) served. Scopes nest; the innermost names.
class HostSyncScope {
public:
  explicit HostSyncScope(const char* op) noexcept : previous_(host_sync_scope()) { host_sync_scope() = op; }
  ~HostSyncScope() { host_sync_scope() = previous_; }
  HostSyncScope(const HostSyncScope&) = delete;
  HostSyncScope& operator=(const HostSyncScope&) = delete;

private:
  const char* previous_;
};

inline void count_host_sync(const std::string& site) {
  const char* scope = host_sync_scope();
  const std::string key = scope == nullptr ? site : std::string(scope) + ": " + site;
  HostSyncLog& log = host_sync_log();
  const std::lock_guard<std::mutex> lock(log.mutex);
  ++log.counts.total;
  ++log.counts.by_site[key];
}

/// DTENSOR_CUDA_SYNC_EACH_OP, read once: "1" waits after every local op (debugging), anything else not.
inline bool sync_each_op() {
  static const bool on = [] {
    const char* v = std::getenv("DTENSOR_CUDA_SYNC_EACH_OP");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

} // namespace detail

/// This process's waits on CUDA streams so far (all threads).
inline HostSyncCounts host_sync_counts() {
  detail::HostSyncLog& log = detail::host_sync_log();
  const std::lock_guard<std::mutex> lock(log.mutex);
  return log.counts;
}

#if DTENSOR_HAS_CUDA
namespace detail {

inline void check_sync_cuda(cudaError_t err, const char* call, const std::string& site) {
  if (err != cudaSuccess) [[unlikely]] {
    throw_error(std::string(call) + " failed (" + site + "): " + cudaGetErrorName(err) + ": " +
                cudaGetErrorString(err));
  }
}

/// Blocks the host until the work on `stream` is done (counted at `site`). The caller has made the
/// stream's device current where that matters.
inline void host_sync(cudaStream_t stream, const std::string& site) {
  count_host_sync(site);
  check_sync_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", site);
}

/// Makes `waiter` wait, on the device, for the work enqueued on `producer` so far (nothing when they are
/// one stream). The host does not wait.
inline void order_after(cudaStream_t waiter, cudaStream_t producer, const char* site) {
  if (waiter == producer) {
    return;
  }
  cudaEvent_t done = nullptr;
  check_sync_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags", site);
  const cudaError_t recorded = cudaEventRecord(done, producer);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(waiter, done, 0) : recorded;
  (void)cudaEventDestroy(done); // released once the wait is satisfied
  check_sync_cuda(recorded, "cudaEventRecord", site);
  check_sync_cuda(waited, "cudaStreamWaitEvent", site);
}

/// After a local op enqueued on `stream`: nothing, unless DTENSOR_CUDA_SYNC_EACH_OP=1.
inline void after_op(cudaStream_t stream, const char* op) {
  if (sync_each_op()) {
    host_sync(stream, std::string(op) + " (DTENSOR_CUDA_SYNC_EACH_OP)");
  }
}

/// Whether `p` is pinned (page-locked) host memory: an asynchronous copy out of it reads it later, so the
/// host must wait before its owner may reuse it. Pageable memory is staged before the copy call returns.
inline bool is_pinned_host(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError(); // older runtimes report unregistered memory as an error
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

} // namespace detail
#endif // DTENSOR_HAS_CUDA

} // namespace dtensor
