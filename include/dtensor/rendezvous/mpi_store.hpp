#pragma once
// How processes started by an MPI launcher meet with no MASTER_ADDR and no TCP store (the counterpart of
// rendezvous/tcp_store.hpp): MpiStore, a dtensor::Store whose keys live on rank 0 of MPI_COMM_WORLD and
// whose requests travel as MPI messages on a communicator of its own. Needs MPI (link dtensor::mpi).
// init_process_group uses it under mpirun when MASTER_ADDR is not set, for every backend: the MPI
// backend's timeout reports, gloo's pair addresses and NCCL's unique id all meet there.
//
//   auto store = std::make_shared<dtensor::MpiStore>(std::chrono::seconds(60));   // on every process
//   store->set("addr/" + std::to_string(rank), bytes);
//   auto v = store->get("addr/0");
//
// Contract: the Store contract (rendezvous/store.hpp). Constructing one is collective over
// MPI_COMM_WORLD (every process makes its MpiStores in the same order; TimeoutError when one does not
// come within the timeout). Rank 0 keeps the keys (an InProcessStore) and serves the other processes from
// a thread that polls for requests (sleeping up to 1 ms between polls when idle, so an idle store costs
// no CPU); rank 0's own calls go straight to the keys. wait() and get() wait on rank 0, which answers when
// the keys exist or the timeout passed, so waiting costs no messages. A request rank 0 does not answer
// within the timeout (plus 5 s) gives TimeoutError naming the store.
// Rank 0 serves until the processes end, not until its MpiStore is destroyed: before MPI is finalised
// (MpiRuntime's finalize hooks, rendezvous/detail/mpi.hpp: at exit when dtensor initialised MPI, else at
// mpi_shutdown()), every process meets the others on the store's communicator, so no process loses the
// store while another still uses it (MPI_Finalize waits for every process as well).
// Needs MPI_THREAD_SERIALIZED at least (rank 0's thread calls MPI); Debian's OpenMPI gives MULTIPLE.

#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/detail/mpi.hpp"
#include "dtensor/rendezvous/in_process_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor {
namespace detail {

/// A request or a reply of the MPI store on the wire:
/// [u8 verb, or 0 ok / 1 no / 2 error][i32 reply tag][i64 number][u32 n]([u32 len][bytes])*n.
struct MpiStoreMessage {
  std::uint8_t head = 0;
  std::int32_t tag = 0;
  std::int64_t number = 0;
  std::vector<std::string> items;

  std::vector<char> encode() const {
    std::size_t n = sizeof head + sizeof tag + sizeof number + sizeof(std::uint32_t);
    for (const auto& s : items) {
      n += sizeof(std::uint32_t) + s.size();
    }
    std::vector<char> out(n);
    char* p = out.data();
    p = put(p, head);
    p = put(p, tag);
    p = put(p, number);
    p = put(p, static_cast<std::uint32_t>(items.size()));
    for (const auto& s : items) {
      p = put(p, static_cast<std::uint32_t>(s.size()));
      std::memcpy(p, s.data(), s.size());
      p += s.size();
    }
    return out;
  }

  static std::optional<MpiStoreMessage> decode(const std::vector<char>& in) {
    MpiStoreMessage m;
    std::size_t at = 0;
    std::uint32_t n = 0;
    if (!get(in, at, m.head) || !get(in, at, m.tag) || !get(in, at, m.number) || !get(in, at, n)) {
      return std::nullopt;
    }
    for (std::uint32_t i = 0; i < n; ++i) {
      std::uint32_t len = 0;
      if (!get(in, at, len) || in.size() - at < len) {
        return std::nullopt;
      }
      m.items.emplace_back(in.data() + at, len);
      at += len;
    }
    return at == in.size() ? std::optional<MpiStoreMessage>(std::move(m)) : std::nullopt;
  }

  template <class T>
  static char* put(char* p, T v) {
    std::memcpy(p, &v, sizeof v);
    return p + sizeof v;
  }
  template <class T>
  static bool get(const std::vector<char>& in, std::size_t& at, T& v) {
    if (in.size() - at < sizeof v) {
      return false;
    }
    std::memcpy(&v, in.data() + at, sizeof v);
    at += sizeof v;
    return true;
  }
};

enum class MpiStoreVerb : std::uint8_t {
  set,
  try_get,
  add,
  compare_set,
  delete_key,
  check,
  wait,
  num_keys,
  multi_get,
  multi_set
};

/// One MpiStore's communicator and, on rank 0, its keys and the thread serving them. Outlives the
/// MpiStore (see the top of this file): MpiRuntime's finalize hook ends it.
class MpiStoreHost {
public:
  static constexpr int kRequestTag = 1;
  static constexpr int kFirstReplyTag = 2;

  MpiStoreHost(MPI_Comm comm, int rank) : comm_(comm), rank_(rank) {
    if (rank_ == 0) {
      keys_ = std::make_shared<InProcessStore>(kMaxTimeout);
      server_ = std::thread([this] { serve(); });
    }
  }

  ~MpiStoreHost() { stop_serving(); }
  MpiStoreHost(const MpiStoreHost&) = delete;
  MpiStoreHost& operator=(const MpiStoreHost&) = delete;

  MPI_Comm comm() const { return comm_; }
  /// Rank 0's keys; null elsewhere.
  InProcessStore* keys() const { return keys_.get(); }

  /// Meets the other processes on the communicator, then stops serving and frees the communicator. Runs
  /// once, before MPI_Finalize, which waits for every process too (so the meeting has no limit; it
  /// sleeps 1 ms between tests, leaving the cores to the processes still working).
  void shutdown() {
    if (comm_ == MPI_COMM_NULL || MpiRuntime::finalized()) {
      stop_serving();
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;
    {
      auto lock = MpiRuntime::instance().lock();
      MPI_Ibarrier(comm_, &r);
    }
    for (int done = 0; !done;) {
      {
        auto lock = MpiRuntime::instance().lock();
        if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          break;
        }
      }
      if (!done) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    stop_serving();
    auto lock = MpiRuntime::instance().lock();
    MPI_Comm_free(&comm_);
  }

private:
  struct PendingWait {
    int source = 0;
    int tag = 0;
    std::vector<std::string> keys;
    MpiClock::time_point deadline;
  };

  struct PendingSend {
    std::vector<char> bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  void stop_serving() {
    stop_.store(true);
    if (server_.joinable()) {
      server_.join();
    }
  }

  void serve() {
    std::vector<PendingWait> waits;
    std::list<PendingSend> sends;
    auto pause = std::chrono::microseconds(0);
    while (!stop_.load()) {
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status st;
      std::vector<char> in;
      {
        auto lock = MpiRuntime::instance().lock();
        if (MPI_Improbe(MPI_ANY_SOURCE, kRequestTag, comm_, &flag, &msg, &st) == MPI_SUCCESS && flag) {
          int n = 0;
          MPI_Get_count(&st, MPI_BYTE, &n);
          in.resize(static_cast<std::size_t>(n));
          MPI_Mrecv(in.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
        }
      }
      if (flag) {
        if (auto m = MpiStoreMessage::decode(in)) {
          handle(*m, st.MPI_SOURCE, waits, sends);
        }
        pause = std::chrono::microseconds(0);
      }
      for (auto it = waits.begin(); it != waits.end();) { // waits whose keys came, or whose time is up
        const bool there = keys_->check(it->keys);
        if (there || MpiClock::now() >= it->deadline) {
          MpiStoreMessage reply{static_cast<std::uint8_t>(there ? 0 : 1), 0, 0, {}};
          if (!there) {
            for (const auto& k : it->keys) {
              if (!keys_->check({k})) {
                reply.items.push_back(k);
              }
            }
          }
          send(reply, it->source, it->tag, sends);
          it = waits.erase(it);
        } else {
          ++it;
        }
      }
      {
        auto lock = MpiRuntime::instance().lock();
        sends.remove_if([](PendingSend& s) {
          int done = 0;
          MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
          return done != 0;
        });
      }
      if (!flag) {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2 + std::chrono::microseconds(20), std::chrono::microseconds(1000));
      }
    }
    auto lock = MpiRuntime::instance().lock();
    for (PendingSend& s : sends) { // their clients stopped listening
      MPI_Cancel(&s.request);
      MPI_Request_free(&s.request);
    }
  }

  void send(const MpiStoreMessage& reply, int dest, int tag, std::list<PendingSend>& sends) {
    PendingSend& s = sends.emplace_back();
    s.bytes = reply.encode();
    auto lock = MpiRuntime::instance().lock();
    MPI_Isend(s.bytes.data(), static_cast<int>(s.bytes.size()), MPI_BYTE, dest, tag, comm_, &s.request);
  }

  static std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }
  static std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }

  void handle(const MpiStoreMessage& m, int source, std::vector<PendingWait>& waits,
              std::list<PendingSend>& sends) {
    MpiStoreMessage reply{0, 0, 0, {}};
    try {
      switch (static_cast<MpiStoreVerb>(m.head)) {
      case MpiStoreVerb::set:
        keys_->set(m.items.at(0), bytes(m.items.at(1)));
        break;
      case MpiStoreVerb::try_get:
        if (auto v = keys_->try_get(m.items.at(0))) {
          reply.items.push_back(text(*v));
        } else {
          reply.head = 1;
        }
        break;
      case MpiStoreVerb::add:
        reply.items.push_back(std::to_string(keys_->add(m.items.at(0), m.number)));
        break;
      case MpiStoreVerb::compare_set:
        reply.items.push_back(
            text(keys_->compare_set(m.items.at(0), bytes(m.items.at(1)), bytes(m.items.at(2)))));
        break;
      case MpiStoreVerb::delete_key:
        reply.head = keys_->delete_key(m.items.at(0)) ? 0 : 1;
        break;
      case MpiStoreVerb::check:
        reply.head = keys_->check(m.items) ? 0 : 1;
        break;
      case MpiStoreVerb::wait:
        waits.push_back({source, m.tag, m.items, MpiClock::now() + std::chrono::milliseconds(m.number)});
        return; // answered by serve() when the keys came or the time is up
      case MpiStoreVerb::num_keys:
        reply.items.push_back(std::to_string(keys_->num_keys()));
        break;
      case MpiStoreVerb::multi_get:
        for (const auto& k : m.items) {
          auto v = keys_->try_get(k);
          if (!v) {
            reply.head = 1;
            reply.items.clear();
            break;
          }
          reply.items.push_back(text(*v));
        }
        break;
      case MpiStoreVerb::multi_set: {
        std::vector<std::string> ks;
        std::vector<std::vector<char>> vs;
        for (std::size_t i = 0; i + 1 < m.items.size(); i += 2) {
          ks.push_back(m.items[i]);
          vs.push_back(bytes(m.items[i + 1]));
        }
        keys_->multi_set(ks, vs);
        break;
      }
      default:
        throw Error("unknown request " + std::to_string(m.head));
      }
    } catch (const std::exception& e) {
      reply.head = 2;
      reply.items = {"dtensor MpiStore on rank 0: " + std::string(e.what())};
    }
    send(reply, source, m.tag, sends);
  }

  MPI_Comm comm_;
  int rank_;
  std::shared_ptr<InProcessStore> keys_; // rank 0 only
  std::thread server_;
  std::atomic<bool> stop_{false};
};

} // namespace detail

/// Runs what dtensor must do before MPI_Finalize (the MPI stores meet and stop serving). A program that
/// initialised MPI itself calls it right before its own MPI_Finalize; when dtensor initialised MPI, it
/// runs at exit by itself.
inline void mpi_shutdown() {
  detail::MpiRuntime::instance().run_finalize_hooks();
}

class MpiStore final : public Store {
public:
  /// Collective over MPI_COMM_WORLD (initialises MPI when nobody did).
  explicit MpiStore(std::chrono::milliseconds timeout = kDefaultStoreTimeout) : Store(timeout) {
    detail::MpiRuntime& mpi = detail::MpiRuntime::instance();
    mpi.ensure_initialized();
    DTENSOR_CHECK(
        mpi.thread_level() >= MPI_THREAD_SERIALIZED,
        "MpiStore: MPI was initialised with a thread level below MPI_THREAD_SERIALIZED, but rank 0 "
        "serves the store from a thread: initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, "
        "...), or let dtensor initialise it");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    tag_ub_ = mpi.tag_ub();
    auto comm = std::make_unique<MPI_Comm>(MPI_COMM_NULL); // MPI writes it at completion
    MPI_Request r = MPI_REQUEST_NULL;
    {
      auto lock = mpi.lock();
      detail::check_mpi(MPI_Comm_idup(MPI_COMM_WORLD, comm.get(), &r), "MPI_Comm_idup", describe());
    }
    if (!detail::mpi_wait_all({&r, 1}, detail::MpiClock::now() + timeout, [&] { return describe(); })) {
      (void)comm.release();
      throw TimeoutError(describe() + ": not every process of MPI_COMM_WORLD made its store within " +
                         std::to_string(timeout.count()) + " ms");
    }
    {
      auto lock = mpi.lock();
      MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN);
    }
    host_ = std::make_shared<detail::MpiStoreHost>(*comm, rank_);
    mpi.add_finalize_hook([host = host_] { host->shutdown(); });
  }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const std::vector<char>& value) override {
    if (auto* k = host_->keys()) {
      k->set(key, value);
      return;
    }
    ask(Verb::set, {key, text(value)});
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout());
    auto v = try_get(key);
    DTENSOR_CHECK(v.has_value(), describe() + ": get('" + key + "'): the key was deleted while it was read");
    return std::move(*v);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    if (auto* k = host_->keys()) {
      return k->add(key, delta);
    }
    return std::stoll(ask(Verb::add, {key}, delta).items.at(0));
  }

  std::vector<char> compare_set(const std::string& key, const std::vector<char>& expected,
                                const std::vector<char>& desired) override {
    if (auto* k = host_->keys()) {
      return k->compare_set(key, expected, desired);
    }
    return bytes(ask(Verb::compare_set, {key, text(expected), text(desired)}).items.at(0));
  }

  bool delete_key(const std::string& key) override {
    if (auto* k = host_->keys()) {
      return k->delete_key(key);
    }
    return ask(Verb::delete_key, {key}).ok;
  }

  bool check(const std::vector<std::string>& keys) override {
    if (auto* k = host_->keys()) {
      return k->check(keys);
    }
    return ask(Verb::check, keys).ok;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    detail::check_timeout(timeout, describe() + ": wait");
    if (auto* k = host_->keys()) {
      try {
        k->wait(keys, timeout);
      } catch (const TimeoutError& e) { // name this store, not the keys' InProcessStore
        std::vector<std::string> missing;
        for (const auto& key : keys) {
          if (!k->check({key})) {
            missing.push_back(key);
          }
        }
        throw TimeoutError(detail::store_timeout_message(describe(), timeout, missing));
      }
      return;
    }
    const Reply r = ask(Verb::wait, keys, timeout.count(), timeout);
    if (!r.ok) {
      throw TimeoutError(detail::store_timeout_message(describe(), timeout, r.items));
    }
  }

  std::int64_t num_keys() override {
    if (auto* k = host_->keys()) {
      return k->num_keys();
    }
    return std::stoll(ask(Verb::num_keys, {}).items.at(0));
  }

  std::optional<std::vector<char>> try_get(const std::string& key) override {
    if (auto* k = host_->keys()) {
      return k->try_get(key);
    }
    const Reply r = ask(Verb::try_get, {key});
    if (!r.ok) {
      return std::nullopt;
    }
    return bytes(r.items.at(0));
  }

  std::vector<std::vector<char>> multi_get(const std::vector<std::string>& keys) override {
    wait(keys, timeout());
    std::vector<std::vector<char>> out;
    if (auto* k = host_->keys()) {
      for (const auto& key : keys) {
        auto v = k->try_get(key);
        DTENSOR_CHECK(v.has_value(), describe() + ": multi_get: '" + key + "' was deleted while it was read");
        out.push_back(std::move(*v));
      }
      return out;
    }
    const Reply r = ask(Verb::multi_get, keys);
    DTENSOR_CHECK(r.ok && r.items.size() == keys.size(),
                  describe() + ": multi_get: a key was deleted while it was read");
    for (const auto& v : r.items) {
      out.push_back(bytes(v));
    }
    return out;
  }

  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::vector<char>>& values) override {
    check_same_size(keys, values, "multi_set");
    if (auto* k = host_->keys()) {
      k->multi_set(keys, values);
      return;
    }
    std::vector<std::string> items;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      items.push_back(keys[i]);
      items.push_back(text(values[i]));
    }
    ask(Verb::multi_set, items);
  }

  std::string describe() const override {
    return "dtensor MpiStore (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
           ", keys on rank 0)";
  }

private:
  using Verb = detail::MpiStoreVerb;
  using Message = detail::MpiStoreMessage;

  struct Reply {
    bool ok = false;
    std::vector<std::string> items;
  };

  static std::string text(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }
  static std::vector<char> bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

  /// One request to rank 0 and its reply; `limit`: how long rank 0 may take to answer (plus 5 s).
  Reply ask(Verb verb, std::vector<std::string> items, std::int64_t number = 0,
            std::chrono::milliseconds limit = std::chrono::milliseconds(0)) {
    using detail::MpiStoreHost;
    const int span = tag_ub_ - MpiStoreHost::kFirstReplyTag + 1;
    const int tag =
        MpiStoreHost::kFirstReplyTag + static_cast<int>(next_tag_.fetch_add(1) % static_cast<unsigned>(span));
    const Message m{static_cast<std::uint8_t>(verb), tag, number, std::move(items)};
    const std::vector<char> out = m.encode();
    DTENSOR_CHECK(out.size() <= static_cast<std::size_t>(INT32_MAX),
                  describe() + ": a request of " + std::to_string(out.size()) + " bytes is too large");
    const auto wait_for = limit.count() > 0 ? limit : timeout();
    const auto deadline = detail::MpiClock::now() + wait_for + std::chrono::seconds(5);
    const auto context = [&] { return describe(); };
    const MPI_Comm comm = host_->comm();
    MPI_Request r = MPI_REQUEST_NULL;
    {
      auto lock = detail::MpiRuntime::instance().lock();
      detail::check_mpi(MPI_Isend(out.data(), static_cast<int>(out.size()), MPI_BYTE, 0,
                                  MpiStoreHost::kRequestTag, comm, &r),
                        "MPI_Isend", context);
    }
    if (!detail::mpi_wait_all({&r, 1}, deadline, context)) {
      detail::mpi_cancel_p2p({&r, 1});
      throw TimeoutError(describe() + ": rank 0 did not take a request within " +
                         std::to_string(wait_for.count()) + " ms (+5 s)");
    }
    for (auto pause = std::chrono::microseconds(0);;
         pause = std::min(pause * 2 + std::chrono::microseconds(20), std::chrono::microseconds(1000))) {
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status st;
      std::vector<char> in;
      {
        auto lock = detail::MpiRuntime::instance().lock();
        detail::check_mpi(MPI_Improbe(0, tag, comm, &flag, &msg, &st), "MPI_Improbe", context);
        if (flag) {
          int n = 0;
          MPI_Get_count(&st, MPI_BYTE, &n);
          in.resize(static_cast<std::size_t>(n));
          detail::check_mpi(MPI_Mrecv(in.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv", context);
        }
      }
      if (flag) {
        auto reply = Message::decode(in);
        DTENSOR_CHECK(reply.has_value(), describe() + ": rank 0 sent a malformed reply");
        if (reply->head == 2) {
          throw Error(reply->items.empty() ? describe() + ": rank 0 failed the request" : reply->items[0]);
        }
        return Reply{reply->head == 0, std::move(reply->items)};
      }
      if (detail::MpiClock::now() >= deadline) {
        throw TimeoutError(describe() + ": rank 0 did not answer within " + std::to_string(wait_for.count()) +
                           " ms (+5 s)");
      }
      std::this_thread::sleep_for(pause);
    }
  }

  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  std::shared_ptr<detail::MpiStoreHost> host_;
  std::atomic<unsigned> next_tag_{0};
};

} // namespace dtensor
