#pragma once
// Host memory for Tensor storage: 64-byte aligned blocks from operator new, and the one process-wide
// choice about how the C library keeps freed memory; the owners of meta tensors (no memory, counted bytes).
//
//   auto block = dtensor::detail::allocate_host(bytes);   // shared ownership, freed with the last owner
//
// A MemoryTracker live on the allocating thread counts the block until it is freed (core/memory_tracker.hpp).
//
// Why the malloc settings. Every op allocates its output, so a training step frees and allocates the same
// sizes again and again. With glibc's defaults a freed block above the mmap threshold (128 KiB, raised
// dynamically to the largest block freed so far) is unmapped, and free memory at the top of the heap above
// the trim threshold is returned to the kernel; the next step then page-faults its activations and
// gradients in again, each page zeroed by the kernel (a few % of a CPU training step). So on the first
// host allocation the library sets, once, with mallopt:
//   M_MMAP_THRESHOLD = 32 MiB   (glibc's largest: blocks up to that come from the heap and are reused)
//   M_TRIM_THRESHOLD = 1 GiB    (free memory at the top of the heap is kept up to that)
// A process then keeps what it freed for its next allocations instead of faulting it in again; its
// resident size stays at its peak (up to 1 GiB more, plus blocks above 32 MiB, which are still unmapped).
// A caching allocator of dtensor's own (size-bucketed free lists, as torch's CUDA allocator) was the
// alternative; tuning glibc keeps every block a plain malloc block, visible to heap counters and to the
// sanitizers' use-after-free checks, with no cache of ours to bound or to empty.
//
// The settings are left alone when DTENSOR_HOST_MALLOC_TUNING is false (0, false, no, off; see
// core/env.hpp), when the program's environment tunes glibc's malloc itself (GLIBC_TUNABLES naming a
// glibc.malloc tunable, or MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_), under
// AddressSanitizer or ThreadSanitizer (their allocator is in charge), and with a C library other than glibc.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "dtensor/core/env.hpp"
#include "dtensor/core/memory_tracker.hpp"

#include <sys/mman.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace dtensor::detail {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DTENSOR_DETAIL_SANITIZED_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DTENSOR_DETAIL_SANITIZED_ALLOCATOR 1
#endif
#endif
#ifndef DTENSOR_DETAIL_SANITIZED_ALLOCATOR
#define DTENSOR_DETAIL_SANITIZED_ALLOCATOR 0
#endif

/// Whether the process environment already tunes glibc's malloc (then dtensor does not).
inline bool malloc_tuned_by_environment() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) {
    return true;
  }
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) {
      return true;
    }
  }
  return false;
}

/// Applies the malloc settings at the top of this file unless they are left alone there; true when they
/// were applied. Idempotent; host_malloc_tuned() runs it once per process.
inline bool tune_host_malloc() {
#if defined(__GLIBC__) && !DTENSOR_DETAIL_SANITIZED_ALLOCATOR
  if (!env_flag("DTENSOR_HOST_MALLOC_TUNING", true) || malloc_tuned_by_environment()) {
    return false;
  }
  const bool mmap = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  const bool trim = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap && trim;
#else
  return false;
#endif
}

/// tune_host_malloc()'s result, computed on the first call (thread-safe).
inline bool host_malloc_tuned() {
  static const bool tuned = tune_host_malloc();
  return tuned;
}

/// Has this thread's innermost MemoryTracker, if any, count `nbytes` in the current category until `d` runs.
inline void count_block(HostBlockDeleter& d, std::size_t nbytes) {
  if (MemoryTracker::any_active()) {
    d.ledger = MemoryTracker::current_ledger();
    d.bytes = static_cast<std::int64_t>(nbytes);
    d.category = MemoryCategoryScope::current();
    d.ledger->add(d.category, d.bytes);
  }
}

/// 64-byte aligned host memory; zero bytes is allowed (a unique non-null pointer). Aligned by hand inside
/// a plain operator new block of 63 more bytes rather than with the aligned operator new, so that glibc
/// reuses a freed block for the next request of the same size (it does not for aligned requests, and a
/// fresh block pays first-touch page faults on all of its memory).
/// Counted by this thread's innermost MemoryTracker, if any (core/memory_tracker.hpp).
inline std::shared_ptr<void> allocate_host(std::size_t nbytes) {
  (void)host_malloc_tuned();
  constexpr std::size_t align = 64;
  HostBlockDeleter d;
  d.raw = ::operator new(nbytes + align - 1);
  void* p = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(d.raw) + align - 1) & ~(align - 1));
  count_block(d, nbytes);
  return std::shared_ptr<void>(p, std::move(d));
}

/// The address range of a meta tensor's `nbytes` (core/device.hpp): reserved, never backed by memory
/// (mmap'd PROT_NONE, MAP_NORESERVE: an access faults), so that its views and pieces have distinct
/// addresses and offsets as a host block's do. Counted as `nbytes` by this thread's innermost MemoryTracker,
/// as allocate_host counts a block. Throws std::bad_alloc when the address space is exhausted.
inline std::shared_ptr<void> allocate_meta(std::size_t nbytes) {
  HostBlockDeleter d;
  d.mapped = nbytes > 0 ? nbytes : 1;
  d.raw = ::mmap(nullptr, d.mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (d.raw == MAP_FAILED) {
    throw std::bad_alloc();
  }
  count_block(d, nbytes);
  void* p = d.raw;
  return std::shared_ptr<void>(p, std::move(d));
}

} // namespace dtensor::detail
