#pragma once
// TcpStore: the Store of a multi-process job, over TCP (torch.distributed.TCPStore for C++).
//
//   // rank 0 (or dtensor-run) hosts the server; everybody, the host included, is a client
//   dtensor::TcpStore store("10.0.0.1", 29500, {.is_server = rank == 0, .timeout =
//   std::chrono::seconds(60)}); store.set("addr/3", bytes); auto v = store.get("addr/0");            // waits
//   (up to the timeout) until some rank set it std::int64_t n = store.add("joined", 1); // atomic counter:
//   the new value
//
// Contract (besides Store's)
//  - Clients may start before the server: connecting retries (with backoff) until the timeout; only then
//    it throws TimeoutError naming the address, the last socket error and what to check. A peer that
//    accepts the connection but never answers the handshake is reported the same way.
//  - Every verb is one request to the server (get and multi_get: a wait, then the read), so add and
//    compare_set are atomic across all clients.
//  - Thread safe. Each concurrent call uses its own connection (a small pool), so a thread blocked in
//    wait() never delays a set() from another thread of the same process.
//  - With is_server, the server (rendezvous/tcp_store_server.hpp) runs on a background thread of this
//    process and stops when this TcpStore is destroyed.
//  - Once the store has served this client, losing it is final: a fresh connection it closes mid-request,
//    or a reconnect it refuses, makes this call and every later one throw Error at once ("the store is
//    gone (...; its host, rank 0, probably exited or was killed)") instead of each call retrying for the
//    whole timeout (a failing rank's peers ask the store several times why it failed). A pooled connection
//    the server closed (at its connection cap it closes the idlest) is replaced, and the request sent
//    again when it may run twice (all but add, compare_set and delete_key, which throw Error instead).

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/detail/tcp.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <poll.h>

namespace dtensor {

/// Options of a TcpStore.
struct TcpStoreOptions {
  /// Host the server in this process (on `port`, 0: a free one) and connect to it through loopback.
  bool is_server = false;
  /// Limit of every blocking call: connecting (including waiting for the server to come up), get and wait.
  std::chrono::milliseconds timeout = kDefaultStoreTimeout;
  /// Interface address the server binds to; empty: all interfaces.
  std::string bind_host;
  /// The job's token, sent in the handshake (and required by the server this TcpStore hosts, if any); a
  /// server with another token refuses the client at once. Empty: none (accepted only by a server without
  /// one).
  std::string token;
  /// Who hosts the server, for the message when it is gone (e.g. "rank 0", "dtensor-run on node 0").
  std::string server_owner = "rank 0 or dtensor-run";
};

/// Client of a TcpStoreServer (and, with is_server, its owner). See the top of this file.
class TcpStore final : public Store {
public:
  using Clock = detail::tcp::Clock;

  /// Connects to host:port, retrying until options.timeout; throws TimeoutError (with the address and
  /// the last socket error) when nothing answers in time. With options.is_server, first starts a server
  /// on `port`; port() then gives the port it got.
  TcpStore(std::string host, int port, TcpStoreOptions options = {})
      : Store(options.timeout), host_(std::move(host)), port_(port), owner_(std::move(options.server_owner)),
        token_(std::move(options.token)) {
    if (options.is_server) {
      TcpStoreServerOptions so;
      so.bind_host = options.bind_host;
      so.token = token_;
      server_ = std::make_shared<TcpStoreServer>(port, std::move(so));
      port_ = server_->port();
      connect_host_ = "127.0.0.1";
      if (!options.bind_host.empty()) {
        connect_host_ = options.bind_host;
      }
    } else {
      connect_host_ = host_;
    }
    release(connect(Clock::now() + timeout(), "connect"));
  }

  const std::string& host() const noexcept { return host_; }
  int port() const noexcept { return port_; }
  bool is_server() const noexcept { return server_ != nullptr; }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const std::vector<char>& value) override {
    const std::string what = "set('" + key + "')";
    expect_ok(call(std::move(detail::tcp::Writer().u8(cmd(Cmd::set)).str(key).bytes(value)).finish(),
                   timeout(), what),
              what);
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    auto v = try_get(key);
    if (!v) {
      throw Error(describe() + ": key '" + key + "' was deleted between wait and get");
    }
    return std::move(*v);
  }

  /// One request: the value of `key` if it is set now.
  std::optional<std::vector<char>> try_get(const std::string& key) override {
    const std::string what = "get('" + key + "')";
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::get)).str(key)).finish(), timeout(), what);
    detail::tcp::Reader r(body);
    const auto s = static_cast<Status>(r.u8());
    if (s == Status::missing) {
      return std::nullopt;
    }
    check_status(s, r, what);
    return r.bytes();
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    detail::check_timeout(timeout, describe() + ": wait(" + detail::quoted_keys(keys) + ")");
    detail::tcp::Writer w;
    w.u8(cmd(Cmd::wait)).u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) {
      w.str(k);
    }
    w.i64(timeout.count());
    const std::string what = "wait(" + detail::quoted_keys(keys) + ")";
    // The server answers "timeout" itself; the client allows it a little longer before giving up.
    auto body = call(std::move(w).finish(), timeout + std::chrono::seconds(10), what);
    detail::tcp::Reader r(body);
    const auto s = static_cast<Status>(r.u8());
    if (s == Status::timeout) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!check({k})) {
          missing.push_back(k);
        }
      }
      throw TimeoutError(
          detail::store_timeout_message(describe(), timeout, missing.empty() ? keys : missing) +
          " (a rank did not arrive, or arrived with another MASTER_ADDR/MASTER_PORT or "
          "WORLD_SIZE)");
    }
    check_status(s, r, what);
  }

  bool check(const std::vector<std::string>& keys) override {
    detail::tcp::Writer w;
    w.u8(cmd(Cmd::check)).u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) {
      w.str(k);
    }
    auto body = call(std::move(w).finish(), timeout(), "check");
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, "check");
    return r.u8() != 0;
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    const std::string what = "add('" + key + "')";
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::add)).str(key).i64(delta)).finish(),
                     timeout(), what, false);
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, what);
    return r.i64();
  }

  std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                const std::vector<char>& desired) override {
    const std::string what = "compare_set('" + key + "')";
    auto body = call(
        std::move(detail::tcp::Writer().u8(cmd(Cmd::compare_set)).str(key).bytes(expected).bytes(desired))
            .finish(),
        timeout(), what, false);
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, what);
    return r.bytes();
  }

  bool delete_key(const std::string& key) override {
    const std::string what = "delete_key('" + key + "')";
    auto body =
        call(std::move(detail::tcp::Writer().u8(cmd(Cmd::erase)).str(key)).finish(), timeout(), what, false);
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, what);
    return r.u8() != 0;
  }

  std::int64_t num_keys() override {
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::num_keys))).finish(), timeout(), "num_keys");
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, "num_keys");
    return r.i64();
  }

  /// A wait, then one request for every value.
  std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) override {
    wait(keys);
    const std::string what = "multi_get(" + detail::quoted_keys(keys) + ")";
    detail::tcp::Writer w;
    w.u8(cmd(Cmd::multi_get)).u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) {
      w.str(k);
    }
    auto body = call(std::move(w).finish(), timeout(), what);
    detail::tcp::Reader r(body);
    const auto s = static_cast<Status>(r.u8());
    if (s == Status::missing) {
      throw Error(describe() + ": " + what + ": a key was deleted between wait and get");
    }
    check_status(s, r, what);
    const std::uint32_t n = r.u32();
    std::vector<std::vector<char>> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) {
      out.push_back(r.bytes());
    }
    return out;
  }

  /// One request: every key is set before any waiter is woken.
  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<char>>& values) override {
    check_same_size(keys, values, "multi_set");
    const std::string what = "multi_set(" + detail::quoted_keys(keys) + ")";
    detail::tcp::Writer w;
    w.u8(cmd(Cmd::multi_set)).u32(static_cast<std::uint32_t>(keys.size()));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      w.str(keys[i]).bytes(values[i]);
    }
    expect_ok(call(std::move(w).finish(), timeout(), what), what);
  }

  std::string describe() const override { return "dtensor TcpStore " + host_ + ":" + std::to_string(port_); }

  /// store_barrier (rendezvous/barrier.hpp) through this store; the process hosting the server waits
  /// until every caller has been released, so it may exit right after.
  void barrier(const std::string& name, int world_size, std::chrono::milliseconds timeout) {
    store_barrier(*this, name, world_size, timeout, is_server());
  }

private:
  using Cmd = detail::tcp::Cmd;
  using Status = detail::tcp::Status;

  static std::uint8_t cmd(Cmd c) { return static_cast<std::uint8_t>(c); }

  void check_status(Status s, detail::tcp::Reader& r, const std::string& what) const {
    if (s == Status::ok) {
      return;
    }
    if (s == Status::error) {
      throw Error(describe() + ": " + what + ": " + r.str());
    }
    throw Error(describe() + ": " + what + ": unexpected reply status " +
                std::to_string(static_cast<int>(s)));
  }

  void expect_ok(const std::vector<char>& body, const std::string& what) const {
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, what);
  }

  /// Marks the store gone (the first reason sticks) and returns the Error text for `what`.
  std::string gone(const std::string& what, const std::string& reason) {
    std::lock_guard lock(pool_mutex_);
    if (!gone_) {
      gone_ = "the store is gone (" + reason + "; its host, " + owner_ + ", probably exited or was killed)";
      pool_.clear();
    }
    return describe() + ": " + what + ": " + *gone_;
  }

  /// A connected, handshaken socket; retries until `deadline` (only while the store never served this
  /// client: later, a refusal means it is gone).
  detail::tcp::Fd connect(Clock::time_point deadline, const std::string& what) {
    using namespace std::chrono_literals;
    std::string last = "no attempt made";
    auto backoff = 10ms;
    int attempts = 0;
    for (;;) {
      ++attempts;
      bool refused = false;
      detail::tcp::Fd fd = detail::tcp::try_connect(connect_host_, port_, deadline, last, refused);
      if (refused && served_.load()) {
        throw Error(gone(what, "it refuses connections"));
      }
      if (fd) {
        std::vector<char> reply;
        int err = 0;
        const auto hello = std::move(detail::tcp::Writer()
                                         .u8(cmd(Cmd::hello))
                                         .u32(detail::tcp::kMagic)
                                         .u32(detail::tcp::kVersion)
                                         .str(token_))
                               .finish();
        const auto hs_deadline = std::max(deadline, Clock::now() + 1s);
        const auto r = detail::tcp::round_trip(fd.get(), hello, hs_deadline, reply, err);
        if (r == detail::tcp::IoResult::ok) {
          detail::tcp::Reader rd(reply);
          const auto s = static_cast<Status>(rd.u8());
          if (s == Status::error) {
            throw Error(describe() + ": " + rd.str());
          }
          if (s == Status::ok && rd.u32() == detail::tcp::kMagic) {
            max_request_.store(rd.i64());
            served_.store(true);
            return fd;
          }
          last = "the peer is not a dtensor store (unexpected handshake reply)";
        } else if (r == detail::tcp::IoResult::timeout) {
          last = "connected, but the peer did not answer the store handshake (is something else listening "
                 "on this port?)";
        } else {
          last = "connection closed during the handshake" +
                 (err != 0 ? ": " + detail::tcp::errno_text(err) : "");
        }
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError(describe() + ": could not reach the store within " +
                           std::to_string(timeout().count()) + " ms (" + std::to_string(attempts) +
                           " attempts; last error: " + last +
                           "). Check MASTER_ADDR and MASTER_PORT, that rank 0 (or dtensor-run on node 0) is "
                           "running, and that no firewall blocks the port.");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, 1000ms);
    }
  }

  /// A pooled connection the store still holds open (`pooled` set), else a new one; Error at once when the
  /// store is gone.
  detail::tcp::Fd acquire(const std::string& what, bool& pooled) {
    {
      std::lock_guard lock(pool_mutex_);
      if (gone_) {
        throw Error(describe() + ": " + what + ": " + *gone_);
      }
      while (!pool_.empty()) {
        detail::tcp::Fd fd = std::move(pool_.back());
        pool_.pop_back();
        // An idle connection has nothing to read: readable means the server closed it.
        pollfd pfd{fd.get(), POLLIN | POLLRDHUP, 0};
        if (::poll(&pfd, 1, 0) == 0) {
          pooled = true;
          return fd;
        }
      }
    }
    return connect(Clock::now() + timeout(), what);
  }

  void release(detail::tcp::Fd fd) {
    std::lock_guard lock(pool_mutex_);
    if (pool_.size() < 4) {
      pool_.push_back(std::move(fd));
    }
  }

  /// Sends one request on a pooled connection and returns the reply body. When the server closed a pooled
  /// connection just as the request went out (at its connection cap it closes the idlest), the request is
  /// sent again on a new connection if it may run twice (`repeatable`); a store that refuses the new
  /// connection is gone.
  std::vector<char> call(const std::vector<char>& request, std::chrono::milliseconds limit,
                         const std::string& what, bool repeatable = true) {
    // Checked here too: the server would answer with an error and close the connection mid-send.
    if (static_cast<std::int64_t>(request.size() - 4) > max_request_.load()) {
      throw Error(describe() + ": " + what + ": a request of " + std::to_string(request.size() - 4) +
                  " bytes passes the store's limit of " + std::to_string(max_request_.load()) +
                  " (TcpStoreServerOptions::max_request_bytes)");
    }
    bool pooled = false;
    detail::tcp::Fd fd = acquire(what, pooled);
    for (;;) {
      std::vector<char> reply;
      int err = 0;
      const auto r = detail::tcp::round_trip(fd.get(), request, Clock::now() + limit, reply, err);
      switch (r) {
      case detail::tcp::IoResult::ok:
        release(std::move(fd));
        return reply;
      case detail::tcp::IoResult::timeout:
        throw TimeoutError(describe() + ": " + what + ": no reply within " + std::to_string(limit.count()) +
                           " ms");
      case detail::tcp::IoResult::closed:
        if (!pooled) {
          throw Error(gone(what, "it closed the connection"));
        }
        fd = connect(Clock::now() + timeout(), what);
        pooled = false;
        if (!repeatable) {
          release(std::move(fd));
          throw Error(describe() + ": " + what +
                      ": the store closed the connection before answering; it is up, but the request may "
                      "or may not have taken effect");
        }
        continue;
      case detail::tcp::IoResult::failed:
        break;
      }
      throw Error(describe() + ": " + what + ": " + detail::tcp::errno_text(err));
    }
  }

  std::string host_;
  std::string connect_host_;
  int port_;
  std::string owner_;
  std::string token_;
  std::shared_ptr<TcpStoreServer> server_;
  std::atomic<std::int64_t> max_request_{0};
  std::atomic<bool> served_{false};
  std::mutex pool_mutex_;
  std::vector<detail::tcp::Fd> pool_;
  std::optional<std::string> gone_;
};

} // namespace dtensor
