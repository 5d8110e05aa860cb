#pragma once
// CheckMemo: the checks that walk every rank of the mesh (flatten's and unflatten's regrouping, GQA
// attention's head groups) run once per thread for each set of sizes, not once per call. Each is a pure
// function of the sizes (its placements are its caller's type), and at 16,384 ranks the walks were most of
// a dry run's time (plan/dry_run.hpp).
//
//   thread_local detail::CheckMemo memo;                 // in the template that checks: one per placements
//   const std::string key = detail::check_key(global, mesh.sizes());
//   if (!memo.passed(key)) { check_every_rank(...); memo.pass(key); }

#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

namespace dtensor::detail {

class CheckMemo {
public:
  /// Whether the check passed before for `key` on this thread.
  bool passed(const std::string& key) const { return seen_.count(key) != 0; }
  /// Records that it passed for `key` (forgetting every key once 4,096 are kept).
  void pass(std::string key) {
    if (seen_.size() >= 4096) {
      seen_.clear();
    }
    seen_.insert(std::move(key));
  }

private:
  std::unordered_set<std::string> seen_;
};

/// The key of a check's sizes: integers, or ranges of them (Extents, MeshSizes), each range ended by ';'.
template <class... V>
std::string check_key(const V&... values) {
  std::string key;
  const auto add = [&](const auto& v) {
    if constexpr (std::is_integral_v<std::remove_cvref_t<decltype(v)>>) {
      key += std::to_string(v) + ';';
    } else {
      for (const auto& x : v) {
        key += std::to_string(x) + ',';
      }
      key += ';';
    }
  };
  (add(values), ...);
  return key;
}

} // namespace dtensor::detail
