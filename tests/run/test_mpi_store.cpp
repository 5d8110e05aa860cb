// The Store contract on MpiStore, as real processes: `mpirun -np N run_test_mpi_store` (N >= 2). Every
// process runs every case in the same order; rank 0 holds the keys, the others reach them through MPI
// messages, so each case has the remote ranks do what the contract says and rank 0 (or a peer) check it.
// The ranks keep in step with the MPI backend's barrier (a deadline, not a hang, when a case fails on one
// rank). tests/rendezvous/test_store.cpp holds the same contract for the other stores.
#include "dtensor/backends/mpi/backend.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/mpi_store.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using dtensor::MpiStore;

namespace {

using Bytes = std::vector<char>;

Bytes bytes(std::string_view s) {
  return Bytes(s.begin(), s.end());
}
std::string str(const Bytes& v) {
  return std::string(v.begin(), v.end());
}

/// The processes' store and a group to keep them in step; made once, by every process.
struct World {
  static dtensor::MpiOptions options() {
    dtensor::MpiOptions o;
    o.timeout = 30s;
    return o;
  }
  std::shared_ptr<MpiStore> store = std::make_shared<MpiStore>(10s);
  dtensor::ProcessGroup group{dtensor::make_mpi_backend(nullptr, -1, -1, options())};
  int rank = group.rank();
  int size = group.size();
  void sync() const { dtensor::barrier(group); }
};

World& world() {
  static World w;
  return w;
}

} // namespace

TEST_CASE("MpiStore: set and get across processes, overwrite, binary, empty and large values",
          "[mpi][store]") {
  World& w = world();
  REQUIRE(w.size >= 2);
  const Bytes binary{'a', '\0', 'b', '\xff'};
  const Bytes large(1 << 20, 'x');
  if (w.rank == 1) {
    w.store->set("bin", binary);
    w.store->set("empty", Bytes{});
    w.store->set("large", large);
    w.store->set("k", std::string_view("first"));
  }
  w.sync();
  CHECK(w.store->get("bin") == binary);
  CHECK(w.store->get("empty").empty());
  CHECK(w.store->get("large") == large);
  CHECK(str(w.store->get("k")) == "first");
  w.sync();
  if (w.rank == 0) {
    w.store->set("k", std::string_view("second"));
  }
  w.sync();
  CHECK(str(w.store->get("k")) == "second");
  w.sync();
}

TEST_CASE("MpiStore: add from every process at once is atomic", "[mpi][store]") {
  World& w = world();
  std::vector<std::int64_t> mine;
  for (int i = 0; i < 50; ++i) {
    mine.push_back(w.store->add("counter", 1));
  }
  w.sync();
  CHECK(w.store->add("counter", 0) == 50 * w.size);
  // Every value was handed out once: gather them on rank 0 through the store.
  std::string list;
  for (auto v : mine) {
    list += std::to_string(v) + " ";
  }
  w.store->set("adds/" + std::to_string(w.rank), std::string_view(list));
  w.sync();
  if (w.rank == 0) {
    std::set<std::int64_t> seen;
    for (int r = 0; r < w.size; ++r) {
      const std::string s = str(w.store->get("adds/" + std::to_string(r)));
      std::size_t at = 0;
      while (at < s.size()) {
        const auto sp = s.find(' ', at);
        CHECK(seen.insert(std::stoll(s.substr(at, sp - at))).second);
        at = sp + 1;
      }
    }
    CHECK(seen.size() == static_cast<std::size_t>(50 * w.size));
    CHECK(*seen.begin() == 1);
    CHECK(*seen.rbegin() == 50 * w.size);
  }
  w.sync();
}

TEST_CASE("MpiStore: check, try_get, delete_key, num_keys and compare_set from a remote process",
          "[mpi][store]") {
  World& w = world();
  if (w.rank == 1) {
    auto& s = *w.store;
    CHECK_FALSE(s.check({"cs"}));
    CHECK_FALSE(s.try_get("cs").has_value());
    // compare_set as c10d: missing key and empty expected -> set; missing and non-empty -> expected back.
    CHECK(str(s.compare_set("cs", {}, bytes("v1"))) == "v1");
    CHECK(str(s.compare_set("cs2", bytes("x"), bytes("y"))) == "x");
    CHECK_FALSE(s.check({"cs2"}));
    CHECK(str(s.compare_set("cs", bytes("v1"), bytes("v2"))) == "v2");
    CHECK(str(s.compare_set("cs", bytes("nope"), bytes("v3"))) == "v2");
    CHECK(s.check({"cs"}));
    CHECK(str(*s.try_get("cs")) == "v2");
    const auto keys = s.num_keys();
    CHECK(keys >= 1);
    CHECK(s.delete_key("cs"));
    CHECK_FALSE(s.delete_key("cs"));
    CHECK(s.num_keys() == keys - 1);
    s.set("text", std::string_view("not a number"));
    try {
      s.add("text", 1);
      FAIL("add on a non-integer did not fail");
    } catch (const dtensor::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("not an integer"));
      CHECK_THAT(e.what(), Catch::Contains("MpiStore on rank 0"));
    }
  }
  w.sync();
}

TEST_CASE("MpiStore: multi_set and multi_get", "[mpi][store]") {
  World& w = world();
  if (w.rank == w.size - 1) {
    w.store->multi_set({"m/a", "m/b", "m/c"}, {bytes("1"), Bytes{}, bytes("three")});
  }
  w.sync();
  const auto v = w.store->multi_get({"m/c", "m/a", "m/b"});
  REQUIRE(v.size() == 3);
  CHECK(str(v[0]) == "three");
  CHECK(str(v[1]) == "1");
  CHECK(v[2].empty());
  w.sync();
}

TEST_CASE("MpiStore: get waits for a later set by another process; wait times out naming the keys",
          "[mpi][store]") {
  World& w = world();
  if (w.rank == 0) {
    std::this_thread::sleep_for(150ms);
    w.store->set("late", std::string_view("here"));
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(str(w.store->get("late")) == "here");
    CHECK(std::chrono::steady_clock::now() - t0 >= 100ms);
  }
  w.sync();
  if (w.rank == 1) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w.store->wait({"late", "never/1", "never/2"}, 300ms);
      FAIL("wait did not time out");
    } catch (const dtensor::TimeoutError& e) {
      CHECK_THAT(e.what(), Catch::Contains("'never/1', 'never/2'"));
      CHECK_THAT(e.what(), !Catch::Contains("'late'"));
      CHECK_THAT(e.what(), Catch::Contains("MpiStore"));
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(took >= 300ms);
    CHECK(took < 3s);
  }
  w.sync();
}

TEST_CASE("MpiStore: threads of one process share it; a blocked wait does not block a set", "[mpi][store]") {
  World& w = world();
  if (w.rank == 1) {
    std::atomic<bool> got{false};
    std::thread waiter([&] {
      w.store->wait({"t/x"}, 5s);
      got = true;
    });
    w.store->set("t/y", std::string_view("1")); // while the waiter's request is pending on rank 0
    waiter.join();
    CHECK(got);
  } else if (w.rank == 0) {
    w.store->wait({"t/y"}, 5s);
    w.store->set("t/x", std::string_view("1"));
  }
  w.sync();
}

TEST_CASE("MpiStore: store_barrier over it, and the host waits for everyone to leave", "[mpi][store]") {
  World& w = world();
  for (int round = 0; round < 3; ++round) {
    dtensor::store_barrier(*w.store, "b" + std::to_string(round), w.size, 10s, w.rank == 0);
  }
  w.sync();
}
