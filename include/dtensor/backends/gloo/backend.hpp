#pragma once
// The gloo backend: dtensor::Backend over a gloo context (TCP transport), registered as "gloo".
//
//   auto store = std::make_shared<dtensor::InProcessStore>();   // or a TcpStore: any dtensor::Store
//   dtensor::ProcessGroup world(dtensor::make_gloo_backend(store, rank, size, {.timeout = 10s}));
//   // usually: auto world = dtensor::init_process_group();   (DTENSOR_BACKEND=gloo, or no GPU visible)
//
// Design (see also backends/backend.hpp, whose front checks every argument before a hook here runs):
//  - Ops run in submission order on a per-group SerialExecutor (executor.hpp): on the caller's thread for
//    synchronous ops when the group is idle (then with no allocation: counts are read in place and the
//    returned work is a shared, completed one), else on the group's worker thread. Point-to-point ops are
//    only *posted* in that order (posting never blocks); the wait for their transfers runs on the first
//    thread that waits for the work (the caller, usually: no thread hop), or on a second per-group thread
//    once the work is polled or dropped (work.hpp, DeferredWork). So a posted irecv never blocks a later
//    collective or send, batches complete independently, and 1F1B exchanges cannot deadlock.
//  - all_reduce (ring), reduce, broadcast, barrier and all_gather of equal blocks are gloo's algorithms.
//    all_gather of uneven blocks, all_to_all, gather, scatter and reduce_scatter are the host algorithms
//    of backends/generic/ over GlooTransport (transfer.hpp). reduce_scatter is one direct exchange plus a
//    fold in rank order (bitwise reproducible); gloo's ReduceScatterHalvingDoubling is not used, as it
//    leaves the context slower for later ops.
//  - Scratch memory (reduce's non-root output, reduce_scatter's receive blocks) is one buffer per group,
//    grown on demand, never zero-filled, kept for later ops (GlooTransport::scratch).
//  - Tags: see transfer.hpp (gloo's collectives, dtensor's collectives and point-to-point use disjoint
//    slot spaces).
//  - Failures (context.hpp): a gloo timeout becomes dtensor::TimeoutError. When an op fails, this rank
//    leaves the reason in the group's store and gloo closes its connections, so peers blocked on it fail at
//    once with the root cause. abort() does the same on demand.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/factory_checks.hpp"
#include "dtensor/backends/generic/all_to_all.hpp"
#include "dtensor/backends/generic/gather_scatter.hpp"
#include "dtensor/backends/generic/reduce_scatter.hpp"
#include "dtensor/backends/gloo/context.hpp"
#include "dtensor/backends/gloo/executor.hpp"
#include "dtensor/backends/gloo/rendezvous.hpp"
#include "dtensor/backends/gloo/transfer.hpp"
#include "dtensor/backends/gloo/types.hpp"
#include "dtensor/backends/gloo/work.hpp"
#include "dtensor/backends/group_generations.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/detail/tcp.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <signal.h>
#include <unistd.h>

namespace dtensor {

/// Options of make_gloo_backend.
struct GlooOptions {
  /// Default timeout of every op (and of the rendezvous): core/timeout.hpp's policy.
  std::chrono::milliseconds timeout = kDefaultOpTimeout;
  /// Address the TCP transport binds to.
  std::string hostname = "127.0.0.1";
  /// Network interface to bind to instead of `hostname` (e.g. "eth0"), if not empty.
  std::string iface;
  /// Key prefix in the store (distinct jobs sharing a store use distinct prefixes).
  std::string prefix = "dtensor";
};

namespace detail {

/// What the groups of one rank share: the transport device, the root store, the groups (to abort them
/// all), and the new_group rendezvous counts.
struct GlooRankState {
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<Store> store;
  int global_rank = 0;
  /// Key prefix of this rank's groups in `store` (GlooOptions::prefix).
  std::string prefix;
  /// `store` under `prefix`: what the rank's groups share (Backend::rank_store).
  std::shared_ptr<Store> rank_store;
  GroupGenerations generations;

  std::mutex m;
  std::vector<std::weak_ptr<Backend>> groups;
  std::optional<std::string> aborted;

  /// Adds a group (forgetting those destroyed); aborts it at once when this rank was aborted before.
  void add_group(const std::shared_ptr<Backend>& group) {
    std::optional<std::string> reason;
    {
      std::lock_guard lock(m);
      std::erase_if(groups, [](const std::weak_ptr<Backend>& g) { return g.expired(); });
      groups.push_back(group);
      reason = aborted;
    }
    if (reason) {
      group->abort(*reason);
    }
  }

  /// Aborts every group of this rank (the world group and all sub-groups), and those made later.
  void abort_all(std::string_view reason) {
    std::vector<std::shared_ptr<Backend>> live;
    {
      std::lock_guard lock(m);
      if (!aborted) {
        aborted = std::string(reason);
      }
      for (auto& w : groups) {
        if (auto g = w.lock()) {
          live.push_back(std::move(g));
        }
      }
    }
    for (auto& g : live) {
      g->abort(reason);
    }
  }
};

class GlooBackendImpl final : public Backend, public std::enable_shared_from_this<GlooBackendImpl> {
public:
  using Ms = std::chrono::milliseconds;

  /// Connects to the other members (blocks until they all arrived or the timeout passed). Use create().
  GlooBackendImpl(std::shared_ptr<GlooRankState> state, std::string prefix, std::vector<int> global_ranks,
                  int rank, std::chrono::milliseconds timeout)
      : Backend(timeout), state_(std::move(state)), prefix_(std::move(prefix)),
        store_(std::make_shared<PrefixStore>(prefix_, state_->store)), global_ranks_(std::move(global_ranks)),
        rank_(rank), context_(std::make_shared<GlooContext>(rank_, size())), transport_(context_),
        failures_(store_, state_->store, global_ranks_, rank_) {
    store_->set_timeout(timeout);
    context_->setTimeout(timeout);
    connect_full_mesh(*context_, store_, state_->device, rank_, size(), timeout, describe());
  }

  ~GlooBackendImpl() override {
    // Executors drain (and join) before the context goes away.
    completer_.reset();
    executor_.reset();
  }

  /// A connected group, known to its rank's state (so abort_gloo_rank reaches it).
  static std::shared_ptr<GlooBackendImpl> create(std::shared_ptr<GlooRankState> state, std::string prefix,
                                                 std::vector<int> global_ranks, int rank,
                                                 std::chrono::milliseconds timeout) {
    auto g =
        std::make_shared<GlooBackendImpl>(state, std::move(prefix), std::move(global_ranks), rank, timeout);
    state->add_group(g);
    return g;
  }

  // ---- identity ---------------------------------------------------------------------------------------
  std::string_view name() const noexcept override { return "gloo"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(global_ranks_.size()); }
  std::span<const int> global_ranks() const noexcept override { return global_ranks_; }
  std::string describe() const override {
    return "rank " + std::to_string(rank_) + " (global " + std::to_string(state_->global_rank) +
           ") of gloo group " + format_list(global_ranks_);
  }

  /// Aborts every group this rank created (the world group and all sub-groups).
  void abort_rank(std::string_view reason) { state_->abort_all(reason); }

protected:
  // ---- collectives ------------------------------------------------------------------------------------

  WorkPtr do_all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) override {
    OpDesc d{"all_reduce", 0, buf.count, buf.dtype, -1, static_cast<int>(op)};
    return submit(d, opts, {}, [this, buf, op](const OpDesc& od, Ms t, const OpArrays&) {
      if (buf.count > 0 && size() > 1) {
        ::gloo::AllreduceOptions o(context_);
        QuiesceOnThrow quiesce(*context_); // destroyed before o on a failure
        with_gloo_type(buf.dtype, [&]<class T>(T) {
          o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
        });
        o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
        o.setReduceFunction(reduce_function(buf.dtype, op));
        o.setTag(od.tag());
        o.setTimeout(t);
        ::gloo::allreduce(o);
      }
      if (op == ReduceOp::avg) {
        divide_in_place(buf.data, buf.count, buf.dtype, size());
      }
    });
  }

  WorkPtr do_reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) override {
    OpDesc d{"reduce", 0, buf.count, buf.dtype, root, static_cast<int>(op)};
    return submit(d, opts, {}, [this, buf, root, op](const OpDesc& od, Ms t, const OpArrays&) {
      if (buf.count > 0 && size() > 1) {
        ::gloo::ReduceOptions o(context_);
        QuiesceOnThrow quiesce(*context_); // destroyed before o on a failure
        with_gloo_type(buf.dtype, [&]<class T>(T) {
          if (rank_ == root) {
            o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
          } else { // gloo's ring reduce writes partial results into its output: keep buf intact
            o.setInput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
            o.setOutput(reinterpret_cast<T*>(transport_.scratch(buf.nbytes())),
                        static_cast<std::size_t>(buf.count));
          }
        });
        o.setRoot(root);
        o.setReduceFunction(reduce_function(buf.dtype, op));
        o.setTag(od.tag());
        o.setTimeout(t);
        ::gloo::reduce(o);
      }
      if (op == ReduceOp::avg && rank_ == root) {
        divide_in_place(buf.data, buf.count, buf.dtype, size());
      }
    });
  }

  WorkPtr do_broadcast(BufferRef buf, int root, const CommOptions& opts) override {
    OpDesc d{"broadcast", 0, buf.count, buf.dtype, root};
    return submit(d, opts, {}, [this, buf, root](const OpDesc& od, Ms t, const OpArrays&) {
      if (buf.count == 0 || size() == 1) {
        return;
      }
      ::gloo::BroadcastOptions o(context_);
      QuiesceOnThrow quiesce(*context_); // destroyed before o on a failure
      with_gloo_type(buf.dtype, [&]<class T>(T) {
        o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
      });
      o.setRoot(root);
      o.setTag(od.tag());
      o.setTimeout(t);
      ::gloo::broadcast(o);
    });
  }

  WorkPtr do_all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                        std::span<const std::int64_t> displs, const CommOptions& opts) override {
    OpDesc d{"all_gather", 0, in.count, in.dtype};
    const bool even = std::all_of(counts.begin(), counts.end(), [&](auto c) { return c == counts[0]; }) &&
                      packed_in_order(counts, displs);
    d.count_agrees = even;
    return submit(d, opts, {counts, displs},
                  [this, in, out, even](const OpDesc& od, Ms t, const OpArrays& l) {
                    if (even && in.count > 0 && size() > 1) {
                      ::gloo::AllgatherOptions o(context_);
                      QuiesceOnThrow quiesce(*context_); // destroyed before o on a failure
                      with_gloo_type(in.dtype, [&]<class T>(T) {
                        o.setInput(static_cast<T*>(in.data), static_cast<std::size_t>(in.count));
                        o.setOutput(static_cast<T*>(out.data), static_cast<std::size_t>(out.count));
                      });
                      o.setTag(od.tag());
                      o.setTimeout(t);
                      ::gloo::allgather(o);
                      return;
                    }
                    // Uneven or empty blocks: everyone sends its block to everyone.
                    generic::all_gather(transport_, in, out, l[0], l[1], collective_slot(od.tag()),
                                        GlooClock::now() + t);
                  });
  }

  WorkPtr do_reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                            std::span<const std::int64_t> displs, ReduceOp op,
                            const CommOptions& opts) override {
    OpDesc d{"reduce_scatter", 0, in.count, in.dtype, -1, static_cast<int>(op), false};
    return submit(d, opts, {counts, displs}, [this, in, out, op](const OpDesc& od, Ms t, const OpArrays& l) {
      generic::reduce_scatter(transport_, in, out, l[0], l[1], op, collective_slot(od.tag()),
                              GlooClock::now() + t);
    });
  }

  WorkPtr do_all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, BufferRef out,
                        std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                        const CommOptions& opts) override {
    OpDesc d{"all_to_all", 0, in.count, in.dtype, -1, -1, false};
    return submit(d, opts, {send_counts, send_displs, recv_counts, recv_displs},
                  [this, in, out](const OpDesc& od, Ms t, const OpArrays& l) {
                    generic::all_to_all(transport_, in, l[0], l[1], out, l[2], l[3],
                                        collective_slot(od.tag()), GlooClock::now() + t);
                  });
  }

  WorkPtr do_gather(BufferRef in, std::span<const BufferRef> blocks, int root,
                    const CommOptions& opts) override {
    OpDesc d{"gather", 0, in.count, in.dtype, root, -1, false};
    OpArrays a;
    if (rank_ == root) {
      a.blocks = blocks;
    }
    return submit(d, opts, a, [this, in, root](const OpDesc& od, Ms t, const OpArrays& a) {
      generic::gather(transport_, in, a.blocks, root, collective_slot(od.tag()), GlooClock::now() + t);
    });
  }

  WorkPtr do_scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                     const CommOptions& opts) override {
    OpDesc d{"scatter", 0, out.count, out.dtype, root, -1, false};
    OpArrays a;
    if (rank_ == root) {
      a.blocks = blocks;
    }
    return submit(d, opts, a, [this, out, root](const OpDesc& od, Ms t, const OpArrays& a) {
      generic::scatter(transport_, a.blocks, out, root, collective_slot(od.tag()), GlooClock::now() + t);
    });
  }

  WorkPtr do_barrier(const CommOptions& opts) override {
    OpDesc d{"barrier", 0, 0, DType::uint8};
    return submit(d, opts, {}, [this](const OpDesc& od, Ms t, const OpArrays&) {
      if (size() == 1) {
        return;
      }
      ::gloo::BarrierOptions o(context_);
      QuiesceOnThrow quiesce(*context_); // destroyed before o on a failure
      o.setTag(od.tag());
      o.setTimeout(t);
      ::gloo::barrier(o);
    });
  }

  // ---- point to point ---------------------------------------------------------------------------------

  WorkPtr do_p2p(std::span<const P2PRequest> requests, const CommOptions& opts) override {
    struct Posted {
      P2PRequest req;
      std::uint64_t slot;
    };
    auto posted = std::make_shared<std::vector<Posted>>();
    posted->reserve(requests.size());
    {
      std::lock_guard lock(m_);
      for (const auto& r : requests) {
        const bool is_send = r.kind == P2PRequest::Kind::send;
        const int src = is_send ? rank_ : r.peer;
        const int dst = is_send ? r.peer : rank_;
        auto& seq = p2p_seq_[std::tuple{r.peer, r.tag, is_send}];
        posted->push_back(
            {r, p2p_slot(src < dst, r.tag, seq++, r.buffer.nbytes(), static_cast<int>(r.buffer.dtype))});
      }
    }
    OpDesc d{requests.size() == 1 ? (requests[0].kind == P2PRequest::Kind::send ? "send" : "recv")
                                  : "batch_isend_irecv",
             0, requests.empty() ? 0 : requests[0].buffer.count,
             requests.empty() ? DType::uint8 : requests[0].buffer.dtype};
    if (requests.size() == 1) {
      d.root = requests[0].peer;
    }
    d.flight = flight_recorder().submitted(d.name, d.count, d.dtype, d.root);
    // Posted in order on the executor (on this thread when the group is idle); the wait for the transfers
    // runs on the thread that first waits for the work (see DeferredWork), so a synchronous send/recv or
    // a batch waited at once costs no thread hop, and a posted irecv never blocks anything else.
    auto work = std::make_shared<DeferredWork>(*completer_);
    const auto t = effective_timeout(opts);
    auto self = shared_from_this();
    executor_->submit(
        [self, work, posted, d, t] {
          const auto start = GlooClock::now();
          self->flight_recorder().started(d.flight);
          auto bufs = std::make_shared<std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>>>();
          try {
            bufs->reserve(posted->size());
            for (const auto& p : *posted) {
              if (p.req.buffer.count == 0) {
                bufs->push_back(nullptr);
                continue;
              }
              auto ub = self->context_->createUnboundBuffer(p.req.buffer.data, p.req.buffer.nbytes());
              if (p.req.kind == P2PRequest::Kind::send) {
                ub->send(p.req.peer, p.slot);
              } else {
                ub->recv(p.req.peer, p.slot);
              }
              bufs->push_back(std::move(ub));
            }
          } catch (...) {
            quiesce_transport(*self->context_); // before the buffers posted so far go
            auto error = self->translate(std::current_exception(), d, start);
            self->flight_recorder().finished(d.flight, false);
            work->finish(std::move(error));
            return;
          }
          work->posted([self, posted, bufs, d, t, start]() -> std::exception_ptr {
            try {
              const auto deadline = start + t;
              for (std::size_t i = 0; i < bufs->size(); ++i) {
                auto& ub = (*bufs)[i];
                if (!ub) {
                  continue;
                }
                const auto left = remaining(deadline);
                const bool ok =
                    (*posted)[i].req.kind == P2PRequest::Kind::send ? ub->waitSend(left) : ub->waitRecv(left);
                if (!ok) {
                  throw Error("the operation was aborted");
                }
              }
              self->flight_recorder().finished(d.flight, true);
              return nullptr;
            } catch (...) {
              quiesce_transport(*self->context_); // before the buffers go
              auto error = self->translate(std::current_exception(), d, start);
              self->flight_recorder().finished(d.flight, false);
              return error;
            }
          });
        },
        /*inline_if_idle=*/true);
    return work;
  }

  // ---- groups -----------------------------------------------------------------------------------------

  /// Only the members take part (torch's use_local_synchronization): they rendezvous under a store key
  /// made of their global ranks and how many groups over that list this rank made before
  /// (GroupGenerations), so ranks outside the list need not call, and never wait.
  std::shared_ptr<Backend> do_new_group(std::vector<int> global, int rank) override {
    std::string prefix = state_->prefix + "/" + state_->generations.next_name(global);
    return create(state_, std::move(prefix), std::move(global), rank, timeout());
  }

  std::shared_ptr<Backend> do_split(const SplitGroup& g) override {
    if (g.rank < 0) {
      return nullptr;
    }
    return create(state_, prefix_ + "/s" + std::to_string(g.index) + "c" + std::to_string(g.color),
                  g.global_ranks, g.rank, timeout());
  }

  Store* split_store() override { return store_.get(); }
  Store* rank_store() override { return state_->rank_store.get(); }

  void do_abort(std::string_view reason) override {
    const std::string why(reason);
    failures_.publish(false, describe() + " was aborted: " + why);
    context_->signal_exception("dtensor: " + describe() + " aborted: " + why);
  }

  void check_memory(const char* op, const BufferRef& b, const char* what) const override {
    DTENSOR_CHECK(b.device.is_cpu(), where(op) + ": the " + what + " is on " + b.device.to_string() +
                                         ", but the gloo backend only handles host (cpu) tensors");
  }

private:
  // ---- submission ---------------------------------------------------------------------------------------

  std::chrono::milliseconds effective_timeout(const CommOptions& opts) const {
    return opts.timeout.count() > 0 ? opts.timeout : timeout();
  }

  /// The Error / TimeoutError wait() rethrows for op `d`, which failed with `e` (context.hpp).
  std::exception_ptr translate(std::exception_ptr e, const OpDesc& d, GlooClock::time_point start) {
    return failures_.translate(std::move(e), d, where(d.to_string()), timeout(), aborted(), start,
                               flight_recorder().dump());
  }

  /// Runs `body(desc, timeout, arrays)` in submission order. A blocking op on an idle group runs on this
  /// thread with nothing allocated (the caller's arrays are read in place; the returned work is a shared,
  /// already completed one unless the op failed); otherwise it is queued on the group's worker.
  template <class Body>
  WorkPtr submit(OpDesc d, const CommOptions& opts, OpArrays arrays, Body body) {
    {
      std::lock_guard lock(m_);
      d.seq = seq_++;
    }
    const auto t = effective_timeout(opts);
    if (opts.blocking) {
      std::exception_ptr error;
      const bool ran = executor_->run_inline_if_idle([&] {
        const auto start = GlooClock::now();
        d.flight =
            flight_recorder().submitted(d.name, d.count, d.dtype, d.root, d.reduce, /*running=*/true, start);
        try {
          body(d, t, arrays);
        } catch (...) {
          error = translate(std::current_exception(), d, start);
        }
        flight_recorder().finished(d.flight, !error);
      });
      if (ran) {
        if (!error) {
          return completed_work();
        }
        auto work = std::make_shared<HostWork>();
        work->finish(std::move(error));
        return work;
      }
    }
    d.flight = flight_recorder().submitted(d.name, d.count, d.dtype, d.root, d.reduce);
    arrays.own();
    auto work = std::make_shared<HostWork>();
    auto self = shared_from_this();
    executor_->submit(
        [self, work, d, t, arrays = std::move(arrays), body = std::move(body)] {
          const auto start = GlooClock::now();
          self->flight_recorder().started(d.flight);
          try {
            body(d, t, arrays);
            self->flight_recorder().finished(d.flight, true);
            work->finish();
          } catch (...) {
            auto error = self->translate(std::current_exception(), d, start);
            self->flight_recorder().finished(d.flight, false);
            work->finish(std::move(error));
          }
        },
        /*inline_if_idle=*/false);
    return work;
  }

  std::shared_ptr<GlooRankState> state_;
  std::string prefix_;
  std::shared_ptr<PrefixStore> store_;
  std::vector<int> global_ranks_;
  int rank_;
  std::shared_ptr<GlooContext> context_;
  GlooTransport transport_; // used by the op on the executor (one at a time)
  GlooFailures failures_;

  std::mutex m_;
  std::uint32_t seq_ = 0;
  std::map<std::tuple<int, int, bool>, std::uint32_t> p2p_seq_;

  std::unique_ptr<SerialExecutor> executor_ = std::make_unique<SerialExecutor>();
  std::unique_ptr<SerialExecutor> completer_ = std::make_unique<SerialExecutor>();
};

} // namespace detail

/// A gloo communicator over all `size` ranks that rendezvous through `store` (under options.prefix; each
/// sub-group under its own prefix below it); this process is `rank`. Blocks until every rank arrived (or
/// options.timeout passed: dtensor::TimeoutError).
/// Wrap it in a dtensor::ProcessGroup: `ProcessGroup world(make_gloo_backend(store, rank, size));`.
inline std::shared_ptr<Backend> make_gloo_backend(std::shared_ptr<Store> store, int rank, int size,
                                                  GlooOptions options = {}) {
  detail::check_world_rank(rank, size, "make_gloo_backend");
  DTENSOR_CHECK(store != nullptr, "make_gloo_backend: the store is null");
  detail::check_timeout(options.timeout, "make_gloo_backend");
  // gloo's TCP transport writes without MSG_NOSIGNAL: a write to a peer that just closed (it failed or
  // aborted) would kill the process with SIGPIPE instead of failing the op. Python (hence PyTorch) ignores
  // SIGPIPE at startup; do the same unless the program installed its own handler.
  {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  }
  ::gloo::transport::tcp::attr attr;
  if (!options.iface.empty()) {
    attr.iface = options.iface;
  } else {
    attr.hostname = options.hostname;
  }
  auto state = std::make_shared<detail::GlooRankState>();
  state->device = ::gloo::transport::tcp::CreateDevice(attr);
  state->store = std::move(store);
  state->global_rank = rank;
  state->prefix = options.prefix;
  state->rank_store = detail::prefixed_store(options.prefix, state->store); // not null: checked above
  return detail::GlooBackendImpl::create(state, options.prefix + "/world", detail::world_ranks(size), rank,
                                         options.timeout);
}

/// Aborts every group `backend`'s rank created (world and sub-groups): their pending and future ops fail
/// with `reason`, and peers blocked on this rank are released within seconds.
inline void abort_gloo_rank(Backend& backend, std::string_view reason) {
  if (auto* g = dynamic_cast<detail::GlooBackendImpl*>(&backend)) {
    g->abort_rank(reason);
  } else {
    backend.abort(reason);
  }
}

namespace detail {

/// The "gloo" entry of the backend registry (what init_process_group makes): binds to the first interface
/// of GLOO_SOCKET_IFNAME when it is set, else to the local address that routes to the store's host
/// (127.0.0.1 when that host is this machine), else, for a job that met through MPI on several machines,
/// to this machine's host name.
inline std::shared_ptr<Backend> make_gloo_backend_for_job(std::shared_ptr<Store> store, int rank, int size,
                                                          const BackendOptions& options) {
  GlooOptions go;
  go.timeout = options.timeout;
  go.prefix = options.prefix;
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  if (iface != nullptr && *iface != '\0') {
    const std::string list(iface);
    go.iface = list.substr(0, list.find(','));
  } else if (options.master_addr.empty() && size > 1) { // met through MPI on several machines
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) == 0 && host[0] != '\0') {
      go.hostname = host;
    }
  } else if (!tcp::is_loopback(options.master_addr) && size > 1) {
    const std::string local = tcp::local_address_towards(options.master_addr, options.master_port);
    if (!local.empty()) {
      go.hostname = local;
    }
  }
  return make_gloo_backend(std::move(store), rank, size, go);
}

/// gloo is always usable, at the lowest priority for "auto".
inline const bool gloo_backend_registered = [] {
  register_backend("gloo", make_gloo_backend_for_job, BackendTraits{[] { return true; }, 0});
  return true;
}();

} // namespace detail

} // namespace dtensor
