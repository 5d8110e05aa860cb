// The Store contract on every implementation (InProcessStore, PrefixStore, TcpStore): one template of
// cases over the three, then what only one of them promises: InProcessStore's abort, PrefixStore's key
// mapping, TcpStore's connection handling (arrival order, unreachable and silent masters, port reuse, a
// server going away), and store_barrier.
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/in_process_store.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using dtensor::InProcessStore;
using dtensor::PrefixStore;
using dtensor::Store;
using dtensor::TcpStore;
using dtensor::TcpStoreOptions;

namespace {

using Bytes = std::vector<char>;

TcpStoreOptions server(std::chrono::milliseconds timeout = 5s) {
  TcpStoreOptions o;
  o.is_server = true;
  o.timeout = timeout;
  return o;
}

TcpStoreOptions client(std::chrono::milliseconds timeout = 5s) {
  TcpStoreOptions o;
  o.timeout = timeout;
  return o;
}

std::string str(const Bytes& v) {
  return std::string(v.begin(), v.end());
}

Bytes bytes(std::string_view s) {
  return Bytes(s.begin(), s.end());
}

/// A port nothing listens on (bound, then released).
int free_port() {
  dtensor::TcpStoreServer s(0);
  return s.port();
}

/// What the template cases run on: two clients of one store (`a`, `b`; the same object where the store
/// has no notion of clients).
struct InProcessCase {
  static constexpr const char* name = "InProcessStore";
  explicit InProcessCase(std::chrono::milliseconds timeout)
      : a(std::make_shared<InProcessStore>(timeout)), b(a) {}
  std::shared_ptr<Store> a;
  std::shared_ptr<Store> b;
};

struct TcpCase {
  static constexpr const char* name = "TcpStore";
  explicit TcpCase(std::chrono::milliseconds timeout)
      : master(std::make_shared<TcpStore>("127.0.0.1", 0, server(timeout))),
        other(std::make_shared<TcpStore>("127.0.0.1", master->port(), client(timeout))), a(master), b(other) {
  }
  std::shared_ptr<TcpStore> master;
  std::shared_ptr<TcpStore> other;
  std::shared_ptr<Store> a;
  std::shared_ptr<Store> b;
};

/// Two views with one prefix, each over its own client of one TcpStore.
struct PrefixCase {
  static constexpr const char* name = "PrefixStore";
  explicit PrefixCase(std::chrono::milliseconds timeout)
      : tcp(timeout), a(std::make_shared<PrefixStore>("job/g0", tcp.a)),
        b(std::make_shared<PrefixStore>("job/g0", tcp.b)) {}
  TcpCase tcp;
  std::shared_ptr<Store> a;
  std::shared_ptr<Store> b;
};

} // namespace

// ---- the contract, on every implementation ---------------------------------------------------------------

TEMPLATE_TEST_CASE("store: set, get, overwrite, binary, empty and large values", "[store]", InProcessCase,
                   PrefixCase, TcpCase) {
  TestType s(5s);
  s.a->set("a", std::string_view("alpha"));
  CHECK(str(s.b->get("a")) == "alpha");
  s.b->set("a", Bytes{'b', '\0', 'c'});
  CHECK(s.a->get("a") == Bytes{'b', '\0', 'c'});
  s.b->set("empty", std::string_view(""));
  CHECK(s.a->get("empty").empty());
  CHECK(s.a->check({"empty"}));
  Bytes big(3 << 20, 'x');
  s.a->set("big", big);
  CHECK(s.b->get("big") == big);
  CHECK(s.a->describe().size() > 0);
}

TEMPLATE_TEST_CASE("store: add, check, try_get, delete_key, num_keys", "[store]", InProcessCase, PrefixCase,
                   TcpCase) {
  TestType s(5s);
  CHECK(s.a->add("n", 5) == 5);
  CHECK(s.b->add("n", -2) == 3);
  CHECK(s.a->add("n", 0) == 3);
  CHECK(str(s.a->get("n")) == "3");
  s.a->set("a", std::string_view("1"));
  CHECK(s.b->check({"a", "n"}));
  CHECK_FALSE(s.b->check({"a", "zzz"}));
  CHECK(s.b->check({}));
  CHECK_FALSE(s.b->try_get("zzz").has_value());
  CHECK(str(s.b->try_get("a").value()) == "1");
  CHECK(s.a->num_keys() == 2);
  CHECK(s.b->delete_key("a"));
  CHECK_FALSE(s.b->delete_key("a"));
  CHECK_FALSE(s.a->check({"a"}));
  CHECK(s.a->num_keys() == 1);
  s.a->set("text", std::string_view("abc"));
  try {
    s.b->add("text", 1);
    FAIL("add on a non-integer value");
  } catch (const dtensor::Error& e) {
    CHECK(std::string(e.what()).find("text") != std::string::npos);
    CHECK(std::string(e.what()).find("not an integer") != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("store: compare_set follows c10d", "[store]", InProcessCase, PrefixCase, TcpCase) {
  TestType s(5s);
  // Missing key, expected not empty: nothing stored, `expected` returned.
  CHECK(str(s.a->compare_set("k", bytes("x"), bytes("y"))) == "x");
  CHECK_FALSE(s.a->check({"k"}));
  // Missing key, expected empty: `desired` stored and returned.
  CHECK(str(s.a->compare_set("k", {}, bytes("first"))) == "first");
  CHECK(str(s.b->get("k")) == "first");
  // Present, expected matches: swapped.
  CHECK(str(s.b->compare_set("k", bytes("first"), bytes("second"))) == "second");
  CHECK(str(s.a->get("k")) == "second");
  // Present, expected differs: the current value, unchanged.
  CHECK(str(s.a->compare_set("k", bytes("first"), bytes("third"))) == "second");
  CHECK(str(s.b->get("k")) == "second");
  // Present and empty: matched by an empty expected.
  s.a->set("e", std::string_view(""));
  CHECK(str(s.b->compare_set("e", {}, bytes("filled"))) == "filled");
  CHECK(str(s.a->get("e")) == "filled");
}

TEMPLATE_TEST_CASE("store: compare_set is atomic and wakes waiters", "[store]", InProcessCase, PrefixCase,
                   TcpCase) {
  TestType s(5s);
  std::thread waiter([&] { CHECK(str(s.b->get("lock")) != ""); });
  constexpr int n = 6;
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      const Bytes mine = bytes("owner" + std::to_string(t));
      if ((t % 2 == 0 ? s.a : s.b)->compare_set("lock", {}, mine) == mine) {
        ++winners;
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  waiter.join();
  CHECK(winners == 1);
}

TEMPLATE_TEST_CASE("store: multi_set and multi_get", "[store]", InProcessCase, PrefixCase, TcpCase) {
  TestType s(5s);
  s.a->multi_set({"m/0", "m/1", "m/2"}, {bytes("zero"), Bytes{}, bytes("two")});
  const auto v = s.b->multi_get({"m/2", "m/0", "m/1"});
  REQUIRE(v.size() == 3);
  CHECK(str(v[0]) == "two");
  CHECK(str(v[1]) == "zero");
  CHECK(v[2].empty());
  CHECK(s.b->multi_get({}).empty());
  // multi_get waits for keys set later.
  std::thread setter([&] {
    std::this_thread::sleep_for(150ms);
    s.a->set("late", std::string_view("here"));
  });
  const auto w = s.b->multi_get({"m/0", "late"});
  setter.join();
  CHECK(str(w[1]) == "here");
  try {
    s.a->multi_set({"x", "y"}, {bytes("1")});
    FAIL("multi_set with fewer values than keys");
  } catch (const dtensor::Error& e) {
    CHECK(std::string(e.what()).find("2 keys but 1 values") != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("store: get waits for a later set from another client", "[store]", InProcessCase,
                   PrefixCase, TcpCase) {
  TestType s(5s);
  std::thread setter([&] {
    std::this_thread::sleep_for(200ms);
    s.b->set("late", std::string_view("here"));
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(str(s.a->get("late")) == "here");
  CHECK(std::chrono::steady_clock::now() - t0 >= 150ms);
  setter.join();
}

TEMPLATE_TEST_CASE("store: wait times out naming the missing keys", "[store]", InProcessCase, PrefixCase,
                   TcpCase) {
  TestType s(5s);
  s.a->set("present", std::string_view("1"));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    s.a->wait({"present", "absent"}, 300ms);
    FAIL("wait returned");
  } catch (const dtensor::TimeoutError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("absent'") != std::string::npos);
    CHECK(msg.find("present'") == std::string::npos);
    CHECK(msg.find("300 ms") != std::string::npos);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 280ms);
  CHECK(took < 3s);
  // The store stays usable after a timed-out wait.
  CHECK(str(s.a->get("present")) == "1");
  s.b->wait({"present"});
}

TEMPLATE_TEST_CASE("store: get and multi_get time out after timeout(), naming the key", "[store]",
                   InProcessCase, PrefixCase, TcpCase) {
  TestType s(5s);
  CHECK(s.a->timeout() == 5s);
  s.a->set_timeout(250ms);
  CHECK(s.a->timeout() == 250ms);
  auto expect_timeout = [&](auto&& call, const std::string& key) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      call();
      FAIL("returned without the key");
    } catch (const dtensor::TimeoutError& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find(key + "'") != std::string::npos);
      CHECK(msg.find("250 ms") != std::string::npos);
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(took >= 230ms);
    CHECK(took < 3s);
  };
  expect_timeout([&] { s.a->get("nothing"); }, "nothing");
  s.a->set("one", std::string_view("1"));
  expect_timeout([&] { s.a->multi_get({"one", "two"}); }, "two");
  expect_timeout([&] { s.a->wait({"three"}); }, "three");
  CHECK_THROWS_AS(s.a->set_timeout(0ms), dtensor::Error);
}

TEMPLATE_TEST_CASE("store: concurrent clients, adds and a barrier", "[store]", InProcessCase, PrefixCase,
                   TcpCase) {
  TestType s(5s);
  constexpr int n = 8;
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        Store& c = t % 2 == 0 ? *s.a : *s.b;
        for (int i = 0; i < 50; ++i) {
          c.add("counter", 1);
        }
        c.set("key/" + std::to_string(t), std::to_string(t));
        for (int o = 0; o < n; ++o) {
          if (str(c.get("key/" + std::to_string(o))) != std::to_string(o)) {
            ++errors;
          }
        }
        dtensor::store_barrier(c, "b", n, 5s, t == 0);
      } catch (...) {
        ++errors;
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  CHECK(errors == 0);
  CHECK(s.a->add("counter", 0) == n * 50);
}

TEMPLATE_TEST_CASE("store: one client shared by threads, a blocked wait does not block a set", "[store]",
                   InProcessCase, PrefixCase, TcpCase) {
  TestType s(5s);
  std::thread waiter([&] { CHECK(str(s.b->get("go")) == "1"); });
  std::this_thread::sleep_for(100ms);
  s.b->set("go", std::string_view("1")); // would deadlock with a single connection
  waiter.join();
}

TEMPLATE_TEST_CASE("store: barrier timeout says how many arrived", "[store]", InProcessCase, PrefixCase,
                   TcpCase) {
  TestType s(5s);
  try {
    dtensor::store_barrier(*s.a, "lonely", 3, 200ms);
    FAIL("barrier passed alone");
  } catch (const dtensor::TimeoutError& e) {
    CHECK(std::string(e.what()).find("barrier 'lonely'") != std::string::npos);
    CHECK(std::string(e.what()).find("1 of 3 processes arrived") != std::string::npos);
  }
}

// ---- InProcessStore -------------------------------------------------------------------------------------

TEST_CASE("InProcessStore: abort wakes every waiter, reads and writes keep working", "[store]") {
  auto store = std::make_shared<InProcessStore>(10s);
  store->set("kept", std::string_view("v"));
  std::vector<std::thread> waiters;
  std::atomic<int> woken{0};
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&, i] {
      try {
        if (i == 0) {
          store->get("never");
        } else if (i == 1) {
          store->wait({"kept", "never"});
        } else {
          store->multi_get({"never"});
        }
      } catch (const dtensor::TimeoutError&) {
      } catch (const dtensor::Error& e) {
        if (std::string(e.what()) == "store aborted: rank 2 failed: boom") {
          ++woken;
        }
      }
    });
  }
  std::this_thread::sleep_for(100ms);
  const auto t0 = std::chrono::steady_clock::now();
  store->abort("rank 2 failed: boom");
  store->abort("a later reason is ignored");
  for (auto& t : waiters) {
    t.join();
  }
  CHECK(woken == 3);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  // Future waits for missing keys fail at once; existing keys, set and try_get still work.
  CHECK_THROWS_WITH(store->wait({"never"}), "store aborted: rank 2 failed: boom");
  CHECK(str(store->get("kept")) == "v");
  store->set("reason/1", std::string_view("why"));
  CHECK(str(store->try_get("reason/1").value()) == "why");
  CHECK_FALSE(store->try_get("never").has_value());
}

TEST_CASE("InProcessStore: abort releases a waiter seen through a PrefixStore", "[store]") {
  auto store = std::make_shared<InProcessStore>(10s);
  PrefixStore view("g", store);
  std::thread aborter([&] {
    std::this_thread::sleep_for(100ms);
    store->abort("stop");
  });
  CHECK_THROWS_WITH(view.get("x"), "store aborted: stop");
  aborter.join();
}

// ---- PrefixStore ----------------------------------------------------------------------------------------

TEST_CASE("PrefixStore: keys live under the prefix in the base, views nest, each has its own timeout",
          "[store]") {
  auto base = std::make_shared<InProcessStore>(5s);
  auto group = std::make_shared<PrefixStore>("dtensor/world", base);
  PrefixStore sub("g1", group);
  CHECK(group->prefix() == "dtensor/world");
  CHECK(group->base() == base);
  CHECK(group->timeout() == 5s);
  sub.set("k", std::string_view("v"));
  CHECK(str(base->get("dtensor/world/g1/k")) == "v");
  CHECK(str(group->get("g1/k")) == "v");
  base->set("dtensor/world/other", std::string_view("w"));
  CHECK(str(group->try_get("other").value()) == "w");
  CHECK(sub.add("count", 2) == 2);
  CHECK(str(base->get("dtensor/world/g1/count")) == "2");
  CHECK(sub.num_keys() == base->num_keys()); // c10d: the whole store
  CHECK(base->delete_key("dtensor/world/g1/k"));
  CHECK_FALSE(sub.check({"k"}));
  // A view's timeout is its own; messages name the full key.
  sub.set_timeout(200ms);
  CHECK(base->timeout() == 5s);
  try {
    sub.get("missing");
    FAIL("get returned");
  } catch (const dtensor::TimeoutError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("'dtensor/world/g1/missing'") != std::string::npos);
    CHECK(msg.find("200 ms") != std::string::npos);
  }
  CHECK_THROWS_AS(PrefixStore("p", nullptr), dtensor::Error);
}

// ---- TcpStore: connections ------------------------------------------------------------------------------

TEST_CASE("TcpStore: clients may start before the server", "[store]") {
  const int port = free_port();
  std::atomic<bool> ok{false};
  std::thread early([&] {
    TcpStore c("127.0.0.1", port, client(10s)); // retries until the server is up
    c.set("early", std::string_view("1"));
    ok = str(c.get("from-master")) == "2";
  });
  std::this_thread::sleep_for(300ms);
  TcpStore master("127.0.0.1", port, server());
  CHECK(str(master.get("early")) == "1");
  master.set("from-master", std::string_view("2"));
  early.join();
  CHECK(ok);
}

TEST_CASE("TcpStore: an unreachable master gives a timeout error with the address", "[store]") {
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    TcpStore c("127.0.0.1", port, client(500ms));
    FAIL("connected to nothing");
  } catch (const dtensor::TimeoutError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
    CHECK(msg.find("could not reach the store") != std::string::npos);
    CHECK(msg.find("MASTER_ADDR") != std::string::npos);
    CHECK(msg.find("refused") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
}

TEST_CASE("TcpStore: a master that accepts but never answers is reported", "[store]") {
  // A listening socket nobody accepts on: the kernel completes the TCP handshake, nothing replies.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(fd, 16) == 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  try {
    TcpStore c("127.0.0.1", port, client(1500ms));
    FAIL("handshake with a silent peer succeeded");
  } catch (const dtensor::TimeoutError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("did not answer the store handshake") != std::string::npos);
  }
  ::close(fd);
}

TEST_CASE("TcpStore: a port is reusable at once after the server stopped", "[store]") {
  int port = 0;
  {
    TcpStore master("127.0.0.1", 0, server());
    port = master.port();
    TcpStore c("127.0.0.1", port, client());
    c.set("k", std::string_view("v"));
    CHECK(str(master.get("k")) == "v");
  } // the server closes its connections first: its side of them sits in TIME_WAIT
  for (int round = 0; round < 3; ++round) {
    TcpStore master("127.0.0.1", port, server());
    TcpStore c("127.0.0.1", port, client());
    CHECK_FALSE(c.check({"k"})); // a fresh store
    c.set("k", std::string_view("v"));
  }
}

TEST_CASE("TcpStore: a client sees the server going away", "[store]") {
  auto master = std::make_unique<TcpStore>("127.0.0.1", 0, server());
  TcpStore c("127.0.0.1", master->port(), client());
  c.set("x", std::string_view("1"));
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    master.reset();
  });
  try {
    c.wait({"never"}, 5s);
    FAIL("wait survived the server");
  } catch (const dtensor::TimeoutError&) {
    FAIL("expected a connection error, not a timeout");
  } catch (const dtensor::Error& e) {
    CHECK(std::string(e.what()).find("the store is gone") != std::string::npos);
  }
  killer.join();
}

TEST_CASE("TcpStore: once the server is gone, every call fails at once, naming its host", "[store]") {
  auto master = std::make_unique<TcpStore>("127.0.0.1", 0, server());
  TcpStoreOptions o = client(5s);
  o.server_owner = "rank 0";
  TcpStore idle("127.0.0.1", master->port(), o);   // its pooled connection is closed under it
  TcpStore waiter("127.0.0.1", master->port(), o); // loses the server in the middle of a wait
  idle.set("x", std::string_view("1"));
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    master.reset();
  });
  CHECK_THROWS_WITH(waiter.wait({"never"}), Catch::Contains("the store is gone (it") &&
                                                Catch::Contains("its host, rank 0, probably exited"));
  killer.join();
  for (TcpStore* c : {&idle, &waiter, &idle}) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(c->check({"x"}),
                      Catch::Contains("check: the store is gone") && Catch::Contains("its host, rank 0"));
    CHECK(std::chrono::steady_clock::now() - t0 < 1s); // not a reconnect for the whole 5 s timeout
  }
}

TEST_CASE("delete_after_all_read: the last reader deletes the keys and its counter", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  master.set("id/0", std::string_view("a"));
  master.set("id/1", std::string_view("b"));
  const std::int64_t before = master.num_keys();
  dtensor::delete_after_all_read(master, "id/read", 3, {"id/0", "id/1"});
  dtensor::delete_after_all_read(master, "id/read", 3, {"id/0", "id/1"});
  CHECK(master.check({"id/0", "id/1"})); // a reader is still to come
  dtensor::delete_after_all_read(master, "id/read", 3, {"id/0", "id/1"});
  CHECK_FALSE(master.check({"id/0"}));
  CHECK_FALSE(master.check({"id/1"}));
  CHECK_FALSE(master.check({"id/read"}));
  CHECK(master.num_keys() == before - 2);
}

TEST_CASE("TcpStore: barrier through the member, the host waits for everyone to leave", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  std::thread other([port = master.port()] {
    TcpStore c("127.0.0.1", port, client());
    c.barrier("both", 2, 5s);
  });
  master.barrier("both", 2, 5s);
  CHECK(master.add("both/left", 0) == 2); // the host returned only after the other was released
  other.join();
  try {
    master.barrier("lonely", 3, 200ms);
    FAIL("barrier passed alone");
  } catch (const dtensor::TimeoutError& e) {
    CHECK(std::string(e.what()).find("1 of 3 processes arrived") != std::string::npos);
  }
}

// ---- the server's defences (issue 18, defect 8) ---------------------------------------------------------

namespace {

namespace tcp = dtensor::detail::tcp;

/// A raw connection to a store, for what TcpStore never sends.
tcp::Fd raw_connection(int port) {
  std::string error;
  bool refused = false;
  tcp::Fd fd = tcp::try_connect("127.0.0.1", port, tcp::Clock::now() + 5s, error, refused);
  REQUIRE(fd);
  return fd;
}

std::vector<char> hello(std::string_view token = "") {
  return std::move(tcp::Writer()
                       .u8(static_cast<std::uint8_t>(tcp::Cmd::hello))
                       .u32(tcp::kMagic)
                       .u32(tcp::kVersion)
                       .str(token))
      .finish();
}

/// Sends `request`; the reply's status and its error text (if any), or "closed" / "timeout".
std::string ask(int fd, const std::vector<char>& request) {
  std::vector<char> reply;
  int err = 0;
  const auto r = tcp::round_trip(fd, request, tcp::Clock::now() + 5s, reply, err);
  if (r != tcp::IoResult::ok) {
    return r == tcp::IoResult::timeout ? "timeout" : "closed";
  }
  tcp::Reader rd(reply);
  const auto s = static_cast<tcp::Status>(rd.u8());
  return s == tcp::Status::error ? "error: " + rd.str() : "status " + std::to_string(static_cast<int>(s));
}

/// True when the peer closes `fd` within 5 s.
bool closed_by_peer(int fd) {
  pollfd pfd{fd, POLLIN, 0};
  char c;
  return ::poll(&pfd, 1, 5000) == 1 && ::recv(fd, &c, 1, 0) <= 0;
}

} // namespace

TEST_CASE("TcpStore server: a client without the job's token is refused at once, the server serves on",
          "[store]") {
  TcpStoreOptions o = server();
  o.token = "job-a";
  TcpStore master("127.0.0.1", 0, o);
  for (const std::string token : {"", "job-b", "job-a-longer"}) {
    TcpStoreOptions c = client(5s);
    c.token = token;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(TcpStore("127.0.0.1", master.port(), c),
                      Catch::Contains("the store refused this client: wrong or missing job token"));
    CHECK(std::chrono::steady_clock::now() - t0 < 1s); // not retried for the whole timeout
  }
  // A peer that skips the handshake is disconnected without an answer.
  tcp::Fd raw = raw_connection(master.port());
  CHECK(ask(raw.get(), std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::num_keys))).finish()) ==
        "closed");
  TcpStoreOptions good = client();
  good.token = "job-a";
  TcpStore c("127.0.0.1", master.port(), good);
  c.set("k", std::string_view("v"));
  CHECK(str(master.get("k")) == "v");
}

TEST_CASE("TcpStore server: requests and the store's size are bounded, with an error the client can read",
          "[store]") {
  dtensor::TcpStoreServerOptions so;
  so.max_request_bytes = 1024;
  so.max_total_bytes = 4096;
  dtensor::TcpStoreServer server(0, so);
  TcpStore c("127.0.0.1", server.port(), client());

  // One value past the request limit: refused by the client before sending, nothing stored.
  CHECK_THROWS_WITH(c.set("big", Bytes(2000, 'x')), Catch::Contains("set('big'): a request of") &&
                                                        Catch::Contains("passes the store's limit of 1024"));
  CHECK_FALSE(c.check({"big"}));

  // A peer declaring a 1 GiB request gets an error and is disconnected; nothing is allocated for it.
  tcp::Fd raw = raw_connection(server.port());
  REQUIRE(ask(raw.get(), hello()) == "status 0");
  const std::uint32_t huge = 1u << 30;
  std::vector<char> header(4);
  std::memcpy(header.data(), &huge, 4);
  int err = 0;
  REQUIRE(tcp::send_all(raw.get(), header.data(), 4, tcp::Clock::now() + 5s, err) == tcp::IoResult::ok);
  std::uint32_t n = 0;
  REQUIRE(tcp::recv_all(raw.get(), reinterpret_cast<char*>(&n), 4, tcp::Clock::now() + 5s, err) ==
          tcp::IoResult::ok);
  std::vector<char> body(n);
  REQUIRE(tcp::recv_all(raw.get(), body.data(), n, tcp::Clock::now() + 5s, err) == tcp::IoResult::ok);
  tcp::Reader rd(body);
  CHECK(rd.u8() == static_cast<std::uint8_t>(tcp::Status::error));
  CHECK_THAT(rd.str(), Catch::Contains("a request of 1073741824 bytes passes the store's limit of 1024"));
  CHECK(closed_by_peer(raw.get()));

  // Requests pipelined behind a wait, past the limit: an error, then the connection is closed.
  tcp::Fd piped = raw_connection(server.port());
  REQUIRE(ask(piped.get(), hello()) == "status 0");
  std::vector<char> wait =
      std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::wait)).u32(1).str("never").i64(60000))
          .finish();
  const std::vector<char> set =
      std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::set)).str("p").bytes(Bytes(900, 'p')))
          .finish();
  for (int i = 0; i < 4; ++i) {
    wait.insert(wait.end(), set.begin(), set.end());
  }
  CHECK_THAT(ask(piped.get(), wait), Catch::Contains("bytes of requests pipelined"));
  CHECK(closed_by_peer(piped.get()));

  // The store's total: full is an error, a delete makes room again.
  for (int i = 0; i < 5; ++i) {
    c.set("v" + std::to_string(i), Bytes(700, 'v'));
  }
  CHECK_THROWS_WITH(c.set("v5", Bytes(700, 'v')), Catch::Contains("the store is full"));
  CHECK_FALSE(c.check({"v5"}));
  c.delete_key("v0");
  c.set("v5", Bytes(700, 'v'));
  CHECK(c.num_keys() == 5);
}

TEST_CASE("TcpStore: a wait's timeout is checked on both sides", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  CHECK_THROWS_WITH(master.wait({"k"}, 0ms), Catch::Contains("the timeout must be positive"));
  tcp::Fd raw = raw_connection(master.port());
  REQUIRE(ask(raw.get(), hello()) == "status 0");
  for (std::int64_t ms : {std::int64_t{-5}, std::int64_t{0}, std::int64_t{1} << 62}) {
    const auto wait =
        std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::wait)).u32(1).str("never").i64(ms))
            .finish();
    CHECK_THAT(ask(raw.get(), wait), Catch::Contains("is out of range (1 ms to 30 days)"));
  }
}

TEST_CASE("TcpStore server: at its connection cap it closes the idlest, and serves new clients", "[store]") {
  dtensor::TcpStoreServerOptions so;
  so.max_connections = 8;
  dtensor::TcpStoreServer server(0, so);
  TcpStore c("127.0.0.1", server.port(), client());
  c.set("k", std::string_view("v"));
  std::vector<tcp::Fd> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(raw_connection(server.port()));
  }
  TcpStore late("127.0.0.1", server.port(), client());
  CHECK(str(late.get("k")) == "v");
  // Clients that completed the handshake, past the cap: the idlest of them (c's) are closed too.
  std::vector<std::unique_ptr<TcpStore>> busy;
  for (int i = 0; i < 10; ++i) {
    busy.push_back(std::make_unique<TcpStore>("127.0.0.1", server.port(), client()));
    busy.back()->set("b" + std::to_string(i), std::string_view("1"));
  }
  CHECK(str(c.get("k")) == "v"); // its connection was closed while idle: it reconnects
  CHECK(c.add("n", 1) == 1);
}

namespace {

/// A TcpStoreServer with `options` in a child process limited to `fds` file descriptors.
struct ServerProcess {
  pid_t pid = -1;
  int port = 0;

  explicit ServerProcess(rlim_t fds = 48, dtensor::TcpStoreServerOptions options = {}) {
    int port_pipe[2];
    REQUIRE(::pipe(port_pipe) == 0);
    pid = ::fork();
    if (pid == 0) {
      rlimit lim{fds, fds};
      ::setrlimit(RLIMIT_NOFILE, &lim);
      dtensor::TcpStoreServer s(0, std::move(options));
      const int p = s.port();
      [[maybe_unused]] auto w = ::write(port_pipe[1], &p, sizeof(p));
      std::this_thread::sleep_for(60s);
      ::_exit(0);
    }
    REQUIRE(::read(port_pipe[0], &port, sizeof(port)) == sizeof(port));
    ::close(port_pipe[0]);
    ::close(port_pipe[1]);
  }
  ~ServerProcess() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }

  /// The CPU time it used (user + system) in clock ticks.
  long cpu_ticks() const {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string field;
    long ticks = 0;
    for (int i = 1; i <= 15 && stat >> field; ++i) {
      if (i == 14 || i == 15) { // utime, stime
        ticks += std::stol(field);
      }
    }
    return ticks;
  }

  /// Its resident memory in KiB (VmRSS).
  long rss_kib() const {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("VmRSS:", 0) == 0) {
        return std::stol(line.substr(6));
      }
    }
    return -1;
  }

  /// How many descriptors it holds open.
  long open_fds() const {
    long n = 0;
    for ([[maybe_unused]] const auto& e :
         std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
      ++n;
    }
    return n;
  }

  /// True when it used under 20% of a core during the next second.
  bool quiet() const {
    const long before = cpu_ticks();
    std::this_thread::sleep_for(1s);
    return cpu_ticks() - before < ::sysconf(_SC_CLK_TCK) / 5;
  }
};

} // namespace

TEST_CASE("TcpStore server: out of file descriptors it neither spins nor turns clients away", "[store]") {
  SECTION("idle connections fill its descriptors: the idlest make room for a client") {
    ServerProcess server;
    std::vector<tcp::Fd> idle;
    for (int i = 0; i < 100; ++i) { // more than the server can hold: the kernel queues the rest
      idle.push_back(raw_connection(server.port));
    }
    TcpStore c("127.0.0.1", server.port, client(5s));
    c.set("k", std::string_view("v"));
    CHECK(str(c.get("k")) == "v");
    CHECK(server.quiet());
  }
  SECTION("waiting clients fill them: a new connection is closed at once, not left spinning") {
    ServerProcess server;
    const auto wait =
        std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::wait)).u32(1).str("never").i64(60000))
            .finish();
    std::vector<tcp::Fd> waiting;
    for (int i = 0; i < 60; ++i) { // each one greets and waits: none may be closed to make room
      tcp::Fd fd = raw_connection(server.port);
      std::vector<char> reply;
      int err = 0;
      if (tcp::round_trip(fd.get(), hello(), tcp::Clock::now() + 1s, reply, err) != tcp::IoResult::ok) {
        break; // the server is full
      }
      REQUIRE(tcp::send_all(fd.get(), wait.data(), wait.size(), tcp::Clock::now() + 1s, err) ==
              tcp::IoResult::ok);
      waiting.push_back(std::move(fd));
    }
    CHECK(waiting.size() < 60);
    tcp::Fd late = raw_connection(server.port);
    CHECK(closed_by_peer(late.get()));
    CHECK(server.quiet());
  }
}

// ---- strangers: connections that have not completed their hello (issue 32) --------------------------------

namespace {

/// The first `sent` bytes of a request that declares `declared` bytes: a hello that never completes.
std::vector<char> unfinished_request(std::uint32_t declared, std::size_t sent) {
  std::vector<char> bytes(4 + sent, 'x');
  std::memcpy(bytes.data(), &declared, 4);
  return bytes;
}

/// Sends what it can of `bytes` within `limit` (the peer may refuse it midway).
void send_some(int fd, const std::vector<char>& bytes, std::chrono::milliseconds limit = 2s) {
  int err = 0;
  [[maybe_unused]] auto r = tcp::send_all(fd, bytes.data(), bytes.size(), tcp::Clock::now() + limit, err);
}

/// True when the peer has not closed `fd` within `wait`.
bool still_open(int fd, std::chrono::milliseconds wait = 200ms) {
  pollfd pfd{fd, POLLIN, 0};
  return ::poll(&pfd, 1, static_cast<int>(wait.count())) == 0;
}

/// The error a refused connection was sent before being closed ("" when none).
std::string refusal(int fd) {
  std::uint32_t n = 0;
  int err = 0;
  if (tcp::recv_all(fd, reinterpret_cast<char*>(&n), 4, tcp::Clock::now() + 5s, err) != tcp::IoResult::ok ||
      n > 65536) {
    return "";
  }
  std::vector<char> body(n);
  if (tcp::recv_all(fd, body.data(), n, tcp::Clock::now() + 5s, err) != tcp::IoResult::ok) {
    return "";
  }
  tcp::Reader rd(body);
  return rd.u8() == static_cast<std::uint8_t>(tcp::Status::error) ? rd.str() : "";
}

} // namespace

TEST_CASE(
    "TcpStore server: before its hello a connection may declare little, and strangers together hold little",
    "[store]") {
  dtensor::TcpStoreServerOptions so;
  so.token = "job";
  so.max_unauthenticated_bytes = 16 << 10;
  dtensor::TcpStoreServer server(0, so);
  TcpStoreOptions good = client();
  good.token = "job";

  // A first request declaring 60 MiB is refused at its header, before a byte of it is kept.
  tcp::Fd big = raw_connection(server.port());
  send_some(big.get(), unfinished_request(60u << 20, 1000));
  CHECK_THAT(refusal(big.get()), Catch::Contains("a connection's first request must be its hello, of at most "
                                                 "4096 bytes; this one declares 62914560"));
  CHECK(closed_by_peer(big.get()));

  // Six unfinished hellos of 3 KiB: the strangers' 16 KiB hold four or five; the oldest are closed first.
  std::vector<tcp::Fd> strangers;
  for (int i = 0; i < 6; ++i) {
    strangers.push_back(raw_connection(server.port()));
    send_some(strangers.back().get(), unfinished_request(4000, 3000));
    std::this_thread::sleep_for(20ms); // accepted in this order
  }
  CHECK(closed_by_peer(strangers.front().get()));
  CHECK(still_open(strangers.back().get()));
  TcpStore c("127.0.0.1", server.port(), good); // a rank still gets in
  c.set("k", std::string_view("v"));
  CHECK(str(c.get("k")) == "v");
}

TEST_CASE("TcpStore server: a connection that does not complete its hello in time is closed", "[store]") {
  dtensor::TcpStoreServerOptions so;
  so.hello_timeout = 300ms;
  dtensor::TcpStoreServer server(0, so);
  tcp::Fd slow = raw_connection(server.port());
  const auto t0 = std::chrono::steady_clock::now();
  send_some(slow.get(), unfinished_request(100, 1));
  CHECK(closed_by_peer(slow.get()));
  CHECK(std::chrono::steady_clock::now() - t0 >= 250ms);
  tcp::Fd prompt = raw_connection(server.port()); // greeted in time: kept past the deadline
  REQUIRE(ask(prompt.get(), hello()) == "status 0");
  std::this_thread::sleep_for(500ms);
  CHECK(ask(prompt.get(), std::move(tcp::Writer().u8(static_cast<std::uint8_t>(tcp::Cmd::num_keys))).finish())
            .rfind("status", 0) == 0);
}

TEST_CASE("TcpStore server: floods of strangers bound its memory and descriptors, and ranks get in",
          "[store]") {
  SECTION("eight connections each sending most of a 60 MiB request: memory stays put") {
    ServerProcess server(64);
    const long before = server.rss_kib();
    std::vector<tcp::Fd> flood;
    const auto request = unfinished_request(60u << 20, 56u << 20);
    for (int i = 0; i < 8; ++i) {
      flood.push_back(raw_connection(server.port));
      send_some(flood.back().get(), request, 500ms);
    }
    const long grew = server.rss_kib() - before;
    INFO("the server's RSS grew by " << grew << " KiB");
    CHECK(grew < 8 * 1024);
  }
  SECTION("connections that sent 5 bytes fill its descriptors: a rank gets in at once") {
    ServerProcess server(48);
    std::vector<tcp::Fd> flood;
    for (int i = 0; i < 100; ++i) { // more than the server can hold
      flood.push_back(raw_connection(server.port));
      send_some(flood.back().get(), unfinished_request(100, 1));
    }
    const auto t0 = std::chrono::steady_clock::now();
    TcpStore c("127.0.0.1", server.port, client(5s));
    c.set("k", std::string_view("v"));
    CHECK(str(c.get("k")) == "v");
    INFO("in after " << std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count()
                     << " ms");
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    CHECK(server.quiet());
  }
  SECTION("at max_connections, strangers with unfinished requests are closed: the cap holds") {
    dtensor::TcpStoreServerOptions so;
    so.max_connections = 16;
    ServerProcess server(256, so);
    const long base = server.open_fds(); // listener, epoll, wake pipe, reserve, stdio
    std::vector<tcp::Fd> flood;
    for (int i = 0; i < 80; ++i) {
      flood.push_back(raw_connection(server.port));
      send_some(flood.back().get(), unfinished_request(100, 1));
    }
    std::this_thread::sleep_for(200ms);
    const long held = server.open_fds() - base;
    INFO("connections held: " << held);
    CHECK(held <= 16);
    TcpStore c("127.0.0.1", server.port, client(5s));
    CHECK(c.add("n", 1) == 1);
  }
}
