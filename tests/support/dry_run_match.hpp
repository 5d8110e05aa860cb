#pragma once
// The check that a dry run is the real run (tests/nn/test_vision.cpp, tests/train/test_trainer.cpp): the
// same steps run for real on every rank of a world, then each rank alone on the fake backend with meta
// tensors (dtensor::dry_run); each rank's tensor peak, communication table and flops must be the same.
// Include after <catch2/catch.hpp>.
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/core/device.hpp>
#include <dtensor/core/flop_counter.hpp>
#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/plan/dry_run.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace dtensor::testing {

/// steps(world, device) on `ranks` ranks with CPU tensors, then as each rank's dry run; checks that they
/// match (see the top of the file) and returns the dry runs, rank by rank, for the caller's own checks.
template <class Steps>
std::vector<DryRun> check_dry_run_matches(int ranks, Steps steps) {
  struct Measured {
    std::int64_t peak = 0;
    std::string comm;
    double flops = 0;
  };
  std::vector<Measured> real(static_cast<std::size_t>(ranks));
  std::mutex m;
  run_ranks(ranks, [&](ProcessGroup& world) {
    CommDebugMode comm;
    MemoryTracker memory;
    FlopCounter flops;
    steps(world, Device::cpu());
    std::lock_guard lock(m);
    real[std::size_t(world.rank())] = {memory.stats().peak_total, comm.to_string(), flops.flops()};
  });
  std::vector<DryRun> dry;
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    dry.push_back(dry_run({.rank = r, .world_size = ranks},
                          [&](DryRunContext& ctx) { steps(ctx.world(), ctx.device()); }));
    const DryRun& d = dry.back();
    CHECK(d.memory.peak_total == real[std::size_t(r)].peak);
    CHECK(d.comm_table == real[std::size_t(r)].comm);
    CHECK(d.flops == real[std::size_t(r)].flops);
    CHECK(d.flops > 0);
  }
  return dry;
}

} // namespace dtensor::testing
