#pragma once
// TcpStoreServer: the server half of TcpStore (torch's TCPStore master daemon): one map, served to any
// number of clients by one background thread (a poll loop). Usually owned by a TcpStore constructed with
// is_server = true, or by dtensor-run.
//
//   dtensor::TcpStoreServer server(29500);               // or 0: a free port, see port()
//   dtensor::TcpStore client("127.0.0.1", server.port());
//
// Contract
//  - Binds with SO_REUSEADDR, so a port left in TIME_WAIT by a previous run is reused at once; throws
//    dtensor::Error naming the address when the port cannot be bound.
//  - Each request is handled atomically, in arrival order per connection: add and compare_set are atomic
//    read-modify-writes; set, add, compare_set (when it stores) and multi_set wake the waits they complete.
//  - A wait the server cannot complete in its time is answered "timeout"; the client names the keys.
//  - stop() (or destruction) closes every connection: clients see "the store is gone".

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/detail/tcp.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtensor {

/// The server half of TcpStore (see the top of this file).
class TcpStoreServer {
public:
  /// Listens on `port` (0: a free one) of every interface, or of `bind_host` when it is not empty.
  /// Throws Error when the port cannot be bound (e.g. held by another live program).
  explicit TcpStoreServer(int port = 0, const std::string& bind_host = "") {
    listener_ = detail::tcp::listen_on(bind_host, port, port_);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error("dtensor TcpStore: pipe: " + detail::tcp::errno_text(errno));
    }
    wake_read_ = detail::tcp::Fd(pipe_fds[0]);
    wake_write_ = detail::tcp::Fd(pipe_fds[1]);
    thread_ = std::thread([this] { loop(); });
  }

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  ~TcpStoreServer() { stop(); }

  /// The port it listens on (the one chosen when constructed with 0).
  int port() const noexcept { return port_; }

  /// Stops serving and closes every connection (clients see "the store is gone"). Idempotent.
  void stop() {
    if (stopping_.exchange(true)) {
      if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
        thread_.join();
      }
      return;
    }
    const char c = 0;
    [[maybe_unused]] auto n = ::write(wake_write_.get(), &c, 1);
    if (thread_.joinable()) {
      thread_.join();
    }
  }

private:
  using Clock = detail::tcp::Clock;

  struct Client {
    detail::tcp::Fd fd;
    std::vector<char> in;
    std::vector<char> out;
    bool waiting = false;
    std::vector<std::string> wait_keys;
    Clock::time_point deadline;
  };

  static std::vector<char> reply(detail::tcp::Status s) {
    return std::move(detail::tcp::Writer().u8(static_cast<std::uint8_t>(s))).finish();
  }

  bool has_all(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return map_.contains(k); });
  }

  void queue(Client& c, const std::vector<char>& msg) { c.out.insert(c.out.end(), msg.begin(), msg.end()); }

  /// Handles one request; returns false when the client must be dropped (protocol error).
  bool handle(Client& c, std::span<const char> body) {
    using detail::tcp::Cmd;
    using detail::tcp::Status;
    using detail::tcp::Writer;
    detail::tcp::Reader r(body);
    const auto cmd = static_cast<Cmd>(r.u8());
    switch (cmd) {
    case Cmd::hello: {
      const std::uint32_t magic = r.u32();
      const std::uint32_t version = r.u32();
      if (magic != detail::tcp::kMagic) {
        return false;
      }
      if (version != detail::tcp::kVersion) {
        queue(c, std::move(Writer()
                               .u8(static_cast<std::uint8_t>(Status::error))
                               .str("store protocol version " + std::to_string(detail::tcp::kVersion) +
                                    " here, " + std::to_string(version) + " in the client"))
                     .finish());
        return true;
      }
      queue(c, std::move(Writer().u8(0).u32(detail::tcp::kMagic)).finish());
      return true;
    }
    case Cmd::set: {
      std::string key = r.str();
      map_[std::move(key)] = r.bytes();
      queue(c, reply(Status::ok));
      wake_waiters();
      return true;
    }
    case Cmd::get: {
      auto it = map_.find(r.str());
      if (it == map_.end()) {
        queue(c, reply(Status::missing));
      } else {
        queue(c, std::move(Writer().u8(0).bytes(it->second)).finish());
      }
      return true;
    }
    case Cmd::wait: {
      const std::uint32_t n = r.u32();
      std::vector<std::string> keys;
      for (std::uint32_t i = 0; i < n; ++i) {
        keys.push_back(r.str());
      }
      const std::int64_t timeout_ms = r.i64();
      if (has_all(keys)) {
        queue(c, reply(Status::ok));
      } else {
        c.waiting = true;
        c.wait_keys = std::move(keys);
        // From the network: clamped, so the deadline cannot overflow whatever a client sends.
        c.deadline = Clock::now() +
                     std::chrono::milliseconds(std::clamp<std::int64_t>(timeout_ms, 0, kMaxTimeout.count()));
      }
      return true;
    }
    case Cmd::add: {
      const std::string key = r.str();
      const std::int64_t delta = r.i64();
      std::int64_t value = 0;
      if (auto it = map_.find(key); it != map_.end()) {
        try {
          value = std::stoll(std::string(it->second.begin(), it->second.end()));
        } catch (...) {
          queue(c, std::move(Writer()
                                 .u8(static_cast<std::uint8_t>(Status::error))
                                 .str("add('" + key + "'): the current value is not an integer"))
                       .finish());
          return true;
        }
      }
      value =
          static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(delta));
      const std::string text = std::to_string(value);
      map_[key] = std::vector<char>(text.begin(), text.end());
      queue(c, std::move(Writer().u8(0).i64(value)).finish());
      wake_waiters();
      return true;
    }
    case Cmd::check: {
      const std::uint32_t n = r.u32();
      bool all = true;
      for (std::uint32_t i = 0; i < n; ++i) {
        all = map_.contains(r.str()) && all;
      }
      queue(c, std::move(Writer().u8(0).u8(all ? 1 : 0)).finish());
      return true;
    }
    case Cmd::erase: {
      const bool erased = map_.erase(r.str()) > 0;
      queue(c, std::move(Writer().u8(0).u8(erased ? 1 : 0)).finish());
      return true;
    }
    case Cmd::num_keys:
      queue(c, std::move(Writer().u8(0).i64(static_cast<std::int64_t>(map_.size()))).finish());
      return true;
    case Cmd::compare_set: {
      std::string key = r.str();
      std::vector<char> expected = r.bytes();
      std::vector<char> desired = r.bytes();
      auto it = map_.find(key);
      if (it == map_.end() && !expected.empty()) {
        queue(c, std::move(Writer().u8(0).bytes(expected)).finish());
        return true;
      }
      if (it != map_.end() && it->second != expected) {
        queue(c, std::move(Writer().u8(0).bytes(it->second)).finish());
        return true;
      }
      queue(c, std::move(Writer().u8(0).bytes(desired)).finish());
      map_[std::move(key)] = std::move(desired);
      wake_waiters();
      return true;
    }
    case Cmd::multi_get: {
      const std::uint32_t n = r.u32();
      std::vector<const std::vector<char>*> values;
      for (std::uint32_t i = 0; i < n; ++i) {
        auto it = map_.find(r.str());
        if (it == map_.end()) {
          queue(c, reply(Status::missing));
          return true;
        }
        values.push_back(&it->second);
      }
      Writer w;
      w.u8(0).u32(n);
      for (const auto* v : values) {
        w.bytes(*v);
      }
      queue(c, std::move(w).finish());
      return true;
    }
    case Cmd::multi_set: {
      const std::uint32_t n = r.u32();
      std::vector<std::pair<std::string, std::vector<char>>> items;
      for (std::uint32_t i = 0; i < n; ++i) {
        std::string key = r.str();
        items.emplace_back(std::move(key), r.bytes());
      }
      for (auto& [k, v] : items) { // parsed completely first: a malformed request changes nothing
        map_[std::move(k)] = std::move(v);
      }
      queue(c, reply(Status::ok));
      wake_waiters();
      return true;
    }
    }
    return false;
  }

  void wake_waiters() {
    for (auto& [fd, c] : clients_) {
      if (c.waiting && has_all(c.wait_keys)) {
        c.waiting = false;
        c.wait_keys.clear();
        queue(c, reply(detail::tcp::Status::ok));
      }
    }
  }

  /// Parses every complete request in c.in. Returns false to drop the client.
  bool consume(Client& c) {
    std::size_t at = 0;
    bool ok = true;
    while (!c.waiting && c.in.size() - at >= 4) {
      std::uint32_t n;
      std::memcpy(&n, c.in.data() + at, 4);
      if (n > detail::tcp::kMaxMessage || n == 0) {
        ok = false;
        break;
      }
      if (c.in.size() - at - 4 < n) {
        break;
      }
      try {
        ok = handle(c, std::span<const char>(c.in.data() + at + 4, n));
      } catch (const std::exception&) {
        ok = false;
      }
      at += 4 + n;
      if (!ok) {
        break;
      }
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(at));
    return ok;
  }

  /// Writes what it can of c.out. Returns false on a dead connection.
  static bool flush(Client& c) {
    while (!c.out.empty()) {
      const ssize_t k = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        c.out.erase(c.out.begin(), c.out.begin() + k);
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return true;
      } else {
        return false;
      }
    }
    return true;
  }

  void loop() {
    std::vector<pollfd> pfds;
    for (;;) {
      // Expire waits and compute the next deadline.
      const auto now = Clock::now();
      int timeout_ms = -1;
      for (auto& [fd, c] : clients_) {
        if (!c.waiting) {
          continue;
        }
        if (c.deadline <= now) {
          c.waiting = false;
          c.wait_keys.clear();
          queue(c, reply(detail::tcp::Status::timeout));
          if (!consume(c)) { // requests pipelined behind the wait
            c.fd.reset();
          }
        } else {
          const int ms = detail::tcp::ms_until(c.deadline) + 1;
          timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
        }
      }
      for (auto& [fd, c] : clients_) {
        if (c.fd && !flush(c)) {
          c.fd.reset();
        }
      }
      std::erase_if(clients_, [](const auto& kv) { return !kv.second.fd; });

      pfds.clear();
      pfds.push_back({wake_read_.get(), POLLIN, 0});
      pfds.push_back({listener_.get(), POLLIN, 0});
      for (auto& [fd, c] : clients_) {
        pfds.push_back({fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      }
      const int r = ::poll(pfds.data(), pfds.size(), timeout_ms);
      if (r < 0 && errno != EINTR) {
        return; // nothing sensible left to do
      }
      if (stopping_.load() || (pfds[0].revents & POLLIN) != 0) {
        for (auto& [fd, c] : clients_) { // best effort: replies already decided go out
          if (c.fd) {
            flush(c);
          }
        }
        return;
      }
      if ((pfds[1].revents & POLLIN) != 0) {
        for (;;) {
          const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) {
            break;
          }
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          clients_[fd].fd = detail::tcp::Fd(fd);
        }
      }
      for (std::size_t i = 2; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) {
          continue;
        }
        auto it = clients_.find(pfds[i].fd);
        if (it == clients_.end() || !it->second.fd) {
          continue;
        }
        Client& c = it->second;
        bool alive = true;
        if ((pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
          char buf[65536];
          for (;;) {
            const ssize_t k = ::recv(c.fd.get(), buf, sizeof(buf), MSG_DONTWAIT);
            if (k > 0) {
              c.in.insert(c.in.end(), buf, buf + k);
              continue;
            }
            if (k < 0 && errno == EINTR) {
              continue;
            }
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
              break;
            }
            alive = false; // closed or failed
            break;
          }
          if (alive) {
            alive = consume(c);
          }
        }
        if (!alive) {
          c.fd.reset();
        }
      }
      // Sets may have released waiters whose own pipelined requests are now parseable.
      for (auto& [fd, c] : clients_) {
        if (c.fd && !c.waiting && !c.in.empty() && !consume(c)) {
          c.fd.reset();
        }
      }
    }
  }

  detail::tcp::Fd listener_;
  detail::tcp::Fd wake_read_;
  detail::tcp::Fd wake_write_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::map<int, Client> clients_;
  std::map<std::string, std::vector<char>> map_;
  std::thread thread_;
};

} // namespace dtensor
