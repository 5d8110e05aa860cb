#pragma once
// Counts heap memory: replaces the global operator new/delete (every form, aligned ones included: Tensor
// host storage uses the plain ::operator new, aligned by hand) with malloc-based versions that keep the live
// byte count, its peak since the last reset, and the number of allocations.
//
// Include in exactly one translation unit of a program (the benchmarks; examples/09_gpt's --memory-table),
// not under a sanitizer, whose allocator must stay in charge; glibc only. Sizes are malloc_usable_size
// (what the allocator really reserved, within a few bytes of the request), so allocation and release cancel
// exactly. Other translation units read the counters through heap_counter_api.hpp.
//
//   dtensor::testing::heap::reset_peak();
//   auto before = dtensor::testing::heap::live();
//   work();
//   auto extra = dtensor::testing::heap::peak() - before;

#include "dtensor/testing/heap_counter_api.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include <malloc.h>

namespace dtensor::testing::heap {

inline void note_alloc(void* p) noexcept {
  const auto n = static_cast<std::int64_t>(malloc_usable_size(p));
  const std::int64_t now = g_live.fetch_add(n, std::memory_order_relaxed) + n;
  g_count.fetch_add(1, std::memory_order_relaxed);
  std::int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

inline void note_free(void* p) noexcept {
  if (p != nullptr) {
    g_live.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)), std::memory_order_relaxed);
  }
}

inline void* allocate(std::size_t n, std::size_t align, bool nothrow) {
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n ? n : 1);
  } else {
    p = std::aligned_alloc(align, ((n ? n : 1) + align - 1) / align * align);
  }
  if (p == nullptr) {
    if (nothrow) {
      return nullptr;
    }
    throw std::bad_alloc();
  }
  note_alloc(p);
  return p;
}

inline void release(void* p) noexcept {
  note_free(p);
  std::free(p);
}

} // namespace dtensor::testing::heap

// NOLINTBEGIN: the replaceable global allocation functions.
void* operator new(std::size_t n) {
  return dtensor::testing::heap::allocate(n, 0, false);
}
void* operator new[](std::size_t n) {
  return dtensor::testing::heap::allocate(n, 0, false);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return dtensor::testing::heap::allocate(n, 0, true);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return dtensor::testing::heap::allocate(n, 0, true);
}
void* operator new(std::size_t n, std::align_val_t a) {
  return dtensor::testing::heap::allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return dtensor::testing::heap::allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return dtensor::testing::heap::allocate(n, static_cast<std::size_t>(a), true);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return dtensor::testing::heap::allocate(n, static_cast<std::size_t>(a), true);
}
void operator delete(void* p) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete(void* p, std::size_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  dtensor::testing::heap::release(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  dtensor::testing::heap::release(p);
}
// NOLINTEND
