#pragma once
// TcpStore: the key-value store processes rendezvous through (torch.distributed.TCPStore for C++).
//
//   // rank 0 (or dtensor-run) hosts it; everybody, the host included, is a client
//   dtensor::TcpStore store("10.0.0.1", 29500, {.is_server = rank == 0, .timeout =
//   std::chrono::seconds(60)}); store.set("addr/3", bytes); auto v = store.get("addr/0");            // waits
//   (up to the timeout) until some rank set it std::int64_t n = store.add("joined", 1); // atomic counter,
//   returns the new value
//
// Contract
//  - Keys are strings, values bytes. set() overwrites; get() and wait() block until the key(s) exist or
//    the timeout passes (then TimeoutError naming the keys); add() treats a missing key as 0 and stores the
//    decimal text of the sum, like torch.
//  - Clients may start before the server: connecting retries (with backoff) until the timeout; only then
//    it throws TimeoutError naming the address, the last socket error and what to check. A peer that
//    accepts the connection but never answers the handshake is reported the same way.
//  - The server binds with SO_REUSEADDR, so a port left in TIME_WAIT by a previous run is reused at once;
//    port 0 picks a free port (see port()).
//  - Thread safe. Each concurrent call uses its own connection (a small pool), so a thread blocked in
//    wait() never delays a set() from another thread of the same process.
//  - The server runs on a background thread of the process that hosts it; it stops when the last
//    TcpStore holding it is destroyed (or the TcpStoreServer itself is).
//
// Wire format (host byte order; server and clients run the same code on the same kind of machine):
// every message is a u32 length followed by that many bytes; a request is a u8 command and its fields,
// a reply a u8 status and its fields; strings are a u32 length and bytes. Not a public protocol.

#include "dtensor/core/error.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

namespace dtensor {
namespace detail::tcp {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline constexpr std::uint32_t kMagic = 0x44545354; // "DTST"
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::uint32_t kMaxMessage = 1u << 30;

enum class Cmd : std::uint8_t { hello = 1, set, get, wait, add, check, erase, num_keys };
enum class Status : std::uint8_t { ok = 0, missing, timeout, error };

inline std::string errno_text(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

/// An owned file descriptor.
class Fd {
public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

private:
  int fd_ = -1;
};

inline void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

inline int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

// ---- message building and parsing ---------------------------------------------------------------------

class Writer {
public:
  Writer() { buf_.resize(4); } // room for the length
  Writer& u8(std::uint8_t v) { return raw(&v, 1); }
  Writer& u32(std::uint32_t v) { return raw(&v, 4); }
  Writer& i64(std::int64_t v) { return raw(&v, 8); }
  Writer& bytes(std::span<const char> s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  Writer& str(std::string_view s) { return bytes(std::span<const char>(s.data(), s.size())); }
  /// The finished message (length prefix filled in).
  std::vector<char> finish() && {
    const auto n = static_cast<std::uint32_t>(buf_.size() - 4);
    std::memcpy(buf_.data(), &n, 4);
    return std::move(buf_);
  }

private:
  Writer& raw(const void* p, std::size_t n) {
    const std::size_t at = buf_.size();
    buf_.resize(at + n);
    if (n > 0) {
      std::memcpy(buf_.data() + at, p, n);
    }
    return *this;
  }
  std::vector<char> buf_;
};

/// Reads fields of one message body; throws Error on truncated input.
class Reader {
public:
  explicit Reader(std::span<const char> body) : body_(body) {}
  std::uint8_t u8() { return pod<std::uint8_t>(); }
  std::uint32_t u32() { return pod<std::uint32_t>(); }
  std::int64_t i64() { return pod<std::int64_t>(); }
  std::vector<char> bytes() {
    const std::uint32_t n = u32();
    need(n);
    std::vector<char> out(body_.begin() + static_cast<std::ptrdiff_t>(at_),
                          body_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
    at_ += n;
    return out;
  }
  std::string str() {
    auto b = bytes();
    return std::string(b.begin(), b.end());
  }

private:
  template <class T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, body_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  void need(std::size_t n) const {
    if (at_ + n > body_.size()) {
      throw Error("dtensor TcpStore: malformed message (truncated)");
    }
  }
  std::span<const char> body_;
  std::size_t at_ = 0;
};

// ---- blocking I/O with deadlines (clients) ------------------------------------------------------------

/// Why a client-side transfer stopped.
enum class IoResult { ok, timeout, closed, failed };

inline IoResult send_all(int fd, const char* p, std::size_t n, Clock::time_point deadline, int& err) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) {
      continue;
    }
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd, POLLOUT, 0};
      const int r = ::poll(&pfd, 1, ms_until(deadline));
      if (r == 0) {
        return IoResult::timeout;
      }
      continue;
    }
    err = errno;
    return err == EPIPE || err == ECONNRESET ? IoResult::closed : IoResult::failed;
  }
  return IoResult::ok;
}

inline IoResult recv_all(int fd, char* p, std::size_t n, Clock::time_point deadline, int& err) {
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int r = ::poll(&pfd, 1, ms_until(deadline));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r == 0) {
      return IoResult::timeout;
    }
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) {
      return IoResult::closed;
    }
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) {
      continue;
    }
    err = errno;
    return err == ECONNRESET ? IoResult::closed : IoResult::failed;
  }
  return IoResult::ok;
}

/// Sends `request` and reads one reply body. On failure returns the IoResult and leaves `reply` empty.
inline IoResult round_trip(int fd, const std::vector<char>& request, Clock::time_point deadline,
                           std::vector<char>& reply, int& err) {
  IoResult r = send_all(fd, request.data(), request.size(), deadline, err);
  if (r != IoResult::ok) {
    return r;
  }
  std::uint32_t n = 0;
  r = recv_all(fd, reinterpret_cast<char*>(&n), 4, deadline, err);
  if (r != IoResult::ok) {
    return r;
  }
  if (n > kMaxMessage) {
    err = EPROTO;
    return IoResult::failed;
  }
  reply.resize(n);
  return recv_all(fd, reply.data(), n, deadline, err);
}

/// One TCP connection attempt to any address of host:port, bounded by `deadline`. Sets `error` on failure.
inline Fd try_connect(const std::string& host, int port, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  if (gai != 0) {
    error = "cannot resolve '" + host + "': " + ::gai_strerror(gai);
    return {};
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(list, &::freeaddrinfo);
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!fd) {
      error = "socket: " + errno_text(errno);
      continue;
    }
    set_nonblocking(fd.get(), true);
    int rc = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd{fd.get(), POLLOUT, 0};
      // Bound one attempt so an address that swallows SYNs does not eat the whole budget alone.
      const int wait_ms = std::min(ms_until(deadline), 5000);
      int pr;
      do {
        pr = ::poll(&pfd, 1, wait_ms);
      } while (pr < 0 && errno == EINTR);
      if (pr == 0) {
        error = "connect: no answer (the address may be unreachable or filtered)";
        continue;
      }
      int so = 0;
      socklen_t len = sizeof(so);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so, &len);
      rc = so == 0 ? 0 : -1;
      errno = so;
    }
    if (rc != 0) {
      error = "connect: " + errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
  }
  return {};
}

// ---- the server ---------------------------------------------------------------------------------------

/// Binds a listening socket on `port` (0: any free port) of all interfaces (IPv6 dual stack when
/// available, else IPv4), or of `host` when it is not empty.
inline Fd listen_on(const std::string& host, int port, int& bound_port) {
  addrinfo hints{};
  hints.ai_family = host.empty() ? AF_INET6 : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  std::string last = "no usable address";
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) {
      if (!host.empty()) {
        break;
      }
      hints.ai_family = AF_INET; // no IPv6 on this machine
    }
    addrinfo* list = nullptr;
    const std::string service = std::to_string(port);
    const int gai = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list);
    if (gai != 0) {
      last = std::string("getaddrinfo: ") + ::gai_strerror(gai);
      continue;
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(list, &::freeaddrinfo);
    for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last = "socket: " + errno_text(errno);
        continue;
      }
      int one = 1;
      int zero = 0;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (a->ai_family == AF_INET6) {
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      }
      if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        last = "bind: " + errno_text(errno);
        continue;
      }
      if (::listen(fd.get(), 1024) != 0) {
        last = "listen: " + errno_text(errno);
        continue;
      }
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
      bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                            : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      set_nonblocking(fd.get(), true);
      return fd;
    }
  }
  throw Error("dtensor TcpStore: cannot listen on " + (host.empty() ? std::string("*") : host) + ":" +
              std::to_string(port) + ": " + last +
              (last.find("EADDRINUSE") != std::string::npos || last.find("in use") != std::string::npos
                   ? " (another program holds this port: pick another MASTER_PORT, or 0 for a free one)"
                   : ""));
}

} // namespace detail::tcp

/// The server half of TcpStore: a map served to any number of clients by one background thread
/// (poll loop). Usually owned by a TcpStore constructed with is_server = true, or by dtensor-run.
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

  /// Stops serving and closes every connection (clients see "connection closed"). Idempotent.
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
        c.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
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

/// Options of a TcpStore.
struct TcpStoreOptions {
  /// Host the server in this process (on `port`, 0: a free one) and connect to it through loopback.
  bool is_server = false;
  /// Limit of every blocking call: connecting (including waiting for the server to come up), get and wait.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  /// Interface address the server binds to; empty: all interfaces.
  std::string bind_host;
};

/// Client of a TcpStoreServer (and, with is_server, its owner). See the top of this file.
class TcpStore {
public:
  using Clock = detail::tcp::Clock;

  /// Connects to host:port, retrying until options.timeout; throws TimeoutError (with the address and
  /// the last socket error) when nothing answers in time. With options.is_server, first starts a server
  /// on `port`; port() then gives the port it got.
  TcpStore(std::string host, int port, TcpStoreOptions options = {})
      : host_(std::move(host)), port_(port), timeout_ms_(options.timeout.count()) {
    if (options.is_server) {
      server_ = std::make_shared<TcpStoreServer>(port, options.bind_host);
      port_ = server_->port();
      connect_host_ = "127.0.0.1";
      if (!options.bind_host.empty()) {
        connect_host_ = options.bind_host;
      }
    } else {
      connect_host_ = host_;
    }
    release(connect(Clock::now() + timeout()));
  }

  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  const std::string& host() const noexcept { return host_; }
  int port() const noexcept { return port_; }
  bool is_server() const noexcept { return server_ != nullptr; }
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_.store(t.count()); }

  /// Stores `value` under `key` (overwrites) and wakes waiters on it.
  void set(const std::string& key, const std::vector<char>& value) { set_bytes(key, value); }
  void set(const std::string& key, std::string_view value) { set_bytes(key, value); }
  void set_bytes(const std::string& key, std::span<const char> value) {
    expect_ok(call(std::move(detail::tcp::Writer().u8(cmd(Cmd::set)).str(key).bytes(value)).finish(),
                   timeout(), "set('" + key + "')"),
              "set('" + key + "')");
  }

  /// The value of `key`, waiting up to timeout() for some client to set it.
  std::vector<char> get(const std::string& key) {
    wait({key});
    auto v = try_get(key);
    if (!v) {
      throw Error(where() + ": key '" + key + "' was deleted between wait and get");
    }
    return std::move(*v);
  }

  /// The value of `key` if it is set now; never waits for it.
  std::optional<std::vector<char>> try_get(const std::string& key) {
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::get)).str(key)).finish(), timeout(),
                     "get('" + key + "')");
    detail::tcp::Reader r(body);
    const auto s = static_cast<Status>(r.u8());
    if (s == Status::missing) {
      return std::nullopt;
    }
    check_status(s, r, "get('" + key + "')");
    return r.bytes();
  }

  /// Blocks until every key exists; TimeoutError after `timeout` (default: timeout()) naming the missing
  /// ones.
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    detail::tcp::Writer w;
    w.u8(cmd(Cmd::wait)).u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) {
      w.str(k);
    }
    w.i64(timeout.count());
    const std::string what = "wait(" + join(keys) + ")";
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
      throw TimeoutError(where() + ": timed out after " + std::to_string(timeout.count()) +
                         " ms waiting for key(s) " + join(missing.empty() ? keys : missing) +
                         " (a rank did not arrive, or arrived with another MASTER_ADDR/MASTER_PORT or "
                         "WORLD_SIZE)");
    }
    check_status(s, r, what);
  }

  /// True when every key exists now.
  bool check(const std::vector<std::string>& keys) {
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

  /// Atomically adds `delta` to the integer under `key` (missing: 0) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::add)).str(key).i64(delta)).finish(),
                     timeout(), "add('" + key + "')");
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, "add('" + key + "')");
    return r.i64();
  }

  /// Removes `key`; true when it existed.
  bool delete_key(const std::string& key) {
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::erase)).str(key)).finish(), timeout(),
                     "delete_key('" + key + "')");
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, "delete_key");
    return r.u8() != 0;
  }

  /// Number of keys in the store.
  std::int64_t num_keys() {
    auto body = call(std::move(detail::tcp::Writer().u8(cmd(Cmd::num_keys))).finish(), timeout(), "num_keys");
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, "num_keys");
    return r.i64();
  }

  /// Every one of `world_size` callers of barrier(name, ...) returns once all of them have called it;
  /// TimeoutError (naming how many arrived) after `timeout`. Each name is single use. A caller hosting
  /// the server returns only after every caller got its answer, so it may then exit safely.
  void barrier(const std::string& name, int world_size, std::chrono::milliseconds timeout) {
    const std::int64_t arrived = add(name + "/arrived", 1);
    if (arrived == world_size) {
      set(name + "/done", std::string_view("1"));
    }
    try {
      wait({name + "/done"}, timeout);
      // The process hosting the server must not leave (and take the store with it) while others still
      // wait for their reply: it waits until every caller has left.
      if (add(name + "/left", 1) == world_size) {
        set(name + "/all_left", std::string_view("1"));
      }
      if (is_server()) {
        wait({name + "/all_left"}, timeout);
      }
    } catch (const TimeoutError&) {
      std::int64_t now = -1;
      try {
        now = add(name + "/arrived", 0);
      } catch (...) {
      }
      throw TimeoutError(where() + ": barrier '" + name + "' timed out after " +
                         std::to_string(timeout.count()) + " ms: " + std::to_string(now) + " of " +
                         std::to_string(world_size) + " processes arrived");
    }
  }

private:
  using Cmd = detail::tcp::Cmd;
  using Status = detail::tcp::Status;

  static std::uint8_t cmd(Cmd c) { return static_cast<std::uint8_t>(c); }

  static std::string join(const std::vector<std::string>& keys) {
    std::string s;
    for (const auto& k : keys) {
      s += (s.empty() ? "'" : ", '") + k + "'";
    }
    return s;
  }

  std::string where() const { return "dtensor TcpStore " + host_ + ":" + std::to_string(port_); }

  void check_status(Status s, detail::tcp::Reader& r, const std::string& what) const {
    if (s == Status::ok) {
      return;
    }
    if (s == Status::error) {
      throw Error(where() + ": " + what + ": " + r.str());
    }
    throw Error(where() + ": " + what + ": unexpected reply status " + std::to_string(static_cast<int>(s)));
  }

  void expect_ok(const std::vector<char>& body, const std::string& what) const {
    detail::tcp::Reader r(body);
    check_status(static_cast<Status>(r.u8()), r, what);
  }

  /// A connected, handshaken socket; retries until `deadline`.
  detail::tcp::Fd connect(Clock::time_point deadline) {
    using namespace std::chrono_literals;
    std::string last = "no attempt made";
    auto backoff = 10ms;
    int attempts = 0;
    for (;;) {
      ++attempts;
      detail::tcp::Fd fd = detail::tcp::try_connect(connect_host_, port_, deadline, last);
      if (fd) {
        // Handshake: tells a dtensor store from whatever else listens on the port.
        std::vector<char> reply;
        int err = 0;
        const auto hello =
            std::move(
                detail::tcp::Writer().u8(cmd(Cmd::hello)).u32(detail::tcp::kMagic).u32(detail::tcp::kVersion))
                .finish();
        const auto hs_deadline = std::max(deadline, Clock::now() + 1s);
        const auto r = detail::tcp::round_trip(fd.get(), hello, hs_deadline, reply, err);
        if (r == detail::tcp::IoResult::ok) {
          detail::tcp::Reader rd(reply);
          const auto s = static_cast<Status>(rd.u8());
          if (s == Status::error) {
            throw Error(where() + ": " + rd.str());
          }
          if (s == Status::ok && rd.u32() == detail::tcp::kMagic) {
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
        throw TimeoutError(where() + ": could not reach the store within " +
                           std::to_string(timeout().count()) + " ms (" + std::to_string(attempts) +
                           " attempts; last error: " + last +
                           "). Check MASTER_ADDR and MASTER_PORT, that rank 0 (or dtensor-run on node 0) is "
                           "running, and that no firewall blocks the port.");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, 1000ms);
    }
  }

  detail::tcp::Fd acquire() {
    {
      std::lock_guard lock(pool_mutex_);
      if (!pool_.empty()) {
        detail::tcp::Fd fd = std::move(pool_.back());
        pool_.pop_back();
        return fd;
      }
    }
    return connect(Clock::now() + timeout());
  }

  void release(detail::tcp::Fd fd) {
    std::lock_guard lock(pool_mutex_);
    if (pool_.size() < 4) {
      pool_.push_back(std::move(fd));
    }
  }

  /// Sends one request on a pooled connection and returns the reply body.
  std::vector<char> call(const std::vector<char>& request, std::chrono::milliseconds limit,
                         const std::string& what) {
    detail::tcp::Fd fd = acquire();
    std::vector<char> reply;
    int err = 0;
    const auto r = detail::tcp::round_trip(fd.get(), request, Clock::now() + limit, reply, err);
    switch (r) {
    case detail::tcp::IoResult::ok:
      release(std::move(fd));
      return reply;
    case detail::tcp::IoResult::timeout:
      throw TimeoutError(where() + ": " + what + ": no reply within " + std::to_string(limit.count()) +
                         " ms");
    case detail::tcp::IoResult::closed:
      throw Error(where() + ": " + what +
                  ": the store closed the connection (the process hosting it, rank 0 or dtensor-run, "
                  "probably exited)");
    case detail::tcp::IoResult::failed:
      break;
    }
    throw Error(where() + ": " + what + ": " + detail::tcp::errno_text(err));
  }

  std::string host_;
  std::string connect_host_;
  int port_;
  std::atomic<std::int64_t> timeout_ms_{0};
  std::shared_ptr<TcpStoreServer> server_;
  std::mutex pool_mutex_;
  std::vector<detail::tcp::Fd> pool_;
};

} // namespace dtensor
