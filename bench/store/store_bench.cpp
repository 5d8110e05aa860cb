// The TCP store's request rate while other connections sit idle (issue 18: the server used to scan every
// connection per request). One server in this process, `idle` plain TCP connections that never send, and
// one client doing set + get of a small key for `seconds`:
//
//   bench_store [idle=5000] [seconds=2]      prints "idle 5000: 4100 ops/s"
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const int idle = argc > 1 ? std::atoi(argv[1]) : 5000;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 2.0;
  dtensor::TcpStoreServer server(0);
  std::vector<dtensor::detail::tcp::Fd> conns;
  std::string error;
  bool refused = false;
  for (int i = 0; i < idle; ++i) {
    auto fd = dtensor::detail::tcp::try_connect("127.0.0.1", server.port(),
                                                dtensor::detail::tcp::Clock::now() + std::chrono::seconds(5),
                                                error, refused);
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
