#pragma once
// CommDebugMode: counts the communication of everything dtensor runs (collectives, point-to-point,
// redistribute, distribute_tensor, full_tensor), with its bytes, per op and group label.
//
//   dtensor::CommDebugMode comm;                 // active on this thread until it goes out of scope
//   auto y = x.redistribute<Replicate, Shard<1>>();
//   comm.count("all_gather");                    // 1
//   comm.count("all_gather", "dp");              // 1
//   std::puts(comm.to_string().c_str());         // a table: op, group, count, bytes
//
// Every op passes the ProcessGroup front end (comm/process_group.hpp), which records it here: the op's
// name (a redistribution's point-to-point exchange is "permute") and the group's label (a mesh axis group
// is labelled with its axis name, "dp"; a flattened one "dp*tp"; other groups ""). A mode is per thread
// (each in-process rank of run_ranks counts its own); modes nest, and every active one records. Bytes are
// what this rank receives from other ranks in the op, from the sizes passed to the backend (all_reduce
// counts the 2(n-1)/n of a ring, the least any all_reduce moves; reduce and reduce_scatter the n-1
// partial copies of the result).

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace dtensor {

class CommDebugMode {
public:
  struct Entry {
    std::int64_t count = 0;
    std::int64_t bytes = 0;
  };

  CommDebugMode() : parent_(active()) { active() = this; }
  ~CommDebugMode() { active() = parent_; }
  CommDebugMode(const CommDebugMode&) = delete;
  CommDebugMode& operator=(const CommDebugMode&) = delete;

  /// Number of ops called `op` (all axes, or the axes printed as `axes`, e.g. "tp" or "dp*tp").
  std::int64_t count(std::string_view op, std::string_view axes = {}) const { return sum(op, axes).count; }
  /// Bytes this rank received in ops called `op` (all axes or `axes`).
  std::int64_t bytes(std::string_view op, std::string_view axes = {}) const { return sum(op, axes).bytes; }
  /// Every communicating op.
  std::int64_t total_count() const { return sum({}, {}).count; }
  std::int64_t total_bytes() const { return sum({}, {}).bytes; }
  const std::map<std::pair<std::string, std::string>, Entry>& entries() const noexcept { return entries_; }
  void reset() { entries_.clear(); }

  /// One row per (op, axes): "op  axes  count  bytes".
  std::string to_string() const {
    std::string s;
    char line[160];
    std::snprintf(line, sizeof line, "%-16s %-10s %6s %12s\n", "op", "axes", "count", "bytes");
    s += line;
    for (const auto& [key, e] : entries_) {
      std::snprintf(line, sizeof line, "%-16s %-10s %6lld %12lld\n", key.first.c_str(), key.second.c_str(),
                    static_cast<long long>(e.count), static_cast<long long>(e.bytes));
      s += line;
    }
    return s;
  }

  /// Records one op in every mode active on this thread.
  static void record(std::string_view op, std::string_view axes, std::int64_t bytes) {
    for (CommDebugMode* m = active(); m != nullptr; m = m->parent_) {
      Entry& e = m->entries_[{std::string(op), std::string(axes)}];
      ++e.count;
      e.bytes += bytes;
    }
  }
  /// True when some mode is active on this thread (callers skip computing what they would record).
  static bool any_active() noexcept { return active() != nullptr; }

private:
  static CommDebugMode*& active() noexcept {
    thread_local CommDebugMode* mode = nullptr;
    return mode;
  }
  Entry sum(std::string_view op, std::string_view axes) const {
    Entry total;
    for (const auto& [key, e] : entries_) {
      if ((op.empty() || key.first == op) && (axes.empty() || key.second == axes)) {
        total.count += e.count;
        total.bytes += e.bytes;
      }
    }
    return total;
  }

  CommDebugMode* parent_;
  std::map<std::pair<std::string, std::string>, Entry> entries_;
};

} // namespace dtensor
