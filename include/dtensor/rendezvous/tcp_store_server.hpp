#pragma once
// TcpStoreServer: the server half of TcpStore (torch's TCPStore master daemon): one map, served to any
// number of clients by one background thread (an epoll loop). Usually owned by a TcpStore constructed with
// is_server = true, or by dtensor-run.
//
//   // port 29500, or 0 for a free one (server.port() says which)
//   dtensor::TcpStoreServer server(29500, {.bind_host = "127.0.0.1", .token = "job-secret"});
//   dtensor::TcpStore client("127.0.0.1", server.port(), {.token = "job-secret"});
//
// Contract
//  - Binds with SO_REUSEADDR, so a port left in TIME_WAIT by a previous run is reused at once; throws
//    dtensor::Error naming the address when the port cannot be bound.
//  - Each request is handled atomically, in arrival order per connection: add and compare_set are atomic
//    read-modify-writes; set, add, compare_set (when it stores) and multi_set wake the waits they complete.
//  - A wait the server cannot complete in its time is answered "timeout"; the client names the keys.
//  - stop() (or destruction) closes every connection: clients see "the store is gone".
//  - What a client can make it do is bounded (TcpStoreServerOptions): a client must first send the job's
//    token, if the server has one (else it is refused with an error and disconnected); a request larger
//    than max_request_bytes, or more than that much pipelined behind a wait, is answered with an error and
//    the connection closed; a store holding max_total_bytes of keys and values refuses to grow; at
//    max_connections (or out of file descriptors) a connection is closed to admit the new one (clients
//    reconnect): the oldest that has not completed its hello, else the one idle the longest. The cost of a
//    request does not grow with the number of connections.
//  - Before its hello a connection is a stranger and is held to less (the hello is a few dozen bytes and
//    the token): its first request may declare at most max_hello_bytes (else it is refused at once, before
//    anything is read into memory); all strangers together hold at most max_unauthenticated_bytes (beyond,
//    the oldest of them with bytes held is closed); one that has not completed its hello within
//    hello_timeout is closed. So connections that never authenticate cannot fill the server's memory or
//    its descriptors, and a rank connecting during such a flood gets in.

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/detail/tcp.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtensor {

/// Options of a TcpStoreServer.
struct TcpStoreServerOptions {
  /// Interface address to listen on; empty: every interface.
  std::string bind_host;
  /// The job's token: a client must present it in its handshake. Empty: any client is served.
  std::string token;
  /// The largest request (a set's key and value; a multi_set's keys and values together).
  std::size_t max_request_bytes = std::size_t{64} << 20;
  /// The most bytes of keys and values the store holds.
  std::size_t max_total_bytes = std::size_t{1} << 30;
  /// The most open connections; beyond, the oldest stranger (no hello yet), else the one idle the longest,
  /// is closed.
  std::size_t max_connections = 16384;
  /// The most bytes a connection may send before its hello is complete.
  std::size_t max_hello_bytes = 4096;
  /// The most bytes all connections without a complete hello hold together.
  std::size_t max_unauthenticated_bytes = std::size_t{1} << 20;
  /// How long a connection may take from being accepted to completing its hello.
  std::chrono::milliseconds hello_timeout = std::chrono::seconds(10);
};

/// The server half of TcpStore (see the top of this file).
class TcpStoreServer {
public:
  /// Listens on `port` (0: a free one). Throws Error when the port cannot be bound (e.g. held by another
  /// live program).
  explicit TcpStoreServer(int port = 0, TcpStoreServerOptions options = {}) : options_(std::move(options)) {
    listener_ = detail::tcp::listen_on(options_.bind_host, port, port_);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error("dtensor TcpStore: pipe: " + detail::tcp::errno_text(errno));
    }
    wake_read_ = detail::tcp::Fd(pipe_fds[0]);
    wake_write_ = detail::tcp::Fd(pipe_fds[1]);
    epoll_ = detail::tcp::Fd(::epoll_create1(EPOLL_CLOEXEC));
    reserve_ = detail::tcp::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!epoll_ || !reserve_) {
      throw Error("dtensor TcpStore: epoll_create1 / open: " + detail::tcp::errno_text(errno));
    }
    watch(wake_read_.get(), EPOLLIN);
    watch(listener_.get(), EPOLLIN);
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
    bool greeted = false; // sent a valid hello (with the token, if any)
    bool waiting = false;
    bool closing = false; // close once `out` is sent; read nothing more
    bool dead = false;
    bool polling_out = false;
    bool dirty = false; // in dirty_
    std::vector<std::string> wait_keys;
    Clock::time_point deadline;
    Clock::time_point active;   // last request: the connection idle the longest is closed first
    Clock::time_point accepted; // for hello_timeout
    std::uint64_t serial = 0;   // which connection this is (a descriptor number is reused)
    std::size_t counted = 0;    // bytes of `in` counted in strangers_bytes_ (0 once greeted or dead)
  };

  /// A connection in accept order, until it greets or goes (see strangers_).
  struct Stranger {
    int fd;
    std::uint64_t serial;
  };

  static std::vector<char> reply(detail::tcp::Status s) {
    return std::move(detail::tcp::Writer().u8(static_cast<std::uint8_t>(s))).finish();
  }

  static std::vector<char> error_reply(const std::string& text) {
    return std::move(
               detail::tcp::Writer().u8(static_cast<std::uint8_t>(detail::tcp::Status::error)).str(text))
        .finish();
  }

  void watch(int fd, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev);
  }

  bool has_all(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return map_.contains(k); });
  }

  void queue(Client& c, const std::vector<char>& msg) {
    c.out.insert(c.out.end(), msg.begin(), msg.end());
    if (!c.dirty) {
      c.dirty = true;
      dirty_.push_back(c.fd.get());
    }
  }

  /// Answers `text` and closes the connection once it is sent.
  void refuse(Client& c, const std::string& text) {
    queue(c, error_reply(text));
    c.closing = true;
    c.in.clear();
  }

  std::size_t stored_size(const std::string& key) const {
    auto it = map_.find(key);
    return it == map_.end() ? 0 : key.size() + it->second.size();
  }

  /// True when storing `added` bytes in place of `removed` keeps the store within max_total_bytes; else
  /// answers an error.
  bool fits(Client& c, std::size_t removed, std::size_t added) {
    if (bytes_ - removed + added <= options_.max_total_bytes) {
      return true;
    }
    queue(c, error_reply("the store is full: it holds " + std::to_string(bytes_) + " bytes, storing " +
                         std::to_string(added) + " more would pass its limit of " +
                         std::to_string(options_.max_total_bytes) +
                         " (TcpStoreServerOptions::max_total_bytes)"));
    return false;
  }

  void store(std::string key, std::vector<char> value) {
    bytes_ = bytes_ - stored_size(key) + key.size() + value.size();
    map_[std::move(key)] = std::move(value);
  }

  /// Handles one request; returns false when the client must be dropped (protocol error).
  bool handle(Client& c, std::span<const char> body) {
    using detail::tcp::Cmd;
    using detail::tcp::Status;
    using detail::tcp::Writer;
    detail::tcp::Reader r(body);
    const auto cmd = static_cast<Cmd>(r.u8());
    if (!c.greeted && cmd != Cmd::hello) {
      return false; // not a client of this store, or one skipping the handshake
    }
    switch (cmd) {
    case Cmd::hello: {
      const std::uint32_t magic = r.u32();
      const std::uint32_t version = r.u32();
      if (magic != detail::tcp::kMagic) {
        return false;
      }
      if (version != detail::tcp::kVersion) {
        refuse(c, "store protocol version " + std::to_string(detail::tcp::kVersion) + " here, " +
                      std::to_string(version) + " in the client");
        return true;
      }
      if (!options_.token.empty() && !detail::tcp::same_token(r.str(), options_.token)) {
        refuse(c, "the store refused this client: wrong or missing job token (DTENSOR_STORE_TOKEN; "
                  "dtensor-run gives its ranks the job's token): is this another job's store?");
        return true;
      }
      c.greeted = true;
      queue(c, std::move(Writer()
                             .u8(0)
                             .u32(detail::tcp::kMagic)
                             .i64(static_cast<std::int64_t>(options_.max_request_bytes)))
                   .finish());
      return true;
    }
    case Cmd::set: {
      std::string key = r.str();
      std::vector<char> value = r.bytes();
      if (fits(c, stored_size(key), key.size() + value.size())) {
        store(std::move(key), std::move(value));
        queue(c, reply(Status::ok));
        wake_waiters();
      }
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
      if (timeout_ms < 1 || timeout_ms > kMaxTimeout.count()) { // from the network: checked before use
        queue(c, error_reply("wait: a timeout of " + std::to_string(timeout_ms) +
                             " ms is out of range (1 ms to 30 days)"));
      } else if (has_all(keys)) {
        queue(c, reply(Status::ok));
      } else {
        c.waiting = true;
        c.wait_keys = std::move(keys);
        c.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
        waiting_.insert(c.fd.get());
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
          queue(c, error_reply("add('" + key + "'): the current value is not an integer"));
          return true;
        }
      }
      value =
          static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(delta));
      const std::string text = std::to_string(value);
      if (fits(c, stored_size(key), key.size() + text.size())) {
        store(key, std::vector<char>(text.begin(), text.end()));
        queue(c, std::move(Writer().u8(0).i64(value)).finish());
        wake_waiters();
      }
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
      const std::string key = r.str();
      bytes_ -= stored_size(key);
      const bool erased = map_.erase(key) > 0;
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
      if (fits(c, stored_size(key), key.size() + desired.size())) {
        queue(c, std::move(Writer().u8(0).bytes(desired)).finish());
        store(std::move(key), std::move(desired));
        wake_waiters();
      }
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
      std::map<std::string, std::vector<char>> items; // a key given twice: the last value, as set in order
      for (std::uint32_t i = 0; i < n; ++i) {
        std::string key = r.str();
        items[std::move(key)] = r.bytes();
      }
      std::size_t removed = 0;
      std::size_t added = 0;
      for (const auto& [k, v] : items) {
        removed += stored_size(k);
        added += k.size() + v.size();
      }
      if (fits(c, removed, added)) { // parsed and checked completely first: a refused request changes nothing
        for (auto& [k, v] : items) {
          store(k, std::move(v));
        }
        queue(c, reply(Status::ok));
        wake_waiters();
      }
      return true;
    }
    }
    return false;
  }

  void wake_waiters() {
    for (int fd : waiting_) {
      Client& c = clients_.at(fd);
      if (has_all(c.wait_keys)) {
        c.waiting = false;
        c.wait_keys.clear();
        queue(c, reply(detail::tcp::Status::ok));
        released_.push_back(fd);
      }
    }
    std::erase_if(waiting_, [&](int fd) { return !clients_.at(fd).waiting; });
  }

  /// Parses every complete request in c.in. Returns false to drop the client.
  bool consume(Client& c) {
    std::size_t at = 0;
    bool ok = true;
    while (!c.waiting && !c.closing && c.in.size() - at >= 4) {
      std::uint32_t n;
      std::memcpy(&n, c.in.data() + at, 4);
      if (n == 0) {
        ok = false;
        break;
      }
      if (!c.greeted && n > options_.max_hello_bytes) {
        refuse(c, "a connection's first request must be its hello, of at most " +
                      std::to_string(options_.max_hello_bytes) + " bytes; this one declares " +
                      std::to_string(n) + " (TcpStoreServerOptions::max_hello_bytes)");
        return true;
      }
      if (n > options_.max_request_bytes) {
        refuse(c, "a request of " + std::to_string(n) + " bytes passes the store's limit of " +
                      std::to_string(options_.max_request_bytes) +
                      " (TcpStoreServerOptions::max_request_bytes)");
        return true;
      }
      if (c.in.size() - at - 4 < n) {
        break;
      }
      c.active = Clock::now();
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
    if (!c.closing) {
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(at));
    }
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

  void drop(Client& c) {
    if (!c.dead) {
      c.dead = true;
      dead_.push_back(c.fd.get());
    }
    recount(c);
  }

  /// Brings strangers_bytes_ up to date with what `c` holds.
  void recount(Client& c) {
    const std::size_t now = c.greeted || c.dead ? 0 : c.in.size();
    strangers_bytes_ = strangers_bytes_ - c.counted + now;
    c.counted = now;
  }

  /// The stranger entry's connection, when it is still open and has not greeted.
  Client* stranger(const Stranger& s) {
    auto it = clients_.find(s.fd);
    if (it == clients_.end() || it->second.serial != s.serial || it->second.greeted || it->second.dead) {
      return nullptr;
    }
    return &it->second;
  }

  /// The oldest connection without a complete hello (holding bytes, when `with_bytes`), or null. Entries of
  /// connections that greeted or went are forgotten on the way.
  Client* oldest_stranger(bool with_bytes) {
    while (!strangers_.empty() && stranger(strangers_.front()) == nullptr) {
      strangers_.pop_front();
    }
    for (const Stranger& s : strangers_) {
      Client* c = stranger(s);
      if (c != nullptr && (!with_bytes || !c->in.empty())) {
        return c;
      }
    }
    return nullptr;
  }

  /// Closes the oldest strangers holding bytes until all of them together hold at most
  /// max_unauthenticated_bytes.
  void limit_strangers() {
    while (strangers_bytes_ > options_.max_unauthenticated_bytes) {
      Client* c = oldest_stranger(/*with_bytes=*/true);
      if (c == nullptr) {
        return;
      }
      c->in.clear();
      drop(*c);
    }
  }

  /// Closes the connections that did not complete their hello within hello_timeout; returns the
  /// milliseconds until the next one may be due (-1: none).
  int expire_strangers() {
    const auto now = Clock::now();
    while (Client* c = oldest_stranger(/*with_bytes=*/false)) {
      if (now - c->accepted < options_.hello_timeout) {
        return detail::tcp::ms_until(c->accepted + options_.hello_timeout) + 1;
      }
      strangers_.pop_front();
      c->in.clear();
      drop(*c);
    }
    return -1;
  }

  /// Closes a connection now, to free its descriptor: the oldest that has not completed its hello (whatever
  /// it sent), else the one idle the longest (not waiting, nothing pending either way). False when every
  /// connection is authenticated and busy.
  bool evict_idlest() {
    if (Client* c = oldest_stranger(/*with_bytes=*/false)) {
      const int fd = c->fd.get();
      c->in.clear();
      recount(*c);
      strangers_.pop_front();
      clients_.erase(fd);
      return true;
    }
    Client* idlest = nullptr;
    for (auto& [fd, c] : clients_) {
      int unread = 0;
      if (c.dead || c.waiting || !c.out.empty() || !c.in.empty() || ::ioctl(fd, FIONREAD, &unread) != 0 ||
          unread > 0) { // a request on its way: closing would reset it under the client
        continue;
      }
      if (idlest == nullptr || std::pair(c.greeted, c.active) < std::pair(idlest->greeted, idlest->active)) {
        idlest = &c;
      }
    }
    if (idlest == nullptr) {
      return false;
    }
    const int fd = idlest->fd.get();
    waiting_.erase(fd);
    clients_.erase(fd); // closes it now: the descriptor is what the caller needs
    return true;
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 && errno == EINTR) {
        continue;
      }
      if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
        // Out of descriptors, the pending connection keeps the listener readable: without taking it the
        // loop would spin. Make room by closing the idlest connection; when none can go, take it with the
        // reserve descriptor and close it (the client retries).
        if (evict_idlest()) {
          continue;
        }
        reserve_.reset();
        const int refused = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (refused >= 0) {
          ::close(refused);
        }
        reserve_ = detail::tcp::Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        if (refused < 0) { // another thread of this process took the descriptor: listen again a bit later
          ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listener_.get(), nullptr);
          listener_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
          return;
        }
        continue;
      }
      if (fd < 0) {
        return; // EAGAIN: no more pending connections
      }
      if (clients_.size() >= options_.max_connections && !evict_idlest()) {
        ::close(fd); // every connection is authenticated and busy: this one retries
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Client& c = clients_[fd];
      c.fd = detail::tcp::Fd(fd);
      c.active = Clock::now();
      c.accepted = c.active;
      c.serial = ++serial_;
      strangers_.push_back({fd, c.serial});
      watch(fd, EPOLLIN);
    }
  }

  void read_from(Client& c) {
    char buf[65536];
    for (;;) {
      // Before its hello a connection is read no further than its first request, which consume() refuses
      // at its header when it declares more than max_hello_bytes.
      const std::size_t hello_frame = options_.max_hello_bytes + 4;
      const std::size_t room =
          c.greeted || c.closing
              ? sizeof(buf)
              : std::min(sizeof(buf), hello_frame - std::min(c.in.size(), hello_frame - 1));
      const ssize_t k = ::recv(c.fd.get(), buf, room, MSG_DONTWAIT);
      if (k > 0) {
        if (c.closing) {
          if (!c.greeted) {
            break; // a refused stranger: its error goes out and it is closed (settle), its rest unread
          }
          continue; // discarded: a refused client's rest
        }
        c.in.insert(c.in.end(), buf, buf + k);
        if (!c.greeted) {
          if (!consume(c)) { // the hello, and what was sent behind it
            drop(c);
            return;
          }
          recount(c);
          limit_strangers();
          if (c.dead) {
            return;
          }
          continue;
        }
        // Requests pipelined behind a wait are kept, within a bound.
        if (c.in.size() > 2 * options_.max_request_bytes + 8) {
          refuse(c, "more than " + std::to_string(2 * options_.max_request_bytes) +
                        " bytes of requests pipelined (TcpStoreServerOptions::max_request_bytes)");
        }
        continue;
      }
      if (k < 0 && errno == EINTR) {
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      }
      drop(c); // closed or failed
      return;
    }
    if (!consume(c)) {
      drop(c);
    }
    recount(c);
  }

  /// Sends what the clients in dirty_ have queued, closes the finished and the dead.
  void settle() {
    // Released waiters may have requests pipelined behind their wait; handling them may release others.
    while (!released_.empty()) {
      const int fd = released_.back();
      released_.pop_back();
      auto it = clients_.find(fd);
      if (it != clients_.end() && !it->second.dead && !consume(it->second)) {
        drop(it->second);
      }
    }
    for (int fd : std::exchange(dirty_, {})) {
      auto it = clients_.find(fd);
      if (it == clients_.end()) {
        continue;
      }
      Client& c = it->second;
      c.dirty = false;
      if (c.dead) {
        continue;
      }
      if (!flush(c) || (c.closing && c.out.empty())) {
        drop(c);
        continue;
      }
      const bool want_out = !c.out.empty();
      if (want_out != c.polling_out) {
        epoll_event ev{};
        ev.events = EPOLLIN | (want_out ? EPOLLOUT : 0u);
        ev.data.fd = fd;
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev);
        c.polling_out = want_out;
      }
    }
    for (int fd : std::exchange(dead_, {})) {
      waiting_.erase(fd);
      clients_.erase(fd); // closing removes it from the epoll set
    }
  }

  /// Answers the waits past their deadline; returns the milliseconds until the next one (-1: none).
  int expire_waits() {
    const auto now = Clock::now();
    int timeout_ms = -1;
    for (int fd : waiting_) {
      Client& c = clients_.at(fd);
      if (c.deadline <= now) {
        c.waiting = false;
        c.wait_keys.clear();
        queue(c, reply(detail::tcp::Status::timeout));
        released_.push_back(fd);
      } else {
        const int ms = detail::tcp::ms_until(c.deadline) + 1;
        timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
      }
    }
    std::erase_if(waiting_, [&](int fd) { return !clients_.at(fd).waiting; });
    return timeout_ms;
  }

  void loop() {
    std::vector<epoll_event> events(256);
    for (;;) {
      int timeout_ms = expire_waits();
      if (const int ms = expire_strangers(); ms >= 0) {
        timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
      }
      if (listener_paused_until_) {
        if (Clock::now() >= *listener_paused_until_) {
          listener_paused_until_.reset();
          watch(listener_.get(), EPOLLIN);
        } else {
          const int ms = detail::tcp::ms_until(*listener_paused_until_) + 1;
          timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
        }
      }
      settle();
      const int n = ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), timeout_ms);
      if (n < 0 && errno != EINTR) {
        return; // nothing sensible left to do
      }
      for (int i = 0; i < n; ++i) {
        const int fd = events[static_cast<std::size_t>(i)].data.fd;
        if (fd == wake_read_.get() || stopping_.load()) {
          for (auto& [cfd, c] : clients_) { // best effort: replies already decided go out
            flush(c);
          }
          return;
        }
        if (fd == listener_.get()) {
          accept_all();
          continue;
        }
        auto it = clients_.find(fd);
        if (it == clients_.end() || it->second.dead) {
          continue; // closed earlier in this batch
        }
        const std::uint32_t ev = events[static_cast<std::size_t>(i)].events;
        if ((ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0) {
          read_from(it->second);
        }
        if ((ev & EPOLLOUT) != 0 && !it->second.dirty) {
          it->second.dirty = true;
          dirty_.push_back(fd);
        }
      }
    }
  }

  TcpStoreServerOptions options_;
  detail::tcp::Fd listener_;
  detail::tcp::Fd wake_read_;
  detail::tcp::Fd wake_write_;
  detail::tcp::Fd epoll_;
  detail::tcp::Fd reserve_; // closed to accept (and refuse) one connection when out of descriptors
  std::optional<Clock::time_point> listener_paused_until_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::unordered_map<int, Client> clients_;
  std::deque<Stranger> strangers_;  // accepted connections in order, until they greet or go
  std::size_t strangers_bytes_ = 0; // what connections without a complete hello hold
  std::uint64_t serial_ = 0;
  std::set<int> waiting_;
  std::vector<int> dirty_;
  std::vector<int> released_;
  std::vector<int> dead_;
  std::map<std::string, std::vector<char>> map_;
  std::size_t bytes_ = 0; // keys and values in map_
  std::thread thread_;
};

} // namespace dtensor
