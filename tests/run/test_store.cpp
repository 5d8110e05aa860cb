// TcpStore in one process: the key-value contract, arrival order, timeouts with actionable messages,
// unreachable and silent masters, port reuse, concurrency; and read_dist_env's parsing of the
// torchrun / OpenMPI / MPICH / Slurm variables.
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/tcp_store.hpp"

#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using dtensor::TcpStore;
using dtensor::TcpStoreOptions;

namespace {

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

std::string str(const std::vector<char>& v) {
  return std::string(v.begin(), v.end());
}

/// A port nothing listens on (bound, then released).
int free_port() {
  dtensor::TcpStoreServer s(0);
  return s.port();
}

} // namespace

TEST_CASE("store: set, get, add, check, delete, num_keys", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  TcpStore other("127.0.0.1", master.port(), client());
  master.set("a", std::string_view("alpha"));
  CHECK(str(other.get("a")) == "alpha");
  other.set("a", std::vector<char>{'b', '\0', 'c'}); // binary values, overwrite
  CHECK(master.get("a") == std::vector<char>{'b', '\0', 'c'});
  CHECK(master.add("n", 5) == 5);
  CHECK(other.add("n", -2) == 3);
  CHECK(str(master.get("n")) == "3");
  CHECK(other.check({"a", "n"}));
  CHECK_FALSE(other.check({"a", "zzz"}));
  CHECK_FALSE(other.try_get("zzz").has_value());
  CHECK(master.num_keys() == 2);
  CHECK(other.delete_key("a"));
  CHECK_FALSE(other.delete_key("a"));
  CHECK(master.num_keys() == 1);
  other.set("empty", std::string_view(""));
  CHECK(master.get("empty").empty());
  std::vector<char> big(3 << 20, 'x');
  master.set("big", big);
  CHECK(other.get("big") == big);
}

TEST_CASE("store: get waits for a later set from another client", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  std::thread setter([port = master.port()] {
    TcpStore c("127.0.0.1", port, client());
    std::this_thread::sleep_for(200ms);
    c.set("late", std::string_view("here"));
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(str(master.get("late")) == "here");
  CHECK(std::chrono::steady_clock::now() - t0 >= 150ms);
  setter.join();
}

TEST_CASE("store: wait times out naming the missing keys", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  master.set("present", std::string_view("1"));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    master.wait({"present", "absent"}, 300ms);
    FAIL("wait returned");
  } catch (const dtensor::TimeoutError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("'absent'") != std::string::npos);
    CHECK(msg.find("'present'") == std::string::npos);
    CHECK(msg.find("300 ms") != std::string::npos);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 280ms);
  CHECK(took < 3s);
  // The connection stays usable after a timed-out wait.
  CHECK(str(master.get("present")) == "1");
}

TEST_CASE("store: clients may start before the server", "[store]") {
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

TEST_CASE("store: an unreachable master gives a timeout error with the address", "[store]") {
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

TEST_CASE("store: a master that accepts but never answers is reported", "[store]") {
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

TEST_CASE("store: a port is reusable at once after the server stopped", "[store]") {
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

TEST_CASE("store: a client sees the server going away", "[store]") {
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
    CHECK(std::string(e.what()).find("closed the connection") != std::string::npos);
  }
  killer.join();
}

TEST_CASE("store: concurrent clients, adds and a barrier", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  constexpr int n = 8;
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        TcpStore c("127.0.0.1", master.port(), client());
        for (int i = 0; i < 50; ++i) {
          c.add("counter", 1);
        }
        c.set("key/" + std::to_string(t), std::to_string(t));
        for (int o = 0; o < n; ++o) {
          if (str(c.get("key/" + std::to_string(o))) != std::to_string(o)) {
            ++errors;
          }
        }
        c.barrier("b", n, 5s);
      } catch (...) {
        ++errors;
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  CHECK(errors == 0);
  CHECK(master.add("counter", 0) == n * 50);
}

TEST_CASE("store: one client shared by threads, a blocked wait does not block a set", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  TcpStore shared("127.0.0.1", master.port(), client());
  std::thread waiter([&] { CHECK(str(shared.get("go")) == "1"); });
  std::this_thread::sleep_for(100ms);
  shared.set("go", std::string_view("1")); // would deadlock with a single connection
  waiter.join();
}

TEST_CASE("store: barrier timeout says how many arrived", "[store]") {
  TcpStore master("127.0.0.1", 0, server());
  try {
    master.barrier("lonely", 3, 200ms);
    FAIL("barrier passed alone");
  } catch (const dtensor::TimeoutError& e) {
    CHECK(std::string(e.what()).find("1 of 3 processes arrived") != std::string::npos);
  }
}

// ---- environment parsing --------------------------------------------------------------------------------

namespace {
dtensor::EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) {
      return std::nullopt;
    }
    return it->second;
  };
}
} // namespace

TEST_CASE("env: torchrun variables", "[env]") {
  auto e = dtensor::read_dist_env(env_of({{"RANK", "5"},
                                          {"WORLD_SIZE", "8"},
                                          {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "4"},
                                          {"MASTER_ADDR", "node0"},
                                          {"MASTER_PORT", "1234"},
                                          {"DTENSOR_USE_AGENT_STORE", "1"},
                                          {"OMPI_COMM_WORLD_RANK", "7"}}));
  CHECK(e.source == "torchrun");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 1234);
  CHECK(e.agent_store);
}

TEST_CASE("env: OpenMPI, MPICH and Slurm fallbacks", "[env]") {
  auto o = dtensor::read_dist_env(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                          {"OMPI_COMM_WORLD_SIZE", "4"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  CHECK(o.source == "openmpi");
  CHECK(o.rank == 3);
  CHECK(o.world_size == 4);
  CHECK(o.local_rank == 3);
  CHECK(o.master_addr == "127.0.0.1"); // all ranks on this machine
  CHECK(o.master_port == 29500);
  CHECK_FALSE(o.agent_store);

  auto m = dtensor::read_dist_env(
      env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}}));
  CHECK(m.source == "mpich");
  CHECK(m.rank == 1);
  CHECK(m.local_rank == 1);

  auto s = dtensor::read_dist_env(env_of({{"SLURM_PROCID", "6"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "2"},
                                          {"SLURM_JOB_NODELIST", "gpu[07-08],cpu1"},
                                          {"MASTER_PORT", "4000"}}));
  CHECK(s.source == "slurm");
  CHECK(s.rank == 6);
  CHECK(s.world_size == 8);
  CHECK(s.local_rank == 2);
  CHECK(s.master_addr == "gpu07");
  CHECK(s.master_port == 4000);
  CHECK(dtensor::detail::first_slurm_host("a,b") == "a");
  CHECK(dtensor::detail::first_slurm_host("n[1,3-4]") == "n1");
}

TEST_CASE("env: no launcher means one process, bad values are named", "[env]") {
  auto e = dtensor::read_dist_env(env_of({}));
  CHECK(e.source == "default");
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);

  auto message = [](std::map<std::string, std::string> vars) {
    try {
      dtensor::read_dist_env(env_of(std::move(vars)));
    } catch (const dtensor::Error& err) {
      return std::string(err.what());
    }
    return std::string("no error");
  };
  CHECK(message({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'") != std::string::npos);
  CHECK(message({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}).find("out of range") !=
        std::string::npos);
  CHECK(message({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "1"}})
            .find("MASTER_ADDR is not set") != std::string::npos);
  CHECK(message({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT") !=
        std::string::npos);
}

TEST_CASE("init: a backend missing from this build is named, unknown names are rejected", "[env]") {
  // This test binary links neither dtensor::gloo nor dtensor::nccl.
  auto message = [](std::string backend) {
    dtensor::InitOptions o;
    o.backend = std::move(backend);
    o.env = dtensor::DistEnv{};
    try {
      dtensor::init_process_group(o);
    } catch (const dtensor::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message("gloo").find("gloo backend is not part of this build") != std::string::npos);
  CHECK(message("NCCL").find("NCCL backend is not part of this build") != std::string::npos);
  CHECK(message("mpi").find("unknown backend 'mpi'") != std::string::npos);
}

TEST_CASE("init: connect_store hosts a private store for a lone process", "[env]") {
  auto store = dtensor::connect_store(dtensor::DistEnv{}, 5s);
  CHECK(store->is_server());
  CHECK(store->port() > 0);
  store->barrier("alone", 1, 1s);
}
