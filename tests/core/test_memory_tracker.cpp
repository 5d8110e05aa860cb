// MemoryTracker (core/memory_tracker.hpp): what it counts of the host tensors its thread allocates, by
// category, live and at the peak; blocks moved between categories; blocks that outlive the tracker; other
// threads and nested trackers; meta tensors, counted as the host tensors they stand for.
#include <catch2/catch.hpp>

#include <dtensor/core/any_tensor.hpp>
#include <dtensor/core/memory_tracker.hpp>
#include <dtensor/core/tensor.hpp>

#include <cstdint>
#include <optional>
#include <thread>

using namespace dtensor;

namespace {

std::int64_t live(const MemoryStats& s, MemoryCategory c) {
  return s.live[std::size_t(c)];
}

} // namespace

TEST_CASE("MemoryTracker counts this thread's tensors by category, live and at the peak", "[core][memory]") {
  const Tensor<float, 1> before({100}); // allocated before the tracker: never counted
  MemoryTracker memory;
  CHECK(memory.stats().live_total == 0);
  std::optional<Tensor<float, 1>> a, b;
  a.emplace(Tensor<float, 1>({10}));
  {
    const MemoryCategoryScope params(MemoryCategory::parameters);
    b.emplace(Tensor<float, 1>({25}));
    {
      const MemoryCategoryScope inner(MemoryCategory::optimizer_state); // the innermost wins
      const Tensor<double, 2> state({3, 4});
      MemoryStats s = memory.stats();
      CHECK(live(s, MemoryCategory::other) == 40);
      CHECK(live(s, MemoryCategory::parameters) == 100);
      CHECK(live(s, MemoryCategory::optimizer_state) == 96);
      CHECK(s.live_total == 236);
      CHECK(s.allocations == 3);
    }
    CHECK(MemoryCategoryScope::current() == MemoryCategory::parameters);
  }
  CHECK(MemoryCategoryScope::current() == MemoryCategory::other);
  MemoryStats s = memory.stats();
  CHECK(s.live_total == 140);
  CHECK(s.peak_total == 236);
  CHECK(s.at_peak[std::size_t(MemoryCategory::optimizer_state)] == 96);
  CHECK(s.at_peak[std::size_t(MemoryCategory::parameters)] == 100);
  CHECK(s.peak[std::size_t(MemoryCategory::optimizer_state)] == 96);
  CHECK(live(s, MemoryCategory::optimizer_state) == 0);

  // A block changes category: a gradient computed as a temporary, then kept.
  const MemoryCategoryScope act(MemoryCategory::activations);
  const auto grad = AnyTensor::empty(DType::float32, Extents{8}, Device::cpu());
  CHECK(live(memory.stats(), MemoryCategory::activations) == 32);
  set_memory_category(grad, MemoryCategory::gradients);
  s = memory.stats();
  CHECK(live(s, MemoryCategory::activations) == 0);
  CHECK(live(s, MemoryCategory::gradients) == 32);
  CHECK(s.peak[std::size_t(MemoryCategory::gradients)] == 32);
  set_memory_category(before, MemoryCategory::gradients); // not counted: nothing moves
  CHECK(memory.stats().live_total == 172);

  // Views share their block; freeing the last owner uncounts it.
  const Tensor<float, 1> view = b->narrow(0, 5, 10);
  b.reset();
  CHECK(live(memory.stats(), MemoryCategory::parameters) == 100);
  {
    const Tensor<float, 1> drop = view; // the view was the last owner but for this copy
  }
  a.reset();
  CHECK(live(memory.stats(), MemoryCategory::other) == 0);

  // The peak starts again from what is live.
  memory.reset_peak();
  s = memory.stats();
  CHECK(s.peak_total == s.live_total);
  CHECK(s.peak[std::size_t(MemoryCategory::parameters)] == 100);
  CHECK_THAT(s.to_string(), Catch::Contains("parameters") && Catch::Contains("optimizer_state") &&
                                Catch::Contains("communication") && Catch::Contains("total"));
}

TEST_CASE("MemoryTracker counts a meta tensor's bytes as a host tensor's", "[core][memory]") {
  auto counts = [](Device device) {
    MemoryTracker memory;
    std::optional<Tensor<float, 2>> w;
    {
      const MemoryCategoryScope params(MemoryCategory::parameters);
      w.emplace(Tensor<float, 2>::zeros({64, 32}, device));
    }
    const auto act = AnyTensor::empty(DType::bfloat16, Extents{3, 5}, device);
    const auto view = w->narrow(1, 8, 8).contiguous(); // a copy of 8 columns: 2 KiB more
    set_memory_category(view, MemoryCategory::gradients);
    w.reset();
    return memory.stats();
  };
  const MemoryStats host = counts(Device::cpu());
  const MemoryStats meta = counts(Device::meta());
  CHECK(meta.peak_total == 64 * 32 * 4 + 30 + 64 * 8 * 4);
  CHECK(meta.to_string() == host.to_string());
  CHECK(meta.allocations == host.allocations);
  CHECK(meta.live == host.live);
  CHECK(meta.at_peak == host.at_peak);
  CHECK(live(meta, MemoryCategory::gradients) == 64 * 8 * 4);
  CHECK(live(meta, MemoryCategory::parameters) == 0);
}

TEST_CASE("MemoryTracker: other threads, nested trackers, blocks that outlive the tracker",
          "[core][memory]") {
  std::optional<Tensor<int, 1>> outlives;
  {
    MemoryTracker outer;
    const Tensor<int, 1> mine({4});
    std::thread([] { const Tensor<int, 1> theirs({1000}); }).join(); // another thread: not counted here
    CHECK(outer.stats().live_total == 16);
    {
      MemoryTracker inner; // shadows the outer one while it lives
      const Tensor<int, 1> t({2});
      CHECK(inner.stats().live_total == 8);
      CHECK(outer.stats().live_total == 16);
      outlives.emplace(Tensor<int, 1>({3}));
    }
    CHECK(MemoryTracker::current_ledger() != nullptr);
    const Tensor<int, 1> again({1});
    CHECK(outer.stats().live_total == 20);
    CHECK(outer.stats().peak_total == 20);
  }
  CHECK(MemoryTracker::current_ledger() == nullptr);
  outlives.reset(); // its tracker is gone; the ledger it shares is freed with it
}
