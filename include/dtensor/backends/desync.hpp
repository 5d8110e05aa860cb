#pragma once
// DebugLevel::detail's desync check (core/debug.hpp), kept apart from the Backend interface as c10d keeps
// its ProcessGroupWrapper apart: before any data moves, the members of a group compare what they are about
// to run, through the group's store.
//
//   detail::DesyncCheck desync;                                       // one per group: its op counter
//   if (detail::DesyncCheck::on(size))
//     desync.check(*store, rank, size, limit, where, {"all_reduce", DType::float32, 16, -1, 0});
//
// Protocol: for its group's collective #n, each member leaves "desync/<n>/<rank>" in the store -- the op,
// dtype, count (-1: the members' counts may differ), root, reduce op, the counts every member passes
// (all_gather, reduce_scatter), and what it sends to / receives from each member (`sends`, `recvs`:
// all_to_all's splits; gather's and scatter's one block, or the root's list) -- and reads the others'.
// A difference, or a send that does not match its receive, throws Error on every member naming the fields
// per member (the group stays usable: nothing was sent); a member that does not come within `limit` gives
// TimeoutError naming it and the last op it checked. Each member deletes its key of #n-2 once it read
// #n's. Costs a store set, a wait, a multi_get and a delete per collective.

#include "dtensor/backends/buffer.hpp"
#include "dtensor/core/debug.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor::detail {

/// What one member is about to run, as the desync check compares it.
struct CollectiveFields {
  const char* op = "";
  DType dtype = DType::uint8;
  /// Elements; -1 when the members' counts may differ.
  std::int64_t count = -1;
  int root = -1;
  /// The ReduceOp as an int; -1 for none.
  int reduce = -1;
  /// The counts every member passes (all_gather, reduce_scatter); empty for none.
  std::span<const std::int64_t> counts{};
  /// What this member sends to / receives from each member (or one entry for every member); empty: none.
  std::span<const std::int64_t> sends{};
  std::span<const std::int64_t> recvs{};
};

/// The element counts of `blocks` (gather's and scatter's lists, for CollectiveFields::sends / recvs).
inline std::vector<std::int64_t> block_counts(std::span<const BufferRef> blocks) {
  std::vector<std::int64_t> c;
  for (const BufferRef& b : blocks) {
    c.push_back(b.count);
  }
  return c;
}

/// One group's desync check (see the top of this file): its own count of the collectives it checked.
class DesyncCheck {
public:
  /// Whether a group of `size` members checks (DebugLevel::detail on a group of several members).
  static bool on(int size) { return debug_level() == DebugLevel::detail && size > 1; }

  /// Compares `mine` with what every member of the group left for the same collective (see the top of
  /// this file). `where` heads the messages ("<describe()>: <op>"); `limit` bounds the wait.
  void check(Store& store, int rank, int size, std::chrono::milliseconds limit, const std::string& where,
             const CollectiveFields& mine) {
    const std::int64_t n = seq_.fetch_add(1);
    // Fields, '|'-separated: op, dtype, count, root, reduce op, counts, sends, recvs.
    const std::string value =
        std::string(mine.op) + "|" + std::string(dtype_name(mine.dtype)) + "|" + std::to_string(mine.count) +
        "|" + std::to_string(mine.root) + "|" +
        (mine.reduce >= 0 ? std::string(to_string(static_cast<ReduceOp>(mine.reduce))) : "-") + "|" +
        (mine.counts.empty() ? "-" : format_list(mine.counts)) + "|" +
        (mine.sends.empty() ? "-" : format_list(mine.sends)) + "|" +
        (mine.recvs.empty() ? "-" : format_list(mine.recvs));
    store.set(key(n, rank), std::string_view(value));
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) {
      keys.push_back(key(n, r));
    }
    const std::string head = where + ": desync check of collective #" + std::to_string(n);
    try {
      store.wait(keys, limit);
    } catch (const std::exception&) {
      throw TimeoutError(head + ": not every member reached it within " + std::to_string(limit.count()) +
                         " ms; missing: " + missing(store, keys, n) +
                         "; this rank: " + describe_fields(value));
    }
    const auto values = store.multi_get(keys);
    if (n >= 2) {
      try { // every member read #n-2 before setting #n-1, which this rank has read
        store.delete_key(key(n - 2, rank));
      } catch (...) {
      }
    }
    const std::string differ = disagreement(values, size);
    if (differ.empty()) {
      return;
    }
    std::string list;
    for (int r = 0; r < size; ++r) {
      list += (r == 0 ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " +
              describe_fields(std::string(values[static_cast<std::size_t>(r)].begin(),
                                          values[static_cast<std::size_t>(r)].end()));
    }
    throw Error(head + ": the members disagree on the " + differ + " (nothing was sent): " + list);
  }

private:
  static std::string key(std::int64_t k, int r) {
    return "desync/" + std::to_string(k) + "/" + std::to_string(r);
  }

  /// "rank 1 (its last checked collective: #4 all_reduce (16 x float32, op sum))" for every member whose
  /// key of #n is missing.
  static std::string missing(Store& store, const std::vector<std::string>& keys, std::int64_t n) {
    std::string out;
    for (int r = 0; r < static_cast<int>(keys.size()); ++r) {
      if (!store.check({keys[static_cast<std::size_t>(r)]})) {
        std::optional<std::vector<char>> last;
        try {
          last = n > 0 ? store.try_get(key(n - 1, r)) : std::nullopt;
        } catch (...) {
        }
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) +
               (last ? " (its last checked collective: #" + std::to_string(n - 1) + " " +
                           describe_fields(std::string(last->begin(), last->end())) + ")"
                     : "");
      }
    }
    return out;
  }

  /// "" when the members agree; else what they disagree on: the names of the fields that differ ("count,
  /// counts"), or "sizes (rank i sends s to rank j, which expects r)".
  static std::string disagreement(const std::vector<std::vector<char>>& values, int size) {
    std::vector<std::vector<std::string>> fields;
    for (const auto& v : values) {
      fields.push_back(split_fields(std::string(v.begin(), v.end())));
    }
    static constexpr const char* names[] = {"op", "dtype", "count", "root", "reduce op", "counts"};
    std::string differ;
    for (std::size_t f = 0; f < 6; ++f) {
      for (const auto& other : fields) {
        if (other[f] != fields[0][f] && (f != 2 || (other[f] != "-1" && fields[0][f] != "-1"))) {
          differ += (differ.empty() ? "" : ", ") + std::string(names[f]);
          break;
        }
      }
    }
    // What member i sends member j must be what j expects from i (all_to_all, gather, scatter).
    if (differ.empty()) {
      for (int i = 0; i < size && differ.empty(); ++i) {
        for (int j = 0; j < size; ++j) {
          const auto s = parse_counts(fields[static_cast<std::size_t>(i)][6]);
          const auto r = parse_counts(fields[static_cast<std::size_t>(j)][7]);
          const auto sent = s.size() == 1                    ? s[0]
                            : j < static_cast<int>(s.size()) ? s[static_cast<std::size_t>(j)]
                                                             : -1;
          const auto got = r.size() == 1                    ? r[0]
                           : i < static_cast<int>(r.size()) ? r[static_cast<std::size_t>(i)]
                                                            : -1;
          if (sent >= 0 && got >= 0 && (s.size() != 1 || r.size() != 1) && sent != got) {
            differ = "sizes (rank " + std::to_string(i) + " sends " + std::to_string(sent) + " to rank " +
                     std::to_string(j) + ", which expects " + std::to_string(got) + ")";
            break;
          }
        }
      }
    }
    return differ;
  }

  static std::vector<std::string> split_fields(const std::string& v) {
    std::vector<std::string> f;
    std::size_t at = 0;
    for (;;) {
      const auto bar = v.find('|', at);
      f.push_back(v.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
      if (bar == std::string::npos) {
        break;
      }
      at = bar + 1;
    }
    f.resize(8, "-");
    return f;
  }

  /// "[1, 2, 3]" -> {1, 2, 3}; "-" -> {}.
  static std::vector<std::int64_t> parse_counts(const std::string& list) {
    std::vector<std::int64_t> out;
    std::int64_t v = 0;
    bool in_number = false;
    for (char c : list) {
      if (c >= '0' && c <= '9') {
        v = v * 10 + (c - '0');
        in_number = true;
      } else if (in_number) {
        out.push_back(v);
        v = 0;
        in_number = false;
      }
    }
    if (in_number) {
      out.push_back(v);
    }
    return out;
  }

  /// "all_reduce (16 x float32, op sum)" from the fields a member left.
  static std::string describe_fields(const std::string& value) {
    const auto f = split_fields(value);
    std::string s = f[0] + " (" + (f[2] != "-1" ? f[2] + " x " : "") + f[1];
    if (f[4] != "-") {
      s += ", op " + f[4];
    }
    if (f[3] != "-1") {
      s += ", root " + f[3];
    }
    if (f[5] != "-") {
      s += ", counts " + f[5];
    }
    if (f[6] != "-") {
      s += ", sends " + f[6];
    }
    if (f[7] != "-") {
      s += ", receives " + f[7];
    }
    return s + ")";
  }

  std::atomic<std::int64_t> seq_{0};
};

} // namespace dtensor::detail
