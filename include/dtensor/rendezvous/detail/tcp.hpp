#pragma once
// The TCP store's wire protocol and socket helpers, shared by its server (rendezvous/tcp_store_server.hpp)
// and its client (rendezvous/tcp_store.hpp). Not a public interface.
//
// Wire format (host byte order; server and clients run the same code on the same kind of machine):
// every message is a u32 length followed by that many bytes; a request is a u8 command and its fields,
// a reply a u8 status and its fields; strings and byte values are a u32 length and bytes. The handshake
// (hello: magic, version, the job's token; answered with the magic and the server's request limit) tells a
// dtensor store from whatever else listens on the port, rejects a peer speaking another version of the
// protocol, and a client of another job.

#include "dtensor/core/error.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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
inline constexpr std::uint32_t kVersion = 3;
inline constexpr std::uint32_t kMaxMessage = 1u << 30;

enum class Cmd : std::uint8_t {
  hello = 1,
  set,
  get,
  wait,
  add,
  check,
  erase,
  num_keys,
  compare_set,
  multi_get,
  multi_set
};
enum class Status : std::uint8_t { ok = 0, missing, timeout, error };

/// Compares a token a client sent with the server's in time independent of where they differ.
inline bool same_token(std::string_view given, std::string_view expected) {
  if (expected.empty()) {
    return given.empty();
  }
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (std::size_t i = 0; i < given.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ expected[i % expected.size()]);
  }
  return diff == 0;
}

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
  Writer() { // room for the length; the reserve also keeps GCC 12 from false -Warray-bounds on resize
    buf_.reserve(64);
    buf_.resize(4);
  }
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

/// One TCP connection attempt to any address of host:port, bounded by `deadline`. Sets `error` on failure,
/// and `refused` when every address refused the connection (nothing listens there).
inline Fd try_connect(const std::string& host, int port, Clock::time_point deadline, std::string& error,
                      bool& refused) {
  refused = false;
  int addresses = 0;
  int refusals = 0;
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
    ++addresses;
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
      refusals += errno == ECONNREFUSED ? 1 : 0;
      error = "connect: " + errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
  }
  refused = addresses > 0 && refusals == addresses;
  return {};
}

// ---- listening (the server) --------------------------------------------------------------------------

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

/// True for names and addresses of this machine's loopback interface ("localhost", "::1", "127.x.y.z").
inline bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

/// The local address the kernel would use to reach host:port (a UDP connect sends nothing), or "" when
/// it cannot tell.
inline std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) {
    return "";
  }
  std::string out;
  for (addrinfo* a = list; a != nullptr && out.empty(); a = a->ai_next) {
    Fd fd(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
      continue;
    }
    char buf[INET6_ADDRSTRLEN] = {};
    const void* addr = ss.ss_family == AF_INET6
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
    if (::inet_ntop(ss.ss_family, addr, buf, sizeof(buf)) != nullptr) {
      out = buf;
    }
  }
  ::freeaddrinfo(list);
  return out;
}

} // namespace detail::tcp

} // namespace dtensor
