// ProcessGroup handles: new_group (members and non-members), split (color/key), nested groups,
// concurrent traffic on overlapping groups, timeouts and identity.

#include "common.hpp"
#include "dtensor/backends/gloo/backend.hpp"
#include "dtensor/rendezvous/in_process_store.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

using namespace comm_test;

TEST_CASE("ProcessGroup identity, copies and timeouts", "[comm][groups]") {
  testing::run_ranks(3, [](ProcessGroup& world) {
    DTENSOR_CHECK(world.is_member() && world.size() == 3 && world.backend_name() == "gloo", "world identity");
    DTENSOR_CHECK(world.ranks().size() == 3 && world.ranks()[world.rank()] == world.rank(), "world ranks");
    ProcessGroup copy = world; // cheap handle: same communicator
    DTENSOR_CHECK(copy == world, "copies compare equal");
    copy.set_timeout(std::chrono::milliseconds(4321));
    DTENSOR_CHECK(world.timeout() == std::chrono::milliseconds(4321), "copies share the timeout");
    auto t = Tensor<int, 1>::full({2}, 1);
    all_reduce(t, ReduceOp::sum, copy);
    expect_values<int>(
        t, [](auto) { return 3; }, "all_reduce through a copy");
    DTENSOR_CHECK(world.to_string().find("gloo group [0,1,2]") != std::string::npos, world.to_string());
  });
}

TEST_CASE("new_group: members get a working group, others a non-member handle", "[comm][groups]") {
  const int world_size = GENERATE(2, 3, 4);
  testing::run_ranks(world_size, [](ProcessGroup& world) {
    const int n = world.size(), r = world.rank();
    // Group of the odd ranks, listed in reverse order (group rank i = ranks[i]).
    std::vector<int> odd;
    for (int q = n - 1; q >= 0; --q) {
      if (q % 2 == 1) {
        odd.push_back(q);
      }
    }
    auto g = world.new_group(odd);
    auto all = world.new_group(std::vector<int>{0, n - 1});
    if (r % 2 == 1) {
      DTENSOR_CHECK(g.is_member() && g.size() == static_cast<int>(odd.size()), "member of the odd group");
      DTENSOR_CHECK(g.ranks()[g.rank()] == r, "group rank maps to this global rank");
      DTENSOR_CHECK(g.rank() == static_cast<int>(std::find(odd.begin(), odd.end(), r) - odd.begin()),
                    "group rank = position in the list");
      auto t = Tensor<std::int64_t, 1>::full({3}, r);
      all_reduce(t, ReduceOp::sum, g);
      std::int64_t s = 0;
      for (int q : odd) {
        s += q;
      }
      expect_values<std::int64_t>(
          t, [&](auto) { return s; }, "all_reduce on the odd group");
      auto b = Tensor<int, 1>::full({2}, g.rank() == 0 ? odd[0] : -777);
      broadcast(b, 0, g);
      expect_values<int>(
          b, [&](auto) { return odd[0]; }, "broadcast from group rank 0");
    } else {
      DTENSOR_CHECK(!g.is_member() && g.rank() == -1, "non-member handle");
      expect_throws([&] { all_reduce(Tensor<int, 1>::full({1}, 0), ReduceOp::sum, g); },
                    {"not a member", "all_reduce"}, "collective on a non-member handle");
    }
    // Traffic on the world while sub-groups exist.
    auto t = Tensor<int, 1>::full({1}, 1);
    all_reduce(t, ReduceOp::sum, world);
    expect_values<int>(
        t, [&](auto) { return n; }, "world all_reduce after new_group");
    if (all.is_member()) {
      auto u = Tensor<int, 1>::full({1}, r);
      all_reduce(u, ReduceOp::max, all);
      expect_values<int>(
          u, [&](auto) { return n - 1; }, "two-rank group");
    }
  });
}

TEST_CASE("split: one group per color ordered by key, nested splits, concurrent groups", "[comm][groups]") {
  const int world_size = GENERATE(1, 2, 3, 4);
  testing::run_ranks(world_size, [](ProcessGroup& world) {
    const int n = world.size(), r = world.rank();
    // Like a 2-column mesh: color = row, key = -column (reverse order within the row).
    auto row = world.split(r / 2, -r);
    std::vector<int> members;
    for (int q = n - 1; q >= 0; --q) {
      if (q / 2 == r / 2) {
        members.push_back(q);
      }
    }
    DTENSOR_CHECK(row.size() == static_cast<int>(members.size()), "row size");
    DTENSOR_CHECK(std::equal(members.begin(), members.end(), row.ranks().begin(), row.ranks().end()),
                  "row ranks ordered by key: " + row.to_string());
    auto col = world.split(r % 2, r);
    auto none = world.split(r == 0 ? -1 : 0, 0);
    DTENSOR_CHECK(none.is_member() == (r != 0), "color < 0 gives a non-member");
    // Async ops on two groups at once, then check.
    auto a = Tensor<int, 1>::full({4}, r);
    auto b = Tensor<int, 1>::full({4}, r);
    auto wa = all_reduce(a, ReduceOp::sum, row, async_op);
    auto wb = all_reduce(b, ReduceOp::sum, col, async_op);
    wa.wait();
    wb.wait();
    int sa = 0, sb = 0;
    for (int q = 0; q < n; ++q) {
      sa += (q / 2 == r / 2) ? q : 0;
      sb += (q % 2 == r % 2) ? q : 0;
    }
    expect_values<int>(
        a, [&](auto) { return sa; }, "row all_reduce");
    expect_values<int>(
        b, [&](auto) { return sb; }, "column all_reduce");
    // Split of a split.
    auto single = row.split(row.rank(), 0);
    DTENSOR_CHECK(single.size() == 1 && single.ranks()[0] == r, "nested split");
    auto c = Tensor<float, 1>::full({2}, 5.0f);
    all_reduce(c, ReduceOp::avg, single);
    expect_values<float>(
        c, [](auto) { return 5.0f; }, "one-rank group");
    if (none.is_member()) {
      auto d = Tensor<int, 1>::full({1}, 1);
      all_reduce(d, ReduceOp::sum, none);
      expect_values<int>(
          d, [&](auto) { return n - 1; }, "group without rank 0");
    }
  });
}

namespace {

/// Forwards to a shared store, each get() `delay` late: a member that is slow to read its peers' addresses.
class SlowStore final : public Store {
public:
  SlowStore(std::shared_ptr<Store> base, std::chrono::milliseconds delay)
      : Store(base->timeout()), base_(std::move(base)), delay_(delay) {}
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const std::vector<char>& data) override { base_->set(key, data); }
  std::vector<char> get(const std::string& key) override {
    std::this_thread::sleep_for(delay_);
    return base_->get(key);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return base_->add(key, delta); }
  std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                const std::vector<char>& desired) override {
    return base_->compare_set(key, expected, desired);
  }
  bool delete_key(const std::string& key) override { return base_->delete_key(key); }
  bool check(const std::vector<std::string>& keys) override { return base_->check(keys); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_->wait(keys, timeout);
  }
  std::int64_t num_keys() override { return base_->num_keys(); }

private:
  std::shared_ptr<Store> base_;
  std::chrono::milliseconds delay_;
};

} // namespace

TEST_CASE("a member that drops a new group at once does not break a slow peer's connect", "[comm][groups]") {
  // Rank 1 reads rank 0's address late; rank 0 destroys its group as soon as it is made. Before the
  // construction barrier, whenever rank 1 was the listening side of the pair, rank 0's connect completed
  // in the kernel, rank 0 closed the socket, and rank 1 failed with "Connection closed by peer".
  for (int round = 0; round < 8; ++round) {
    auto store = std::make_shared<InProcessStore>(std::chrono::seconds(10));
    GlooOptions opts;
    opts.timeout = std::chrono::seconds(10);
    std::string failure;
    std::thread slow([&] {
      try {
        auto b =
            make_gloo_backend(std::make_shared<SlowStore>(store, std::chrono::milliseconds(100)), 1, 2, opts);
        ProcessGroup g(b);
        DTENSOR_CHECK(g.size() == 2, "the slow member's group");
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
    { auto dropped = make_gloo_backend(store, 0, 2, opts); }
    slow.join();
    INFO("round " << round << ": " << failure);
    REQUIRE(failure.empty());
  }
}

TEST_CASE("run_ranks takes any backend that rendezvouses through a Store", "[comm][groups]") {
  // Each rank sees the shared store through its own PrefixStore view; nothing in the harness or the
  // backend may depend on the store's concrete type.
  std::atomic<int> made{0};
  testing::RunRanksOptions options;
  options.make_backend = [&](std::shared_ptr<Store> store, int rank, int size,
                             std::chrono::milliseconds timeout) {
    ++made;
    GlooOptions go;
    go.timeout = timeout;
    return make_gloo_backend(std::make_shared<PrefixStore>("custom", std::move(store)), rank, size, go);
  };
  testing::run_ranks(
      3,
      [](ProcessGroup& world) {
        auto t = Tensor<int, 1>::full({2}, world.rank());
        all_reduce(t, ReduceOp::sum, world);
        expect_values<int>(
            t, [](auto) { return 3; }, "all_reduce over the custom backend");
        auto pair = world.split(world.rank() == 2 ? -1 : 0, world.rank());
        DTENSOR_CHECK(pair.is_member() == (world.rank() != 2), "split through the prefixed store");
      },
      options);
  CHECK(made == 3);
}

TEST_CASE("making groups leaves no keys behind: the store's size stays flat over 50 new_group and split",
          "[comm][groups]") {
  std::shared_ptr<Store> shared;
  testing::RunRanksOptions options;
  options.make_backend = [&](std::shared_ptr<Store> store, int rank, int size,
                             std::chrono::milliseconds timeout) {
    if (rank == 0) { // each rank's thread makes its backend: one writer, the reader below is rank 0 too
      shared = store;
    }
    GlooOptions go;
    go.timeout = timeout;
    return make_gloo_backend(std::move(store), rank, size, go);
  };
  std::vector<std::int64_t> keys(3);
  testing::run_ranks(
      3,
      [&](ProcessGroup& world) {
        for (int i = 0; i < 50; ++i) {
          if (world.rank() < 2) {
            auto pair = world.new_group({0, 1});
            auto t = Tensor<int, 1>::full({2}, 1);
            all_reduce(t, ReduceOp::sum, pair);
          }
          auto halves = world.split(world.rank() % 2, world.rank());
          barrier(world);
          if (world.rank() == 0 && (i == 4 || i == 49)) {
            keys[i == 4 ? 0 : 1] = shared->num_keys();
          }
          barrier(world);
        }
      },
      options);
  INFO("keys after 5 rounds: " << keys[0] << ", after 50: " << keys[1]);
  CHECK(keys[1] == keys[0]);
}
