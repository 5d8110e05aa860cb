#pragma once
// What a program's tensors hold in host memory, by what the memory is for, live and at the peak
// (torch.cuda.memory_stats / max_memory_allocated for dtensor's host tensors, with categories as torch's
// memory snapshots give them):
//
//   dtensor::MemoryTracker mem;                       // from here, this thread's tensor allocations count
//   {
//     dtensor::MemoryCategoryScope c(dtensor::MemoryCategory::optimizer_state);
//     ...                                             // what is allocated here is optimizer state
//   }
//   dtensor::MemoryStats s = mem.stats();             // s.peak_total, s.at_peak[category], s.to_string()
//
// A MemoryTracker counts every host tensor block (core/host_memory.hpp) its thread allocates while it is
// the innermost live one, until the block is freed (on any thread, after the tracker too). A block counts
// in the category of the innermost MemoryCategoryScope of the allocating thread (MemoryCategory::other
// without one); set_memory_category moves a block to another category later (a gradient is computed as
// a temporary, then kept). The library sets the categories of what it owns: the trainers' parameters,
// gradients and optimizer state, FSDP's and DDP's communication buffers, and the forward and backward's
// activations. Bytes are what tensors asked for: the allocator's own overhead (up to 63 bytes of alignment
// per block, malloc's headers) and memory that is not a tensor's are not counted. Device memory is not
// counted.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>

#include "dtensor/core/thread_scope.hpp"

#include <sys/mman.h>

namespace dtensor {

/// What a block of memory is for.
enum class MemoryCategory : std::uint8_t {
  parameters,      ///< the model's weights, as the trainer keeps them (FSDP: the shards)
  gradients,       ///< the parameters' gradients kept for the optimizer
  optimizer_state, ///< e.g. AdamW's moments
  activations,     ///< what the forward saves for the backward, and the backward's temporaries
  communication,   ///< collectives' buffers: FSDP's gathered parameters and gradient buffers, DDP's buckets
  other,           ///< anything allocated outside a category scope
};
inline constexpr std::size_t kMemoryCategoryCount = 6;

constexpr std::string_view to_string(MemoryCategory c) noexcept {
  constexpr std::array<std::string_view, kMemoryCategoryCount> names{
      "parameters", "gradients", "optimizer_state", "activations", "communication", "other"};
  return names[static_cast<std::size_t>(c)];
}

/// A MemoryTracker's counts, in bytes.
struct MemoryStats {
  using ByCategory = std::array<std::int64_t, kMemoryCategoryCount>;
  ByCategory live{};    ///< held now, by category
  ByCategory peak{};    ///< each category's own peak
  ByCategory at_peak{}; ///< by category when the total was at its peak
  std::int64_t live_total = 0;
  std::int64_t peak_total = 0;
  std::int64_t allocations = 0; ///< blocks allocated while tracking

  std::int64_t operator[](MemoryCategory c) const noexcept { return live[static_cast<std::size_t>(c)]; }

  /// A table: one row per category (live, at the total's peak, its own peak), then the totals.
  std::string to_string() const {
    char line[128];
    std::snprintf(line, sizeof line, "%-16s %14s %14s %14s\n", "category", "live", "at peak", "own peak");
    std::string s = line;
    auto row = [&](std::string_view name, std::int64_t a, std::int64_t b, std::int64_t c) {
      std::snprintf(line, sizeof line, "%-16.*s %14lld %14lld %14lld\n", int(name.size()), name.data(),
                    static_cast<long long>(a), static_cast<long long>(b), static_cast<long long>(c));
      s += line;
    };
    for (std::size_t i = 0; i < kMemoryCategoryCount; ++i) {
      row(dtensor::to_string(MemoryCategory(i)), live[i], at_peak[i], peak[i]);
    }
    row("total", live_total, peak_total, peak_total);
    return s;
  }
};

namespace detail {

/// A tracker's counts, shared with the blocks it counted (they may outlive it).
class MemoryLedger {
public:
  void add(MemoryCategory c, std::int64_t bytes) {
    std::lock_guard lock(m_);
    const auto i = static_cast<std::size_t>(c);
    s_.live[i] += bytes;
    s_.live_total += bytes;
    ++s_.allocations;
    if (s_.live[i] > s_.peak[i]) {
      s_.peak[i] = s_.live[i];
    }
    if (s_.live_total > s_.peak_total) {
      s_.peak_total = s_.live_total;
      s_.at_peak = s_.live;
    }
  }
  void remove(MemoryCategory c, std::int64_t bytes) {
    std::lock_guard lock(m_);
    s_.live[static_cast<std::size_t>(c)] -= bytes;
    s_.live_total -= bytes;
  }
  void move(MemoryCategory from, MemoryCategory to, std::int64_t bytes) {
    std::lock_guard lock(m_);
    s_.live[static_cast<std::size_t>(from)] -= bytes;
    s_.live[static_cast<std::size_t>(to)] += bytes;
    if (s_.live[static_cast<std::size_t>(to)] > s_.peak[static_cast<std::size_t>(to)]) {
      s_.peak[static_cast<std::size_t>(to)] = s_.live[static_cast<std::size_t>(to)];
    }
  }
  MemoryStats stats() const {
    std::lock_guard lock(m_);
    return s_;
  }
  void reset_peak() {
    std::lock_guard lock(m_);
    s_.peak = s_.live;
    s_.at_peak = s_.live;
    s_.peak_total = s_.live_total;
  }

private:
  mutable std::mutex m_;
  MemoryStats s_;
};

} // namespace detail

/// While it is the innermost live one on its thread, this thread's host tensor allocations are counted in
/// it (see the top of this file). Scopes nest as blocks do; an inner tracker shadows the outer one.
class MemoryTracker : public detail::ThreadScope<MemoryTracker> {
public:
  MemoryTracker() : ledger_(std::make_shared<detail::MemoryLedger>()) {}

  MemoryStats stats() const { return ledger_->stats(); }
  /// Starts the peaks again from what is live now.
  void reset_peak() { ledger_->reset_peak(); }

  /// The ledger the innermost tracker of this thread counts in; null when none is live.
  static std::shared_ptr<detail::MemoryLedger> current_ledger() {
    MemoryTracker* t = innermost();
    return t != nullptr ? t->ledger_ : nullptr;
  }

private:
  std::shared_ptr<detail::MemoryLedger> ledger_;
};

/// While it lives, what this thread allocates counts as `category` (the innermost scope wins).
class MemoryCategoryScope : public detail::ThreadScope<MemoryCategoryScope> {
public:
  explicit MemoryCategoryScope(MemoryCategory category) noexcept : category_(category) {}

  /// The category of this thread's allocations now: the innermost scope's, else other.
  static MemoryCategory current() noexcept {
    const MemoryCategoryScope* s = innermost();
    return s != nullptr ? s->category_ : MemoryCategory::other;
  }

private:
  MemoryCategory category_;
};

namespace detail {

/// The deleter of a host block or a meta tensor's address range (core/host_memory.hpp): frees it, and
/// uncounts it from the ledger that counted it.
struct HostBlockDeleter {
  void* raw = nullptr;
  std::size_t mapped = 0; ///< > 0: raw is an address range of that many bytes (a meta tensor's), munmap'd
  std::shared_ptr<MemoryLedger> ledger;
  std::int64_t bytes = 0;
  MemoryCategory category = MemoryCategory::other;

  void operator()(void*) const {
    if (ledger != nullptr) {
      ledger->remove(category, bytes);
    }
    if (mapped > 0) {
      ::munmap(raw, mapped);
    } else {
      ::operator delete(raw);
    }
  }
};

/// Moves the host block `block` (counted by a tracker) to `category`; false for a block no tracker counts
/// (not a host block, or allocated while none was live).
inline bool set_block_category(const std::shared_ptr<void>& block, MemoryCategory category) {
  auto* d = std::get_deleter<HostBlockDeleter>(block);
  if (d == nullptr || d->ledger == nullptr || d->category == category) {
    return d != nullptr && d->ledger != nullptr;
  }
  d->ledger->move(d->category, category, d->bytes);
  d->category = category;
  return true;
}

} // namespace detail

/// Moves the memory of `t` (a Tensor, AnyTensor or DTensor: its local storage) to `category` in the tracker
/// that counts it; nothing when no tracker does.
template <class T>
void set_memory_category(const T& t, MemoryCategory category) {
  if constexpr (requires { t.to_local(); }) {
    detail::set_block_category(t.to_local().storage(), category);
  } else {
    detail::set_block_category(t.storage(), category);
  }
}

} // namespace dtensor
