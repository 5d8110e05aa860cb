#pragma once
// ReplicaManager: data-parallel replicas that drop out and rejoin without stopping the others (torchft's
// per-step fault tolerance on dtensor's pieces). Each replica is a group of ranks (one rank for DDP, a
// dp x tp block for HSDP) started and restarted on its own by dtensor-run --replica-size K; the replicas
// meet every step in a quorum in the job's store, reduce their gradients over the quorum's replicate groups,
// and commit the step only when every member of the quorum reduced without error.
//
//   ReplicaManager ft;                                   // under dtensor-run --replica-size K --max-restarts N
//   ft.register_state(w); ft.register_state(momentum);   // what a replica that rejoins copies
//   for (;;) {
//     const Quorum q = ft.start_quorum();                // who is in; a rejoining replica receives the state
//     if (ft.step() >= steps) break;
//     auto g = gradients(batch(ft.step(), q.replica_rank, q.replica_count));
//     ft.all_reduce(g, ReduceOp::sum);                   // over the quorum; false when a member failed
//     if (ft.should_commit()) apply(g);                  // every member reduced: step; else redo the step
//   }
//   ft.finish();
//
// The protocol (keys under "ft/" in the job's store, which dtensor-run hosts and which outlives the ranks):
//  - Quorum of round r. Local rank 0 of each replica writes "round/<r>/join/<replica>" ("<incarnation>
//    <has state>"). The members of the previous quorum wait until each previous member joined, or is known
//    to have ended (dtensor-run records "dtensor-run/replica-exit/<replica>/<incarnation>", and a restarted
//    replica announces a newer incarnation), or join_timeout passes; then the first to decide stores the
//    joined replicas under "round/<r>/members" (compare_set: one decision, read by all). A replica that
//    joins for the first time (a restart) never decides: it waits for the decision, and joins the next
//    round when it was left out.
//  - A changed membership, or an aborted previous step, makes new replicate groups: rank l of each replica
//    in a group over the members' ranks l (the old group, aborted by the failure, is dropped). When a member
//    has no state (a restarted replica), rank l of the first member with state broadcasts the registered
//    tensors and the step to every member of group l.
//  - Commit of round r: each replica votes under "round/<r>/vote/<replica>" whether all of its ranks
//    reduced without error; the first to decide, once every member voted or is known ended (or
//    join_timeout passed), stores "commit" when every member voted yes, else "abort", under
//    "round/<r>/decision". An aborted step is redone from the same parameters with the next quorum: the
//    data of a replica is a function of (step, replica_rank, replica_count), so no sample of the step is
//    lost or counted twice.
// Inside a replica, local rank 0 speaks for it and tells its other ranks through the replica's own group;
// when a rank of a replica fails, dtensor-run stops the whole replica and restarts it.
//
// Limits: the job's store is a single point of failure (as torchft's lighthouse); a replica that joins after
// the others finished gets an error naming the step they finished at; NCCL groups are rebuilt the same way
// (new communicators), but only gloo is tested here.

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace dtensor {

/// Options of ReplicaManager; zero or empty fields take their environment defaults.
struct ReplicaOptions {
  /// The replicate groups' backend; empty: DTENSOR_BACKEND, else "auto" (as init_process_group).
  std::string backend;
  /// Default op timeout of every group; zero: DTENSOR_TIMEOUT, else kDefaultOpTimeout.
  std::chrono::milliseconds timeout{0};
  /// How long the members of a quorum wait for a member that neither joins (or votes) nor is known to
  /// have ended, before leaving it out: longer than the slowest step.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(60)};
  /// Ranks per replica; zero: DTENSOR_REPLICA_SIZE (set by dtensor-run --replica-size), else 1.
  int replica_size = 0;
  /// Print a line on each membership change and aborted step (local rank 0 of each replica).
  bool verbose = true;
};

/// The members of one step, as ReplicaManager::start_quorum returns them.
struct Quorum {
  /// The round of the store's protocol (several per step when steps abort).
  std::int64_t round = 0;
  /// This replica's place among the members, and how many there are.
  int replica_rank = 0;
  int replica_count = 1;
  /// The members' replica ids, ascending.
  std::vector<int> replicas;
  /// The membership differs from the previous quorum's (the replicate groups were rebuilt).
  bool changed = false;
  /// This replica received the state from another member in this quorum.
  bool healed = false;
};

class ReplicaManager {
public:
  explicit ReplicaManager(ReplicaOptions options = {}) : opt_(std::move(options)) {
    timeout_ = detail::init_timeout(opt_.timeout);
    backend_ = detail::resolve_backend(opt_.backend);
    env_ = read_dist_env();
    size_ = opt_.replica_size > 0 ? opt_.replica_size
                                  : detail::env_int(detail::system_env, "DTENSOR_REPLICA_SIZE", 1, 1);
    incarnation_ = detail::env_int(detail::system_env, "DTENSOR_REPLICA_RESTART_COUNT", 0, 0);
    DTENSOR_CHECK(env_.world_size % size_ == 0,
                  "ReplicaManager: the world of " + std::to_string(env_.world_size) +
                      " ranks is not a whole number of replicas of " + std::to_string(size_) + " ranks");
    DTENSOR_CHECK(env_.world_size == 1 || env_.agent_store,
                  "ReplicaManager: rank " + std::to_string(env_.rank) +
                      ": the replicas need a store that outlives every rank; run under dtensor-run "
                      "--replica-size K (which hosts it), not with a store hosted by rank 0");
    replica_ = env_.rank / size_;
    local_ = env_.rank % size_;
    count_ = env_.world_size / size_;
    auto own = connect_store(env_, timeout_);
    store_ = env_.store_prefix.empty() ? std::shared_ptr<Store>(own)
                                       : std::make_shared<PrefixStore>(env_.store_prefix, own);
    // This replica's own ranks: never rebuilt (a failed rank restarts the whole replica).
    DistEnv inner = env_;
    inner.rank = local_;
    inner.world_size = size_;
    InitOptions io;
    io.backend = backend_;
    io.timeout = timeout_;
    io.env = inner;
    io.store = std::make_shared<PrefixStore>(
        "ft/replica/" + std::to_string(replica_) + "/" + std::to_string(incarnation_), store_);
    replica_group_ = init_process_group(io);
    if (local_ == 0) {
      store_->set("ft/incarnation/" + std::to_string(replica_), std::to_string(incarnation_));
    }
    if (incarnation_ == 0) { // the first start: every replica is expected in round 0
      for (int r = 0; r < count_; ++r) {
        previous_.push_back({r, 0, false});
      }
    }
  }

  ReplicaManager(const ReplicaManager&) = delete;
  ReplicaManager& operator=(const ReplicaManager&) = delete;

  /// This replica's id (0 .. replicas() - 1), and which start of it this process is (0, then 1, ... after
  /// each restart).
  int replica() const noexcept { return replica_; }
  int incarnation() const noexcept { return incarnation_; }
  /// How many replicas the job has when none is missing.
  int replicas() const noexcept { return count_; }
  /// The ranks of this replica (for its inner layout: FSDP, TP), and this rank's replicate group in the
  /// current quorum (rank l of each member replica).
  const ProcessGroup& replica_group() const noexcept { return replica_group_; }
  const ProcessGroup& replicate_group() const noexcept { return group_; }
  /// Committed steps (the same on every member after start_quorum).
  std::int64_t step() const noexcept { return step_; }

  /// A tensor a restarted replica copies from a member before its first step (parameters, optimizer
  /// state); every rank registers the same tensors in the same order. The tensor shares its memory with
  /// the caller's.
  template <class T, int Rank>
  void register_state(const Tensor<T, Rank>& t) {
    state_.push_back([t](const ProcessGroup& g, int src) { dtensor::broadcast(t, src, g); });
  }

  /// This step's quorum (see the top of this file): waits for the members, rebuilds the replicate groups
  /// when the membership changed or the last step aborted, and sends the state to members that have none.
  Quorum start_quorum() {
    const std::vector<Member> members = decide_members();
    Quorum q;
    q.round = round_;
    q.replica_count = static_cast<int>(members.size());
    int me = -1;
    for (std::size_t i = 0; i < members.size(); ++i) {
      q.replicas.push_back(members[i].replica);
      if (members[i].replica == replica_) {
        me = static_cast<int>(i);
      }
    }
    q.replica_rank = me;
    q.changed = members != previous_ || aborted_ || !have_group_;
    healthy_ = true;
    if (q.changed) {
      if (opt_.verbose && local_ == 0 && !members_equal_ids(members, previous_)) {
        std::printf("[replica %d] quorum %lld at step %lld: %d replica(s) %s\n", replica_,
                    static_cast<long long>(round_), static_cast<long long>(step_), q.replica_count,
                    ids(members).c_str());
        std::fflush(stdout);
      }
      group_ = ProcessGroup();
      have_group_ = false;
      guarded("making the replicate group", [&] {
        BackendOptions bo;
        bo.timeout = timeout_;
        bo.device = env_.local_rank;
        bo.master_addr = env_.master_addr;
        bo.master_port = env_.master_port;
        bo.prefix = backend_;
        auto s = std::make_shared<PrefixStore>(
            "ft/round/" + std::to_string(round_) + "/group/" + std::to_string(local_), store_);
        group_ = ProcessGroup(make_backend(backend_, s, me, q.replica_count, bo));
        have_group_ = true;
      });
    }
    const auto src =
        std::find_if(members.begin(), members.end(), [](const Member& m) { return m.has_state; });
    const bool any_fresh =
        std::any_of(members.begin(), members.end(), [](const Member& m) { return !m.has_state; });
    if (any_fresh && healthy_) {
      const int root = src == members.end() ? 0 : static_cast<int>(src - members.begin());
      guarded("sending the state", [&] {
        for (auto& send : state_) {
          send(group_, root);
        }
        auto s = Tensor<std::int64_t, 1>::full({1}, step_);
        dtensor::broadcast(s, root, group_);
        step_ = s.data()[0];
      });
      q.healed = healthy_ && !has_state_ && root != me;
      has_state_ = has_state_ || healthy_;
    }
    previous_ = members;
    for (Member& m : previous_) {
      m.has_state = true; // whoever completes this round holds the state, or is not a member next round
    }
    return q;
  }

  /// In place over the quorum's replicate group: tensor = op over the members' tensors. Returns false (and
  /// this step will not commit) when the group failed, now or earlier in the step; the error is printed.
  template <class T, int Rank>
  bool all_reduce(const Tensor<T, Rank>& tensor, ReduceOp op) {
    if (healthy_) {
      guarded("all_reduce", [&] { dtensor::all_reduce(tensor, op, group_); });
    }
    return healthy_;
  }

  /// Whether every member of the quorum reduced without error (the same answer on every rank): true
  /// counts the step; false: redo it with the next quorum (the groups are rebuilt).
  bool should_commit() {
    std::int64_t ok = healthy_ ? 1 : 0;
    if (size_ > 1) {
      auto t = Tensor<std::int64_t, 1>::full({1}, ok);
      dtensor::all_reduce(t, ReduceOp::min, replica_group_);
      ok = t.data()[0];
    }
    std::int64_t commit = 0;
    if (local_ == 0) {
      const std::string base = "ft/round/" + std::to_string(round_) + "/";
      store_->set(base + "vote/" + std::to_string(replica_), std::string_view(ok != 0 ? "1" : "0"));
      bool all_yes = true;
      wait_for(previous_, base + "vote/", [&](const Member& m, const std::optional<std::string>& v) {
        if (!v || *v != "1") {
          all_yes = false;
          why_ += (why_.empty() ? "" : ", ") + std::string("replica ") + std::to_string(m.replica) +
                  (v ? " failed" : " did not vote");
        }
      });
      const std::vector<char> d =
          store_->compare_set(base + "decision", {}, bytes(all_yes ? "commit" : "abort"));
      commit = std::string(d.begin(), d.end()) == "commit" ? 1 : 0;
    }
    commit = tell_replica(commit);
    aborted_ = commit == 0;
    if (commit != 0) {
      ++step_;
    } else if (opt_.verbose && local_ == 0) {
      std::printf("[replica %d] step %lld aborted in quorum %lld (%s); redoing it\n", replica_,
                  static_cast<long long>(step_), static_cast<long long>(round_),
                  (last_error_.empty() ? why_ : "this replica's " + last_error_).c_str());
      std::fflush(stdout);
    }
    last_error_.clear();
    why_.clear();
    ++round_;
    return commit != 0;
  }

  /// Says this replica finished: a replica that would join later gets an error instead of waiting.
  void finish() {
    if (local_ == 0) {
      store_->set("ft/finished", std::to_string(step_));
    }
  }

private:
  struct Member {
    int replica = 0;
    int incarnation = 0;
    bool has_state = false;
    bool operator==(const Member&) const = default;
  };

  static std::vector<char> bytes(std::string_view s) { return {s.begin(), s.end()}; }

  static bool members_equal_ids(const std::vector<Member>& a, const std::vector<Member>& b) {
    if (a.size() != b.size()) {
      return false;
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i].replica != b[i].replica || a[i].incarnation != b[i].incarnation) {
        return false;
      }
    }
    return true;
  }

  static std::string ids(const std::vector<Member>& ms) {
    std::string s = "[";
    for (const Member& m : ms) {
      s += (s.size() > 1 ? ", " : "") + std::to_string(m.replica);
    }
    return s + "]";
  }

  /// Runs f; an Error marks this step failed (it will not commit), is remembered for the message, and
  /// closes the replicate group at once: the members still waiting in an op with this rank fail now too,
  /// instead of at their timeout.
  template <class F>
  void guarded(const char* what, F&& f) {
    try {
      f();
    } catch (const Error& e) {
      healthy_ = false;
      group_ = ProcessGroup();
      have_group_ = false;
      if (last_error_.empty()) {
        last_error_ = std::string(what) + ": " + e.what();
      }
    }
  }

  /// Local rank 0's value, on every rank of this replica.
  std::int64_t tell_replica(std::int64_t v) {
    if (size_ == 1) {
      return v;
    }
    auto t = Tensor<std::int64_t, 1>::full({1}, v);
    dtensor::broadcast(t, 0, replica_group_);
    return t.data()[0];
  }

  /// Whether `m` is known to have ended: dtensor-run recorded its exit, or a newer start of it announced
  /// itself.
  bool ended(const Member& m) {
    const std::string r = std::to_string(m.replica);
    if (store_->check({"dtensor-run/replica-exit/" + r + "/" + std::to_string(m.incarnation)})) {
      return true;
    }
    const auto inc = store_->try_get("ft/incarnation/" + r);
    return inc && std::stoi(std::string(inc->begin(), inc->end())) > m.incarnation;
  }

  /// Waits until every one of `members` set `prefix`<replica> or is known to have ended, or join_timeout
  /// passed; then calls seen(member, value or nullopt) for each.
  template <class Seen>
  void wait_for(const std::vector<Member>& members, const std::string& prefix, Seen&& seen) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.join_timeout;
    for (const Member& m : members) {
      const std::string key = prefix + std::to_string(m.replica);
      for (;;) {
        if (store_->check({key}) || ended(m) || std::chrono::steady_clock::now() >= deadline) {
          break;
        }
        try {
          store_->wait({key}, std::chrono::milliseconds(20));
        } catch (const TimeoutError&) {
        }
      }
    }
    for (const Member& m : members) {
      auto v = store_->try_get(prefix + std::to_string(m.replica));
      seen(m, v ? std::optional<std::string>(std::string(v->begin(), v->end())) : std::nullopt);
    }
  }

  std::string join_value() const { return std::to_string(incarnation_) + " " + (has_state_ ? "1" : "0"); }

  /// The members of this step's round, on every rank of the replica (see the top of this file).
  std::vector<Member> decide_members() {
    std::vector<std::int64_t> flat;
    if (local_ == 0) {
      flat = encode(leader_decide());
    }
    // The round and the members, from local rank 0 to the replica's other ranks.
    std::int64_t n = tell_replica(static_cast<std::int64_t>(flat.size()));
    flat.resize(static_cast<std::size_t>(n));
    if (size_ > 1) {
      auto t = Tensor<std::int64_t, 1>::from_blob(flat.data(), {n});
      dtensor::broadcast(t, 0, replica_group_);
    }
    round_ = flat[0];
    std::vector<Member> ms;
    for (std::size_t i = 1; i + 2 < flat.size(); i += 3) {
      ms.push_back({static_cast<int>(flat[i]), static_cast<int>(flat[i + 1]), flat[i + 2] != 0});
    }
    return ms;
  }

  std::vector<std::int64_t> encode(const std::vector<Member>& ms) const {
    std::vector<std::int64_t> flat{round_};
    for (const Member& m : ms) {
      flat.insert(flat.end(), {m.replica, m.incarnation, m.has_state ? 1 : 0});
    }
    return flat;
  }

  std::vector<Member> parse_members(const std::vector<char>& v) const {
    std::vector<Member> ms;
    std::istringstream in(std::string(v.begin(), v.end()));
    Member m;
    int s = 0;
    while (in >> m.replica >> m.incarnation >> s) {
      m.has_state = s != 0;
      ms.push_back(m);
    }
    return ms;
  }

  std::vector<Member> leader_decide() {
    const bool newcomer = previous_.empty();
    if (newcomer && !joined_once_) {
      const auto latest = store_->try_get("ft/latest");
      round_ = latest ? std::stoll(std::string(latest->begin(), latest->end())) + 1 : 0;
    }
    joined_once_ = true;
    for (;;) {
      const std::string base = "ft/round/" + std::to_string(round_) + "/";
      const std::string decided_key = base + "members";
      store_->set(base + "join/" + std::to_string(replica_), join_value());
      if (!previous_.empty()) {
        std::vector<Member> joined;
        wait_for(previous_, base + "join/", [](const Member&, const std::optional<std::string>&) {});
        for (int r = 0; r < count_; ++r) {
          if (auto v = store_->try_get(base + "join/" + std::to_string(r))) {
            std::istringstream in(std::string(v->begin(), v->end()));
            Member m{r, 0, false};
            int s = 0;
            in >> m.incarnation >> s;
            m.has_state = s != 0;
            joined.push_back(m); // a previous member that restarted since joins as a new start of it
          }
        }
        std::string text;
        for (const Member& m : joined) {
          text += std::to_string(m.replica) + " " + std::to_string(m.incarnation) + " " +
                  (m.has_state ? "1 " : "0 ");
        }
        store_->compare_set(decided_key, {}, bytes(text));
      } else {
        const auto deadline = std::chrono::steady_clock::now() + timeout_;
        while (!store_->check({decided_key})) {
          if (auto f = store_->try_get("ft/finished")) {
            throw Error("ReplicaManager: replica " + std::to_string(replica_) + " (start " +
                        std::to_string(incarnation_) + ") cannot join: the other replicas finished at step " +
                        std::string(f->begin(), f->end()));
          }
          if (std::chrono::steady_clock::now() >= deadline) {
            throw TimeoutError("ReplicaManager: replica " + std::to_string(replica_) + " (start " +
                               std::to_string(incarnation_) + ") waited " + std::to_string(timeout_.count()) +
                               " ms for quorum " + std::to_string(round_) + " to be decided");
          }
          try {
            store_->wait({decided_key}, std::chrono::milliseconds(50));
          } catch (const TimeoutError&) {
          }
        }
      }
      const std::vector<Member> ms = parse_members(store_->get(decided_key));
      store_->set("ft/latest", std::to_string(round_));
      if (std::any_of(ms.begin(), ms.end(), [&](const Member& m) { return m.replica == replica_; })) {
        return ms;
      }
      // Left out (joined late, or too slow): a newcomer from now on, in the next round.
      previous_.clear();
      has_state_ = false;
      ++round_;
    }
  }

  ReplicaOptions opt_;
  std::chrono::milliseconds timeout_{};
  std::string backend_;
  DistEnv env_;
  int size_ = 1;
  int incarnation_ = 0;
  int replica_ = 0;
  int local_ = 0;
  int count_ = 1;
  std::shared_ptr<Store> store_;
  ProcessGroup replica_group_;
  ProcessGroup group_;
  std::vector<std::function<void(const ProcessGroup&, int)>> state_;
  std::vector<Member> previous_;
  std::int64_t round_ = 0;
  std::int64_t step_ = 0;
  bool joined_once_ = false;
  bool have_group_ = false;
  bool has_state_ = false;
  bool healthy_ = true;
  bool aborted_ = false;
  std::string last_error_;
  std::string why_; // the members that voted no or not at all, for the message
};

} // namespace dtensor
