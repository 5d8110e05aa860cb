#pragma once
// One gloo group's connections and what its members tell each other when something fails (the
// counterpart of NcclCommState in backends/nccl/work.hpp):
//  - GlooContext: gloo's rendezvous context, with signal_exception() to fail its pending ops and close its
//    connections (abort);
//  - connect_full_mesh: connects a group through its store and returns only once every member connected;
//  - GlooFailures: a failing member leaves its reason in the group's store under "err/<rank>" and closes
//    its connections, so peers blocked on it fail at once. A peer whose op fails with a transport error
//    names, under dtensor-run, the members the launcher saw end: it records every rank's end in the job's
//    store ("dtensor-run/exit/<global rank>": "killed by SIGKILL"), so those lead the message with how they
//    ended and a member that is merely blocked is not named at all. Otherwise it reads the members' reasons
//    (up to 1 s) and reports the root cause (a peer's timeout stays a TimeoutError), else the members that
//    reported nothing (a killed process cannot). When the store itself is gone (its host died), the board says so at once
//    instead of asking again.
//    translate() turns any failure of an op into the Error / TimeoutError wait() rethrows.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/gloo/rendezvous.hpp"
#include "dtensor/backends/gloo/transfer.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/backends/stuck_op_board.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace dtensor::detail {

// The one gloo call that has no includable declaration: gloo::transport::tcp::Context::signalException,
// what gloo itself calls when an op times out (fail every pending op of the context, close its
// connections). gloo as Debian packages it (libgloo-dev, 2022 snapshot) installs tcp/context.h, but that
// header includes gloo/common/memory.h, which is not installed, and the member is protected, so no
// declaration of it can be compiled. It is therefore declared here by its exported Itanium-ABI symbol (the
// implicit `this` is the first argument), weak: with a gloo that lacks it the program still links and
// GlooContext::signal_exception closes the pairs instead. Called only after checking the dynamic type.
void gloo_tcp_context_signal_exception(void* tcp_context, const std::string& msg) __asm__(
    "_ZN4gloo9transport3tcp7Context15signalExceptionERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
    __attribute__((weak));

using GlooClock = std::chrono::steady_clock;

/// gloo's rendezvous context with access to its transport context (to abort it).
class GlooContext final : public ::gloo::rendezvous::Context {
public:
  using ::gloo::rendezvous::Context::Context;

  /// Fails every pending and future op on this context and closes its connections.
  void signal_exception(const std::string& msg) {
    auto* tc = transportContext_.get();
    if (tc == nullptr) {
      return;
    }
    if (&gloo_tcp_context_signal_exception != nullptr &&
        std::strcmp(typeid(*tc).name(), "N4gloo9transport3tcp7ContextE") == 0) {
      gloo_tcp_context_signal_exception(static_cast<void*>(tc), msg);
      return;
    }
    for (int i = 0; i < size; ++i) { // other transports: a hard close releases the peers
      if (i != rank && tc->getPair(i)) {
        tc->getPair(i)->close();
      }
    }
  }
};

/// "rank 2 of the group did not arrive within 2000 ms: " for the members that never published their
/// address (gloo's key "<rank>"), or "" when they all did (or the store cannot tell).
inline std::string absent_members(Store& store, int size, std::chrono::milliseconds timeout) {
  std::string list;
  int n = 0;
  try {
    for (int r = 0; r < size; ++r) {
      if (!store.check({std::to_string(r)})) {
        list += (n++ == 0 ? "" : ", ") + std::to_string(r);
      }
    }
  } catch (const std::exception&) {
    return "";
  }
  if (n == 0) {
    return "";
  }
  return (n == 1 ? "rank " : "ranks ") + list + " of the group did not arrive within " +
         std::to_string(timeout.count()) + " ms: ";
}

/// Connects `context` to every other member through `store` (gloo's connectFullMesh), then meets them at
/// a store barrier: no member returns (and so none can destroy the group) before every member's pairs are
/// connected. Without it, a member whose side of a connection completed in the kernel could return, drop
/// the group and close the socket while the peer was still in connectFullMesh, which then failed with
/// "Connection closed by peer" (gloo's tcp pairs accept on the loop thread and read the EOF at once). A
/// member that failed to connect says why, so the others fail at once with the cause instead of timing
/// out. `what` names the group in messages.
inline void connect_full_mesh(GlooContext& context, const std::shared_ptr<Store>& store,
                              std::shared_ptr<::gloo::transport::Device> device, int rank, int size,
                              std::chrono::milliseconds timeout, const std::string& what) {
  std::string failure;
  bool is_timeout = false;
  try {
    GlooStoreAdapter gloo_store(store);
    context.connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    is_timeout = dynamic_cast<const TimeoutError*>(&e) != nullptr;
    failure = e.what();
  }
  const std::string mine = failure.empty() ? "ok" : failure;
  store->set("connected/" + std::to_string(rank), std::string_view(mine));
  const std::string head = what + ": connecting the group failed: ";
  if (!failure.empty()) {
    if (is_timeout) {
      throw TimeoutError(head + absent_members(*store, size, timeout) + failure);
    }
    throw Error(head + failure);
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back("connected/" + std::to_string(r));
  }
  try {
    store->wait(keys, timeout);
  } catch (const std::exception& e) {
    throw TimeoutError(head + "not every member finished connecting within " +
                       std::to_string(timeout.count()) + " ms: " + e.what());
  }
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      continue;
    }
    const auto v = store->get(keys[static_cast<std::size_t>(r)]);
    if (std::string(v.begin(), v.end()) != "ok") {
      throw Error(head + "member " + std::to_string(r) +
                  " could not connect: " + std::string(v.begin(), v.end()));
    }
  }
  // Every member read every address (gloo's keys "<rank>" and "rank_<rank>") before it set
  // "connected/<rank>".
  for (int r = 0; r < size; ++r) {
    keys.push_back(std::to_string(r));
    keys.push_back("rank_" + std::to_string(r));
  }
  delete_after_all_read(*store, "connected/read", size, keys);
}

/// What an op is, for messages (built only when something fails).
struct OpDesc {
  const char* name = "";
  std::uint32_t seq = 0;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  int root = -1;
  int reduce = -1;
  /// Every member passes the same `count` (false for the ops over point-to-point, whose members' counts
  /// may differ: there each message's size is in its slot instead, transfer.hpp).
  bool count_agrees = true;
  /// Its id in the group's FlightRecorder.
  std::uint64_t flight = 0;

  /// The tag of this op's messages: its sequence number and a fingerprint of the fields every member must
  /// agree on (transfer.hpp, op_tag), so members that disagree never exchange data.
  std::uint32_t tag() const {
    std::uint64_t h = 0xcbf29ce484222325ULL; // FNV-1a over the name, then the fields
    for (const char* c = name; *c != '\0'; ++c) {
      h = (h ^ static_cast<unsigned char>(*c)) * 0x100000001b3ULL;
    }
    h = mix64(h ^ static_cast<std::uint64_t>(count_agrees ? count : -1));
    h = mix64(h ^ (static_cast<std::uint64_t>(dtype) << 40) ^
              (static_cast<std::uint64_t>(static_cast<std::uint32_t>(root)) << 8) ^
              static_cast<std::uint64_t>(static_cast<std::uint32_t>(reduce)));
    return op_tag(seq, h);
  }

  /// Ops whose messages match only when the members agree on every block size (see transfer.hpp, sized()).
  bool sizes_must_match() const {
    const std::string_view n(name);
    return n == "gather" || n == "scatter" || n == "all_to_all" || n == "all_gather" || n == "reduce_scatter";
  }

  std::string to_string() const { return describe_op(name, seq, count, dtype, root, reduce); }
};

/// The failure board of one group (see the top of this file), over the group's store.
class GlooFailures {
public:
  /// `store` is the group's, `job_store` the job's (where a launcher records the ranks that ended),
  /// `global_ranks` the group's members by job rank.
  GlooFailures(std::shared_ptr<Store> store, std::shared_ptr<Store> job_store, std::vector<int> global_ranks,
               int rank)
      : store_(store), job_store_(std::move(job_store)), global_ranks_(std::move(global_ranks)), rank_(rank),
        size_(static_cast<int>(global_ranks_.size())), ops_(std::move(store), rank, size_) {}

  /// The key under which dtensor-run records how the rank `global_rank` of the job ended.
  static std::string exit_key(int global_rank) { return "dtensor-run/exit/" + std::to_string(global_rank); }
  /// Set by dtensor-run in each start of the job: it records how every rank ends (exit_key).
  static constexpr const char* records_exits_key = "dtensor-run/records_exits";

  /// "; rank 2 (global 2) ended: killed by SIGKILL, seen by dtensor-run" for each other member whose end
  /// the launcher recorded, waiting up to `patience` for the first (the launcher reaps a dead rank within
  /// milliseconds of its peers' connections closing); "" when the launcher records no exits or none came.
  std::string ended_members(std::chrono::milliseconds patience) {
    if (!ask([&] { return job_store_->check({records_exits_key}); })) {
      return "";
    }
    const auto deadline = GlooClock::now() + patience;
    for (;;) {
      std::string ended;
      for (int r = 0; r < size_ && !store_lost(); ++r) {
        const int g = global_ranks_[static_cast<std::size_t>(r)];
        std::optional<std::vector<char>> how;
        if (r != rank_) {
          ask([&] { how = job_store_->try_get(exit_key(g)); });
        }
        if (how) {
          ended += "; rank " + std::to_string(r) + " (global " + std::to_string(g) +
                   ") ended: " + std::string(how->begin(), how->end()) + ", seen by dtensor-run";
        }
      }
      if (!ended.empty() || GlooClock::now() >= deadline || store_lost()) {
        return ended;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  /// Leaves this member's reason under "err/<rank>" (the first one only).
  void publish(bool is_timeout, const std::string& msg) {
    if (published_.exchange(true)) {
      return;
    }
    std::string v = (is_timeout ? "T" : "E") + msg;
    ask([&] { store_->set("err/" + std::to_string(rank_), std::string_view(v)); });
  }

  /// The reason a member published, waiting up to `patience` for one to appear. Timeouts first.
  std::optional<std::pair<bool, std::string>> peer_reason(std::chrono::milliseconds patience) {
    const auto deadline = GlooClock::now() + patience;
    for (;;) {
      std::optional<std::pair<bool, std::string>> found;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) {
          continue;
        }
        std::optional<std::vector<char>> v;
        ask([&] { v = store_->try_get("err/" + std::to_string(r)); });
        if (v && !v->empty()) {
          bool t = (*v)[0] == 'T';
          if (!found || (t && !found->first)) {
            found = std::pair{t, std::string(v->begin() + 1, v->end())};
          }
        }
      }
      if (found || GlooClock::now() >= deadline || store_lost()) {
        return found;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  /// Why nobody's reason could be read: "; ... the job's store is unreachable too: <its error>" when the
  /// store is gone; else the members that published neither an op nor a reason ("; no report from rank 2
  /// (...)"). Called when no launcher recorded an end (ended_members) and after peer_reason's patience.
  std::string silent_members() {
    std::vector<int> silent;
    for (int r = 0; r < size_ && !store_lost(); ++r) {
      const std::string me = std::to_string(r);
      if (r != rank_ && !ask([&] { return store_->check({"op/" + me}) || store_->check({"err/" + me}); })) {
        silent.push_back(r);
      }
    }
    if (auto lost = store_lost()) {
      return "; no member's reason can be read, the job's store is unreachable too: " + *lost;
    }
    if (silent.empty()) {
      return "";
    }
    std::string list;
    for (int r : silent) {
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    }
    return "; no report from rank" + std::string(silent.size() > 1 ? "s " : " ") + list +
           " (exited or killed, or not in an op of this group)";
  }

  /// The exception wait() rethrows for op `d` that failed with `e` after starting at `start`, with the
  /// context a user needs: `head` names the op ("<describe()>: <op>"), `limit` is the group's timeout,
  /// `aborted` the reason the group was aborted, if it was; `history` this rank's last ops on the group
  /// (FlightRecorder::dump), appended to communication failures. Publishes the outcome for the peers.
  std::exception_ptr translate(std::exception_ptr e, const OpDesc& d, const std::string& head,
                               std::chrono::milliseconds limit, const std::optional<std::string>& aborted,
                               GlooClock::time_point start, const std::string& history = {}) {
    std::string reason;
    bool is_timeout = false;
    bool transport = false;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& x) {
      reason = x.what();
      is_timeout = true;
    } catch (const Error& x) {
      reason = x.what();
    } catch (const ::gloo::IoException& x) {
      reason = x.what();
      transport = true;
      is_timeout = reason.find("Timed out") != std::string::npos;
    } catch (const std::exception& x) {
      reason = x.what();
      transport = true;
    } catch (...) {
      reason = "unknown exception";
    }
    const auto elapsed = [&] {
      return std::to_string(
          std::chrono::duration_cast<std::chrono::milliseconds>(GlooClock::now() - start).count());
    };
    const std::string mine = d.to_string();
    ops_.publish_op(mine); // before anything else: a member that timed out may be waiting for it
    std::string msg;
    if (aborted) {
      msg = head + " failed: the group was aborted: " + *aborted;
    } else if (is_timeout) {
      std::vector<int> members;
      const std::string_view n(d.name);
      if ((n == "send" || n == "recv") && d.root >= 0) {
        members = {std::min(rank_, d.root), std::max(rank_, d.root)};
      }
      const std::string ops =
          ops_.members_ops(mine, std::move(members), std::min(limit, std::chrono::milliseconds(1000)));
      msg = head + " timed out after " + elapsed() + " ms (limit " + std::to_string(limit.count()) +
            " ms): a member did not arrive, or the members disagree on the sizes (counts), dtypes or "
            "arguments [" +
            reason + "]" + ops;
    } else if (transport) {
      // A member the launcher saw end leads the message: the live members' own reports (they failed on
      // the same closed connections) would name them first.
      if (const std::string ended = ended_members(std::chrono::milliseconds(1000)); !ended.empty()) {
        msg = head + " failed after " + elapsed() + " ms: " + ended.substr(2) + " [" + reason + "]";
      } else if (auto peer = peer_reason(std::chrono::milliseconds(1000))) {
        is_timeout = peer->first;
        msg = head + " failed after " + elapsed() + " ms because a peer failed: " + peer->second;
        publish(is_timeout, peer->second); // pass the root cause on, not a chain
      } else {
        const std::string silent = silent_members();
        msg = head + " failed after " + elapsed() + " ms: " + reason + silent;
      }
    } else {
      msg = head + " failed: " + reason;
    }
    if ((is_timeout || transport) && !history.empty()) {
      msg += " [flight recorder, this rank's last ops on the group: " + history + "]";
    }
    publish(is_timeout, msg);
    return is_timeout ? std::make_exception_ptr(TimeoutError(msg)) : std::make_exception_ptr(Error(msg));
  }

private:
  /// Runs one store request; a failure (the store may be gone with a failed process) is remembered for
  /// store_lost(), and the request counts as answering "no".
  template <class F>
  bool ask(F&& request) {
    try {
      if constexpr (std::is_void_v<decltype(request())>) {
        request();
        return true;
      } else {
        return request();
      }
    } catch (const std::exception& e) {
      std::lock_guard lock(m_);
      if (!store_lost_) {
        store_lost_ = e.what();
      }
    }
    return false;
  }

  std::optional<std::string> store_lost() {
    std::lock_guard lock(m_);
    return store_lost_ ? store_lost_ : ops_.store_lost();
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> job_store_;
  std::vector<int> global_ranks_;
  int rank_;
  int size_;
  std::atomic<bool> published_{false};
  std::mutex m_;
  std::optional<std::string> store_lost_;
  OpBoard ops_; // what each member was running when it failed
};

} // namespace dtensor::detail
