// The TCP store under load, in one process: one server, one client.
//
//   bench_store [idle=5000] [seconds=2]     the request rate (set + get of a small key) while `idle` plain
//                                           TCP connections sit open and never send (issue 18: the server
//                                           used to scan every connection per request); prints
//                                           "idle 5000: 4100 ops/s"
//   bench_store flood [seconds=3] [json]    how fast ranks get in (connect + hello with the job's token +
//                                           one get) with and without a flood of strangers: a thread
//                                           opening connections that send 5 bytes of a hello and nothing
//                                           more, 1024 kept open, at a server capped at 512 connections
//                                           (issue 32); rounds of each alternate; prints a table, writes
//                                           `json` when given
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace tcp = dtensor::detail::tcp;

int idle_rate(int idle, double seconds) {
  dtensor::TcpStoreServer server(0);
  std::vector<tcp::Fd> conns;
  std::string error;
  bool refused = false;
  for (int i = 0; i < idle; ++i) {
    auto fd = tcp::try_connect("127.0.0.1", server.port(), tcp::Clock::now() + std::chrono::seconds(5), error,
                               refused);
    if (!fd) {
      std::fprintf(stderr, "idle connection %d: %s\n", i, error.c_str());
      return 1;
    }
    conns.push_back(std::move(fd));
  }
  dtensor::TcpStore client("127.0.0.1", server.port());
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  long ops = 0;
  while (std::chrono::steady_clock::now() < until) {
    client.set("k", std::string_view("v"));
    client.get("k");
    ops += 2;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("idle %d: %.0f ops/s\n", idle, static_cast<double>(ops) / s);
  return 0;
}

/// Ranks getting in during `seconds`: how many per second, and the slowest one, in ms.
struct Joins {
  double per_s = 0;
  double slowest_ms = 0;
};

Joins joins(int port, double seconds) {
  dtensor::TcpStoreOptions o;
  o.token = "bench";
  o.timeout = std::chrono::seconds(10);
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration<double>(seconds);
  long n = 0;
  double slowest = 0;
  while (std::chrono::steady_clock::now() < until) {
    const auto t0 = std::chrono::steady_clock::now();
    dtensor::TcpStore rank("127.0.0.1", port, o);
    rank.get("k");
    slowest = std::max(
        slowest, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    ++n;
  }
  return {static_cast<double>(n) /
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
          slowest};
}

int flood(double seconds, const char* json) {
  dtensor::TcpStoreServerOptions so;
  so.token = "bench";
  so.max_connections = 512;
  dtensor::TcpStoreServer server(0, so);
  {
    dtensor::TcpStoreOptions o;
    o.token = "bench";
    dtensor::TcpStore("127.0.0.1", server.port(), o).set("k", std::string_view("v"));
  }
  std::atomic<bool> flooding{false};
  std::atomic<bool> done{false};
  std::atomic<long> strangers{0};
  std::thread attacker([&] {
    std::deque<tcp::Fd> open;
    std::vector<char> five(5, 'x');
    const std::uint32_t declared = 100;
    std::memcpy(five.data(), &declared, 4);
    while (!done.load()) {
      if (!flooding.load()) {
        open.clear();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      std::string error;
      bool refused = false;
      tcp::Fd fd = tcp::try_connect("127.0.0.1", server.port(), tcp::Clock::now() + std::chrono::seconds(1),
                                    error, refused);
      if (!fd) {
        continue;
      }
      int err = 0;
      [[maybe_unused]] auto r =
          tcp::send_all(fd.get(), five.data(), five.size(), tcp::Clock::now() + std::chrono::seconds(1), err);
      open.push_back(std::move(fd));
      strangers.fetch_add(1);
      if (open.size() > 1024) {
        open.pop_front();
      }
    }
  });
  const int rounds = 3;
  Joins quiet{}, flooded{};
  for (int i = 0; i < rounds; ++i) {
    flooding.store(false);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const Joins a = joins(server.port(), seconds / rounds);
    flooding.store(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(200)); // the flood fills the server first
    const Joins b = joins(server.port(), seconds / rounds);
    quiet.per_s += a.per_s / rounds;
    quiet.slowest_ms = std::max(quiet.slowest_ms, a.slowest_ms);
    flooded.per_s += b.per_s / rounds;
    flooded.slowest_ms = std::max(flooded.slowest_ms, b.slowest_ms);
  }
  done.store(true);
  attacker.join();
  const double flood_rate = static_cast<double>(strangers.load()) / (seconds / 2);
  std::printf("| ranks getting in (connect + hello + get) | per second | slowest |\n|---|---|---|\n");
  std::printf("| no flood | %.0f | %.2f ms |\n", quiet.per_s, quiet.slowest_ms);
  std::printf("| flood of strangers (%.0f connections/s, 5 bytes each) | %.0f | %.2f ms |\n", flood_rate,
              flooded.per_s, flooded.slowest_ms);
  if (json != nullptr) {
    if (FILE* f = std::fopen(json, "w")) {
      std::fprintf(f,
                   "{\"bench\": \"store_flood\", \"seconds\": %.3f, \"quiet\": {\"joins_per_s\": %.1f, "
                   "\"slowest_ms\": %.3f}, \"flood\": {\"strangers_per_s\": %.1f, \"joins_per_s\": %.1f, "
                   "\"slowest_ms\": %.3f}}\n",
                   seconds, quiet.per_s, quiet.slowest_ms, flood_rate, flooded.per_s, flooded.slowest_ms);
      std::fclose(f);
    }
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "flood") {
    return flood(argc > 2 ? std::atof(argv[2]) : 3.0, argc > 3 ? argv[3] : nullptr);
  }
  return idle_rate(argc > 1 ? std::atoi(argv[1]) : 5000, argc > 2 ? std::atof(argv[2]) : 2.0);
}
