#pragma once
// What the collectives sweeps share (bench_collectives on gloo, bench_collectives_mpi on MPI): the sample
// plan per size, the op filter, the buffer extent of a row, the op table's row type and --passes.

#include "../common/harness.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

namespace bench::sweep {

/// The sample plan for one size: batches of back-to-back calls for the small sizes.
inline SamplePlan plan_for(const Options& o, std::int64_t bytes) {
  SamplePlan p;
  p.warmup = o.smoke ? 0 : 1;
  // More samples where calls are cheap and the machine's jitter (ms) is large against them.
  p.samples = scaled(o, bytes >= (4 << 20) ? 5 : bytes <= (4 << 10) ? 15 : 9);
  p.batch = o.smoke ? 1 : (bytes <= (64 << 10) ? 20 : bytes <= (1 << 20) ? 4 : 1);
  return p;
}

/// Extra arguments name the ops to run (all of them when none is given).
inline bool selected(const Options& o, const std::string& name) {
  return o.args.empty() || std::find(o.args.begin(), o.args.end(), name) != o.args.end();
}

/// The buffer of one row: `elems` floats (the nominal size, at least one element per block for the
/// blocked ops) and one rank's block of them.
struct Extent {
  std::int64_t block;
  std::int64_t elems;
};
inline Extent extent_of(const std::string& name, std::int64_t nominal, int n) {
  const std::int64_t total = nominal / 4; // elements of nccl-tests' size
  const std::int64_t block = std::max<std::int64_t>(1, total / n);
  const bool blocked = name == "all_gather" || name == "reduce_scatter" || name == "all_to_all" ||
                       name == "gather" || name == "scatter";
  return {block, blocked ? block * n : std::max<std::int64_t>(1, total)};
}

struct Op {
  const char* name;
  double bus_factor; ///< busbw / algbw
};

/// Takes --passes K out of the options' arguments: the whole sweep K times (a row is the median of its
/// pass medians); 1 when absent or in a smoke run.
inline int take_passes(Options& o) {
  int passes = 1;
  for (auto it = o.args.begin(); it != o.args.end();) {
    if (*it == "--passes" && it + 1 != o.args.end()) {
      passes = std::max(1, std::stoi(*(it + 1)));
      it = o.args.erase(it, it + 2);
    } else {
      ++it;
    }
  }
  return o.smoke ? 1 : passes;
}

} // namespace bench::sweep
