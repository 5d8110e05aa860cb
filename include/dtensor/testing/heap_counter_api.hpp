#pragma once
// The counters of heap_counter.hpp, for the translation units of a program other than the one that
// includes heap_counter.hpp (which replaces operator new and delete, once per program).
#include <atomic>
#include <cstdint>

namespace dtensor::testing::heap {

inline std::atomic<std::int64_t> g_live{0};
inline std::atomic<std::int64_t> g_peak{0};
inline std::atomic<std::int64_t> g_count{0};

inline std::int64_t live() noexcept {
  return g_live.load(std::memory_order_relaxed);
}
inline std::int64_t peak() noexcept {
  return g_peak.load(std::memory_order_relaxed);
}
inline std::int64_t count() noexcept {
  return g_count.load(std::memory_order_relaxed);
}
/// The peak restarts from the current live count.
inline void reset_peak() noexcept {
  g_peak.store(live(), std::memory_order_relaxed);
}

} // namespace dtensor::testing::heap
