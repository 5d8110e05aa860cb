#pragma once
// The gloo backend: dtensor::Backend over a gloo context (TCP transport).
//
//   auto store = std::make_shared<dtensor::InProcessStore>();   // or a TcpStore: any dtensor::Store
//   dtensor::ProcessGroup world(dtensor::make_gloo_backend(store, rank, size, {.timeout = 10s}));
//
// Design (see also backends/backend.hpp):
//  - Ops run in submission order on a per-group SerialExecutor: on the caller's thread for synchronous
//    ops when the group is idle (then with no allocation: counts are read in place and the returned work
//    is a shared, completed one), else on the group's worker thread. Point-to-point ops are only *posted*
//    in that order (posting never blocks); the wait for their transfers runs on the first thread that
//    waits for the work (the caller, usually: no thread hop), or on a second per-group thread once the
//    work is polled or dropped (executor.hpp, DeferredWork). So a posted irecv never blocks a later
//    collective or send, batches complete independently, and 1F1B exchanges cannot deadlock.
//  - Scratch memory (reduce's non-root output, reduce_scatter's receive blocks) is one buffer per group,
//    grown on demand, never zero-filled, kept for later ops (the group's largest need so far).
//  - Tags (gloo slots are 64-bit): gloo's collectives use slot prefixes 0x01..0x08 in the top byte with a
//    per-group sequence number as tag; our own collectives use top byte 0x40 with the same sequence
//    number; point-to-point uses top byte 0x80 | direction bit, 23 bits of user tag and a 32-bit sequence
//    number per (peer, tag, direction). The three spaces are disjoint; successive sends a->b with one
//    tag match successive receives in order.
//  - reduce_scatter: each member sends block i straight to member i (one round; a rank receives (n-1)/n
//    of its input, like a ring, which needs n-1 rounds), into the group's scratch; blocks are folded into
//    the output in rank order while later ones still arrive, so results are bitwise reproducible and the
//    same as a rank-order reduction (run_reduce_scatter). A ring would fold in a rotating order and pay
//    n-1 latencies. gloo's ReduceScatterHalvingDoubling is not used (it leaves the context ~70x slower
//    afterwards). Ours / gloo's halving-doubling, processes over loopback on the 2-core dev machine
//    (shared, so noisy), float32, median of the ratios of 3 interleaved runs (each ours vs raw in one run):
//        input        2 processes                  4 processes
//                     before*  ->  now              before*  ->  now
//        8-16 B       1.42-1.67    1.07-1.08        0.86         0.86
//        64 KiB       1.95         1.30             1.00         0.93
//        1 MiB        1.76         1.43             1.14         0.89
//        16 MiB       1.36         0.91             1.32         1.07
//    (*before: an all_to_all into a zero-filled n-block buffer allocated per call, reduced after the
//    whole exchange.) A 4 B all_reduce after it costs what it costs before it: no degradation.
//    (all_reduce + copy is kept behind GlooOptions::reduce_scatter_via_all_reduce for re-measuring; at
//    1 MiB on 4 threads it took 6.3-10.1 ms against the exchange's 1.85-2.3 ms.)
//  - Failures: a gloo timeout becomes dtensor::TimeoutError. When an op fails, this rank leaves the reason
//    in the group's store under "err/<rank>" and gloo closes its connections, so peers blocked on it fail
//    at once; a peer whose op fails with a transport error reads the members' reasons (up to 1 s) and
//    reports the root cause (a peer's timeout stays a TimeoutError). abort() does the same on demand.

#include "dtensor/backends/backend.hpp"
#include "dtensor/backends/gloo/executor.hpp"
#include "dtensor/backends/gloo/reduce.hpp"
#include "dtensor/backends/gloo/rendezvous.hpp"
#include "dtensor/backends/split.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <vector>

#include <signal.h>

namespace dtensor {

/// Options of make_gloo_backend.
struct GlooOptions {
  /// Default timeout of every op (and of the rendezvous).
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  /// Address the TCP transport binds to.
  std::string hostname = "127.0.0.1";
  /// Network interface to bind to instead of `hostname` (e.g. "eth0"), if not empty.
  std::string iface;
  /// Key prefix in the store (distinct jobs sharing a store use distinct prefixes).
  std::string prefix = "dtensor";
  /// Measurement switch: run reduce_scatter as all_reduce + copy instead of all_to_all + local reduce.
  bool reduce_scatter_via_all_reduce = false;
};

namespace detail {

// gloo 0.5's public tcp/pair.h cannot be included (it needs an uninstalled header), so the one call we
// need -- the one gloo makes itself when an op times out: fail every pending op of a context and close its
// connections -- is declared here by its exported symbol. Called only after checking the dynamic type.
void gloo_tcp_context_signal_exception(void* tcp_context, const std::string& msg) __asm__(
    "_ZN4gloo9transport3tcp7Context15signalExceptionERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");

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
    if (std::strcmp(typeid(*tc).name(), "N4gloo9transport3tcp7ContextE") == 0) {
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

class GlooBackendImpl;

/// What the groups of one rank share: the transport device, the root store, the list of groups (for
/// aborting them all).
struct GlooRankState {
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<Store> store;
  int global_rank = 0;
  GlooOptions options;
  std::mutex m;
  std::vector<std::weak_ptr<GlooBackendImpl>> groups;
  std::optional<std::string> aborted;
  /// Groups this rank made with new_group, per member list (global ranks, in group order): the members
  /// of a list make its groups in the same order, so the count names the rendezvous of the next one.
  std::map<std::vector<int>, int> generations;
};

inline std::string join_ints(std::span<const int> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    s += (i ? "," : "") + std::to_string(v[i]);
  }
  return s + "]";
}

inline std::string join_counts(std::span<const std::int64_t> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    s += (i ? "," : "") + std::to_string(v[i]);
  }
  return s + "]";
}

/// What an op is, for messages (built only when something fails).
struct OpDesc {
  const char* name = "";
  std::uint32_t seq = 0;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  int root = -1;
  int reduce = -1;

  /// Ops whose messages match only when the members agree on every block size (see sized()).
  bool sizes_must_match() const {
    const std::string_view n(name);
    return n == "gather" || n == "scatter" || n == "all_to_all" || n == "all_gather" || n == "reduce_scatter";
  }

  std::string to_string() const {
    std::string s = std::string(name) + " #" + std::to_string(seq) + " (" + std::to_string(count) + " x " +
                    std::string(dtype_name(dtype));
    if (reduce >= 0) {
      s += ", op " + std::string(dtensor::to_string(static_cast<ReduceOp>(reduce)));
    }
    if (root >= 0) {
      s += ", root " + std::to_string(root);
    }
    return s + ")";
  }
};

using Clock = std::chrono::steady_clock;

class GlooBackendImpl final : public Backend, public std::enable_shared_from_this<GlooBackendImpl> {
public:
  using Ms = std::chrono::milliseconds;

  /// Connects to the other members (blocks until they all arrived or the timeout passed).
  GlooBackendImpl(std::shared_ptr<GlooRankState> state, std::string prefix, std::vector<int> global_ranks,
                  int rank, std::chrono::milliseconds timeout)
      : state_(std::move(state)), prefix_(std::move(prefix)),
        store_(std::make_shared<PrefixStore>(prefix_, state_->store)), global_ranks_(std::move(global_ranks)),
        rank_(rank), timeout_(timeout) {
    store_->set_timeout(timeout_);
    ints_.resize(2 * global_ranks_.size());
    context_ = std::make_shared<GlooContext>(rank_, size());
    context_->setTimeout(timeout_);
    std::string failure;
    bool is_timeout = false;
    try {
      GlooStoreAdapter gloo_store(store_);
      context_->connectFullMesh(gloo_store, state_->device);
    } catch (const std::exception& e) {
      is_timeout = dynamic_cast<const TimeoutError*>(&e) != nullptr;
      failure = e.what();
    }
    wait_until_all_connected(failure, is_timeout);
  }

  ~GlooBackendImpl() override {
    // Executors drain (and join) before the context goes away.
    completer_.reset();
    executor_.reset();
  }

  // ---- identity ---------------------------------------------------------------------------------------
  std::string_view name() const noexcept override { return "gloo"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return static_cast<int>(global_ranks_.size()); }
  std::span<const int> global_ranks() const noexcept override { return global_ranks_; }
  std::string describe() const override {
    return "rank " + std::to_string(rank_) + " (global " + std::to_string(state_->global_rank) +
           ") of gloo group " + join_ints(global_ranks_);
  }
  std::chrono::milliseconds timeout() const override {
    std::lock_guard lock(m_);
    return timeout_;
  }
  void set_timeout(std::chrono::milliseconds timeout) override {
    DTENSOR_CHECK(timeout.count() > 0, describe() + ": set_timeout: the timeout must be positive, got " +
                                           std::to_string(timeout.count()) + " ms");
    std::lock_guard lock(m_);
    timeout_ = timeout;
  }

  // ---- collectives ------------------------------------------------------------------------------------

  WorkPtr all_reduce(BufferRef buf, ReduceOp op, const CommOptions& opts) override {
    check_buffer("all_reduce", buf, "tensor");
    OpDesc d{"all_reduce", 0, buf.count, buf.dtype, -1, static_cast<int>(op)};
    return submit(d, opts, {}, [this, buf, op](const OpDesc& od, Ms t, const Arrays&) {
      if (buf.count > 0 && size() > 1) {
        run_all_reduce(buf, op, od.seq, t);
      }
      if (op == ReduceOp::avg) {
        divide_in_place(buf.data, buf.count, buf.dtype, size());
      }
    });
  }

  WorkPtr reduce(BufferRef buf, int root, ReduceOp op, const CommOptions& opts) override {
    check_buffer("reduce", buf, "tensor");
    check_root("reduce", root, "dst");
    OpDesc d{"reduce", 0, buf.count, buf.dtype, root, static_cast<int>(op)};
    return submit(d, opts, {}, [this, buf, root, op](const OpDesc& od, Ms t, const Arrays&) {
      if (buf.count > 0 && size() > 1) {
        ::gloo::ReduceOptions o(context_);
        with_type(buf.dtype, [&]<class T>(T) {
          if (rank_ == root) {
            o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
          } else { // gloo's ring reduce writes partial results into its output: keep buf intact
            o.setInput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
            o.setOutput(reinterpret_cast<T*>(scratch(buf.nbytes())), static_cast<std::size_t>(buf.count));
          }
        });
        o.setRoot(root);
        o.setReduceFunction(reduce_function(buf.dtype, op));
        o.setTag(od.seq);
        o.setTimeout(t);
        ::gloo::reduce(o);
      }
      if (op == ReduceOp::avg && rank_ == root) {
        divide_in_place(buf.data, buf.count, buf.dtype, size());
      }
    });
  }

  WorkPtr broadcast(BufferRef buf, int root, const CommOptions& opts) override {
    check_buffer("broadcast", buf, "tensor");
    check_root("broadcast", root, "src");
    OpDesc d{"broadcast", 0, buf.count, buf.dtype, root};
    return submit(d, opts, {}, [this, buf, root](const OpDesc& od, Ms t, const Arrays&) {
      if (buf.count == 0 || size() == 1) {
        return;
      }
      ::gloo::BroadcastOptions o(context_);
      with_type(buf.dtype, [&]<class T>(T) {
        o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
      });
      o.setRoot(root);
      o.setTag(od.seq);
      o.setTimeout(t);
      ::gloo::broadcast(o);
    });
  }

  WorkPtr all_gather(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                     std::span<const std::int64_t> displs, const CommOptions& opts) override {
    check_buffer("all_gather", in, "input");
    check_buffer("all_gather", out, "output");
    check_same_dtype("all_gather", in, out);
    check_layout("all_gather", "counts", counts, displs, out);
    DTENSOR_CHECK(in.count == counts[rank_],
                  describe() + ": all_gather: the input has " + std::to_string(in.count) +
                      " elements but counts[" + std::to_string(rank_) + "] is " +
                      std::to_string(counts[rank_]) + "; counts " + join_counts(counts));
    OpDesc d{"all_gather", 0, in.count, in.dtype};
    const bool even = std::all_of(counts.begin(), counts.end(), [&](auto c) { return c == counts[0]; }) &&
                      is_packed(counts, displs);
    return submit(d, opts, {counts, displs}, [this, in, out, even](const OpDesc& od, Ms t, const Arrays& l) {
      const std::size_t es = dtype_size(in.dtype);
      if (even && in.count > 0 && size() > 1) {
        ::gloo::AllgatherOptions o(context_);
        with_type(in.dtype, [&]<class T>(T) {
          o.setInput(static_cast<T*>(in.data), static_cast<std::size_t>(in.count));
          o.setOutput(static_cast<T*>(out.data), static_cast<std::size_t>(out.count));
        });
        o.setTag(od.seq);
        o.setTimeout(t);
        ::gloo::allgather(o);
        return;
      }
      // Uneven or empty blocks: everyone sends its block to everyone.
      auto send_counts = tmp_ints(0, in.count), send_displs = tmp_ints(1, 0);
      exchange(in, send_counts, send_displs, out, l[0], l[1], es, own_slot(od.seq), t);
    });
  }

  WorkPtr reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                         std::span<const std::int64_t> displs, ReduceOp op,
                         const CommOptions& opts) override {
    check_buffer("reduce_scatter", in, "input");
    check_buffer("reduce_scatter", out, "output");
    check_same_dtype("reduce_scatter", in, out);
    check_layout("reduce_scatter", "counts", counts, displs, in);
    DTENSOR_CHECK(out.count == counts[rank_],
                  describe() + ": reduce_scatter: the output has " + std::to_string(out.count) +
                      " elements but counts[" + std::to_string(rank_) + "] is " +
                      std::to_string(counts[rank_]) + "; counts " + join_counts(counts));
    OpDesc d{"reduce_scatter", 0, in.count, in.dtype, -1, static_cast<int>(op)};
    return submit(d, opts, {counts, displs}, [this, in, out, op](const OpDesc& od, Ms t, const Arrays& l) {
      run_reduce_scatter(in, out, l[0], l[1], op, od.seq, t);
      if (op == ReduceOp::avg) {
        divide_in_place(out.data, out.count, out.dtype, size());
      }
    });
  }

  WorkPtr all_to_all(BufferRef in, std::span<const std::int64_t> send_counts,
                     std::span<const std::int64_t> send_displs, BufferRef out,
                     std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                     const CommOptions& opts) override {
    check_buffer("all_to_all", in, "input");
    check_buffer("all_to_all", out, "output");
    check_same_dtype("all_to_all", in, out);
    check_layout("all_to_all", "input split sizes", send_counts, send_displs, in);
    check_layout("all_to_all", "output split sizes", recv_counts, recv_displs, out);
    OpDesc d{"all_to_all", 0, in.count, in.dtype};
    return submit(d, opts, {send_counts, send_displs, recv_counts, recv_displs},
                  [this, in, out](const OpDesc& od, Ms t, const Arrays& l) {
                    exchange(in, l[0], l[1], out, l[2], l[3], dtype_size(in.dtype), own_slot(od.seq), t);
                  });
  }

  WorkPtr gather(BufferRef in, std::span<const BufferRef> blocks, int root,
                 const CommOptions& opts) override {
    check_buffer("gather", in, "input");
    check_root("gather", root, "dst");
    if (rank_ == root) { // blocks only matter on the root
      check_blocks("gather", blocks, in);
    }
    OpDesc d{"gather", 0, in.count, in.dtype, root};
    Arrays a;
    if (rank_ == root) {
      a.blocks = blocks;
    }
    return submit(d, opts, a, [this, in, root](const OpDesc& od, Ms t, const Arrays& a) {
      if (rank_ != root) {
        member_transfer(false, in, root, own_slot(od.seq), t);
        return;
      }
      root_transfers(true, a.blocks, own_slot(od.seq), t, [&] { copy_block(a.blocks[rank_], in); });
    });
  }

  WorkPtr scatter(std::span<const BufferRef> blocks, BufferRef out, int root,
                  const CommOptions& opts) override {
    check_buffer("scatter", out, "output");
    check_root("scatter", root, "src");
    if (rank_ == root) {
      check_blocks("scatter", blocks, out);
    }
    OpDesc d{"scatter", 0, out.count, out.dtype, root};
    Arrays a;
    if (rank_ == root) {
      a.blocks = blocks;
    }
    return submit(d, opts, a, [this, out, root](const OpDesc& od, Ms t, const Arrays& a) {
      if (rank_ != root) {
        member_transfer(true, out, root, own_slot(od.seq), t);
        return;
      }
      root_transfers(false, a.blocks, own_slot(od.seq), t, [&] { copy_block(out, a.blocks[rank_]); });
    });
  }

  WorkPtr barrier(const CommOptions& opts) override {
    OpDesc d{"barrier", 0, 0, DType::uint8};
    return submit(d, opts, {}, [this](const OpDesc& od, Ms t, const Arrays&) {
      if (size() == 1) {
        return;
      }
      ::gloo::BarrierOptions o(context_);
      o.setTag(od.seq);
      o.setTimeout(t);
      ::gloo::barrier(o);
    });
  }

  // ---- point to point ---------------------------------------------------------------------------------

  WorkPtr p2p(std::span<const P2PRequest> requests, const CommOptions& opts) override {
    struct Posted {
      P2PRequest req;
      std::uint64_t slot;
    };
    auto posted = std::make_shared<std::vector<Posted>>();
    posted->reserve(requests.size());
    for (const auto& r : requests) {
      const char* what = r.kind == P2PRequest::Kind::send ? "send" : "recv";
      check_buffer(what, r.buffer, "tensor");
      DTENSOR_CHECK(r.peer >= 0 && r.peer < size() && r.peer != rank_,
                    describe() + ": " + what + ": peer " + std::to_string(r.peer) +
                        (r.peer == rank_ ? " is this rank itself" : " is out of range") + " for a group of " +
                        std::to_string(size()));
      DTENSOR_CHECK(r.tag >= 0 && r.tag < kMaxP2PTag, describe() + ": " + what + ": tag " +
                                                          std::to_string(r.tag) + " is outside [0, " +
                                                          std::to_string(kMaxP2PTag) + ")");
    }
    check_not_aborted("p2p");
    {
      std::lock_guard lock(m_);
      for (const auto& r : requests) {
        const bool is_send = r.kind == P2PRequest::Kind::send;
        const int src = is_send ? rank_ : r.peer;
        const int dst = is_send ? r.peer : rank_;
        auto& seq = p2p_seq_[std::tuple{r.peer, r.tag, is_send}];
        const std::uint64_t slot = (std::uint64_t{0x80} << 56) | (std::uint64_t{src < dst} << 55) |
                                   (static_cast<std::uint64_t>(r.tag) << 32) | seq++;
        posted->push_back({r, slot});
      }
    }
    OpDesc d{requests.size() == 1 ? (requests[0].kind == P2PRequest::Kind::send ? "send" : "recv")
                                  : "batch_isend_irecv",
             0, requests.empty() ? 0 : requests[0].buffer.count,
             requests.empty() ? DType::uint8 : requests[0].buffer.dtype};
    if (requests.size() == 1) {
      d.root = requests[0].peer;
    }
    // Posted in order on the executor (on this thread when the group is idle); the wait for the transfers
    // runs on the thread that first waits for the work (see DeferredWork), so a synchronous send/recv or
    // a batch waited at once costs no thread hop, and a posted irecv never blocks anything else.
    auto work = std::make_shared<DeferredWork>(*completer_);
    const auto t = effective_timeout(opts);
    auto self = shared_from_this();
    executor_->submit(
        [self, work, posted, d, t] {
          const auto start = Clock::now();
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
            work->finish(self->translate(std::current_exception(), d, start));
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
              return nullptr;
            } catch (...) {
              return self->translate(std::current_exception(), d, start);
            }
          });
        },
        /*inline_if_idle=*/true);
    return work;
  }

  // ---- groups -----------------------------------------------------------------------------------------

  /// Only the members take part (torch's use_local_synchronization): they rendezvous under a store key
  /// made of their global ranks and how many groups over that list this rank made before, so ranks
  /// outside the list need not call, and never wait.
  std::shared_ptr<Backend> new_group(std::span<const int> ranks) override {
    std::vector<int> sorted(ranks.begin(), ranks.end());
    std::sort(sorted.begin(), sorted.end());
    DTENSOR_CHECK(!ranks.empty() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                      sorted.front() >= 0 && sorted.back() < size(),
                  describe() + ": new_group: ranks " + join_ints(ranks) +
                      " must be distinct group ranks in [0, " + std::to_string(size()) + ")");
    check_not_aborted("new_group");
    auto it = std::find(ranks.begin(), ranks.end(), rank_);
    if (it == ranks.end()) {
      return nullptr;
    }
    std::vector<int> global;
    for (int r : ranks) {
      global.push_back(global_ranks_[r]);
    }
    int generation = 0;
    {
      std::lock_guard lock(state_->m);
      generation = state_->generations[global]++;
    }
    std::string prefix =
        state_->options.prefix + "/members" + join_ints(global) + "#" + std::to_string(generation);
    return make_child(std::move(prefix), std::move(global), static_cast<int>(it - ranks.begin()));
  }

  std::shared_ptr<Backend> split(int color, int key) override {
    check_not_aborted("split");
    const int n = next_creation();
    const auto all =
        exchange_split_colors(*store_, "split" + std::to_string(n), rank_, size(), color, key, timeout(),
                              describe() + ": split(color " + std::to_string(color) + ", key " +
                                  std::to_string(key) + ") #" + std::to_string(n));
    if (color < 0) {
      return nullptr;
    }
    const SplitMembers members = split_members(all, color, rank_);
    std::vector<int> global;
    for (int r : members.ranks) {
      global.push_back(global_ranks_[r]);
    }
    return make_child(prefix_ + "/s" + std::to_string(n) + "c" + std::to_string(color), std::move(global),
                      members.me);
  }

  void abort(std::string_view reason) override {
    std::string why(reason);
    {
      std::lock_guard lock(m_);
      if (aborted_) {
        return;
      }
      aborted_ = why;
    }
    publish_error(false, describe() + " was aborted: " + why);
    context_->signal_exception("dtensor: " + describe() + " aborted: " + why);
  }

  /// Aborts every group this rank created (the world group and all sub-groups).
  void abort_rank(std::string_view reason) {
    std::vector<std::shared_ptr<GlooBackendImpl>> groups;
    {
      std::lock_guard lock(state_->m);
      if (!state_->aborted) {
        state_->aborted = std::string(reason);
      }
      for (auto& w : state_->groups) {
        if (auto g = w.lock()) {
          groups.push_back(std::move(g));
        }
      }
    }
    for (auto& g : groups) {
      g->abort(reason);
    }
  }

  static std::shared_ptr<GlooBackendImpl> create(std::shared_ptr<GlooRankState> state, std::string prefix,
                                                 std::vector<int> global_ranks, int rank,
                                                 std::chrono::milliseconds timeout) {
    auto g =
        std::make_shared<GlooBackendImpl>(state, std::move(prefix), std::move(global_ranks), rank, timeout);
    std::lock_guard lock(state->m);
    state->groups.push_back(g);
    if (state->aborted) {
      g->abort(*state->aborted);
    }
    return g;
  }

private:
  // ---- construction ---------------------------------------------------------------------------------

  /// A barrier through the store after connectFullMesh: no member returns (and so none can destroy the
  /// group) before every member's pairs are connected. Without it, a member whose side of a connection
  /// completed in the kernel could return, drop the group and close the socket while the peer was still
  /// in connectFullMesh, which then failed with "Connection closed by peer" (gloo 2022's tcp pairs accept
  /// on the loop thread and read the EOF at once; seen about once in 8 runs of the test suite on 2
  /// cores, with meshes that are destroyed right after their last split). A member that failed to connect
  /// says why, so the others fail at once with the cause instead of timing out.
  void wait_until_all_connected(const std::string& failure, bool is_timeout) {
    const std::string mine = failure.empty() ? "ok" : failure;
    store_->set("connected/" + std::to_string(rank_), std::string_view(mine));
    const std::string what = describe() + ": connecting the group failed: ";
    if (!failure.empty()) {
      if (is_timeout) {
        throw TimeoutError(what + failure);
      }
      throw Error(what + failure);
    }
    std::vector<std::string> keys;
    for (int r = 0; r < size(); ++r) {
      keys.push_back("connected/" + std::to_string(r));
    }
    try {
      store_->wait(keys, timeout_);
    } catch (const std::exception& e) {
      throw TimeoutError(what + "not every member finished connecting within " +
                         std::to_string(timeout_.count()) + " ms: " + e.what());
    }
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) {
        continue;
      }
      const auto v = store_->get(keys[r]);
      if (std::string(v.begin(), v.end()) != "ok") {
        throw Error(what + "member " + std::to_string(r) +
                    " could not connect: " + std::string(v.begin(), v.end()));
      }
    }
  }

  // ---- submission ---------------------------------------------------------------------------------------

  std::chrono::milliseconds effective_timeout(const CommOptions& opts) const {
    return opts.timeout.count() > 0 ? opts.timeout : timeout();
  }

  static std::chrono::milliseconds remaining(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  void check_not_aborted(const char* op) const {
    std::lock_guard lock(m_);
    if (aborted_) {
      throw Error(describe() + ": " + op + ": the group was aborted: " + *aborted_);
    }
  }

  /// The arrays of group size an op reads: up to four of counts and displacements, and gather's/scatter's
  /// blocks. They view the caller's arrays while the op runs on the caller's thread; own() copies them
  /// before it is queued.
  struct Arrays {
    std::array<std::span<const std::int64_t>, 4> v{};
    std::span<const BufferRef> blocks;
    std::shared_ptr<std::int64_t[]> storage;
    std::shared_ptr<BufferRef[]> block_storage;

    Arrays() = default;
    Arrays(std::initializer_list<std::span<const std::int64_t>> l) {
      std::copy(l.begin(), l.end(), v.begin());
    }
    std::span<const std::int64_t> operator[](std::size_t i) const { return v[i]; }

    void own() {
      if (!blocks.empty()) {
        block_storage = std::make_shared<BufferRef[]>(blocks.size());
        std::copy(blocks.begin(), blocks.end(), block_storage.get());
        blocks = {block_storage.get(), blocks.size()};
      }
      std::size_t total = 0;
      for (auto& a : v) {
        total += a.size();
      }
      if (total == 0) {
        return;
      }
      storage = std::make_shared_for_overwrite<std::int64_t[]>(total);
      std::int64_t* at = storage.get();
      for (auto& a : v) {
        std::copy(a.begin(), a.end(), at);
        a = {at, a.size()};
        at += a.size();
      }
    }
  };

  /// Runs `body(desc, timeout, arrays)` in submission order. A blocking op on an idle group runs on this
  /// thread with nothing allocated (the caller's arrays are read in place; the returned work is a shared,
  /// already completed one unless the op failed); otherwise it is queued on the group's worker.
  template <class Body>
  WorkPtr submit(OpDesc d, const CommOptions& opts, Arrays arrays, Body body) {
    check_not_aborted(d.name);
    {
      std::lock_guard lock(m_);
      d.seq = seq_++;
    }
    const auto t = effective_timeout(opts);
    if (opts.blocking) {
      std::exception_ptr error;
      const bool ran = executor_->run_inline_if_idle([&] {
        const auto start = Clock::now();
        try {
          body(d, t, arrays);
        } catch (...) {
          error = translate(std::current_exception(), d, start);
        }
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
    arrays.own();
    auto work = std::make_shared<HostWork>();
    auto self = shared_from_this();
    executor_->submit(
        [self, work, d, t, arrays = std::move(arrays), body = std::move(body)] {
          const auto start = Clock::now();
          try {
            body(d, t, arrays);
            work->finish();
          } catch (...) {
            work->finish(self->translate(std::current_exception(), d, start));
          }
        },
        /*inline_if_idle=*/false);
    return work;
  }

  /// A finished, successful work, shared by every synchronous op that ran inline.
  static WorkPtr completed_work() {
    static const WorkPtr done = [] {
      auto w = std::make_shared<HostWork>();
      w->finish();
      return w;
    }();
    return done;
  }

  /// The group's scratch memory, at least `bytes` (not zeroed; grown on demand, kept for later ops).
  /// Only ops on the executor use it, one at a time.
  char* scratch(std::size_t bytes) {
    if (bytes > scratch_bytes_) {
      scratch_ubs_.clear();
      scratch_.reset();
      scratch_ = std::make_unique_for_overwrite<char[]>(bytes);
      scratch_bytes_ = bytes;
    }
    return scratch_.get();
  }

  /// Receive handles over the whole scratch, one per member (none for this rank), made once per scratch.
  std::unique_ptr<::gloo::transport::UnboundBuffer>* scratch_buffers() {
    if (scratch_ubs_.empty()) {
      scratch_ubs_.resize(static_cast<std::size_t>(size()));
      for (int m = 0; m < size(); ++m) {
        if (m != rank_) {
          scratch_ubs_[m] = context_->createUnboundBuffer(scratch_.get(), scratch_bytes_);
        }
      }
    }
    return scratch_ubs_.data();
  }

  /// Region `k` (0 or 1) of the group's integer scratch: size() entries set to `value`.
  std::span<std::int64_t> tmp_ints(int k, std::int64_t value) {
    std::span<std::int64_t> r(ints_.data() + static_cast<std::size_t>(k) * size(), size());
    std::fill(r.begin(), r.end(), value);
    return r;
  }

  template <class F>
  static void with_type(DType dtype, F&& f) {
    // gloo's options only use sizeof(T); any type of the right size will do.
    visit_dtype(dtype, std::forward<F>(f));
  }

  static bool is_packed(std::span<const std::int64_t> counts, std::span<const std::int64_t> displs) {
    std::int64_t at = 0;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (displs[i] != at) {
        return false;
      }
      at += counts[i];
    }
    return true;
  }

  std::uint64_t own_slot(std::uint32_t seq) const {
    return (std::uint64_t{0x40} << 56) | (std::uint64_t{seq} << 24);
  }

  /// A message's slot with its size folded into the low 24 bits (free in own_slot): a send and a receive
  /// match only when both sides agree on the size, so members that disagree get a timeout naming the op
  /// instead of a short read (gloo completes a receive larger than the message) or an abort of the process
  /// (gloo's loop thread throws on a message larger than the receive).
  static std::uint64_t sized(std::uint64_t slot, std::size_t nbytes) {
    const std::uint64_t b = nbytes;
    return slot | ((b ^ (b >> 24) ^ (b >> 48)) & 0xFFFFFF);
  }

  int next_creation() {
    std::lock_guard lock(m_);
    return creations_++;
  }

  std::shared_ptr<Backend> make_child(std::string prefix, std::vector<int> global, int rank) {
    return create(state_, std::move(prefix), std::move(global), rank, timeout());
  }

  // ---- argument checks (before any communication) -------------------------------------------------------

  void check_buffer(const char* op, const BufferRef& b, const char* what) const {
    DTENSOR_CHECK(b.device.is_cpu(), describe() + ": " + op + ": the " + what + " is on " +
                                         b.device.to_string() +
                                         ", but the gloo backend only handles host (cpu) tensors");
    DTENSOR_CHECK(b.count >= 0, describe() + ": " + op + ": the " + what + " has a negative element count " +
                                    std::to_string(b.count));
    DTENSOR_CHECK(b.count == 0 || b.data != nullptr, describe() + ": " + op + ": the " + what +
                                                         " has no data (" + std::to_string(b.count) +
                                                         " elements at nullptr)");
  }

  void check_same_dtype(const char* op, const BufferRef& in, const BufferRef& out) const {
    DTENSOR_CHECK(in.dtype == out.dtype, describe() + ": " + op + ": input is " +
                                             std::string(dtype_name(in.dtype)) + " but output is " +
                                             std::string(dtype_name(out.dtype)));
  }

  void check_root(const char* op, int root, const char* what) const {
    DTENSOR_CHECK(root >= 0 && root < size(), describe() + ": " + op + ": " + what + " " +
                                                  std::to_string(root) + " is out of range for a group of " +
                                                  std::to_string(size()));
  }

  void check_layout(const char* op, const char* what, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs, const BufferRef& buf) const {
    DTENSOR_CHECK(counts.size() == static_cast<std::size_t>(size()) && displs.size() == counts.size(),
                  describe() + ": " + op + ": " + what + " has " + std::to_string(counts.size()) +
                      " entries (displacements " + std::to_string(displs.size()) + ") for a group of " +
                      std::to_string(size()));
    for (std::size_t i = 0; i < counts.size(); ++i) {
      DTENSOR_CHECK(counts[i] >= 0 && displs[i] >= 0, describe() + ": " + op + ": negative size in " + what +
                                                          " " + join_counts(counts) + " / displacements " +
                                                          join_counts(displs));
      DTENSOR_CHECK(displs[i] + counts[i] <= buf.count, describe() + ": " + op + ": " + what + " " +
                                                            join_counts(counts) + " at displacements " +
                                                            join_counts(displs) + " do not fit a buffer of " +
                                                            std::to_string(buf.count) + " elements");
    }
  }

  /// gather's/scatter's blocks on the root: one per member; this rank's block matches `mine` (gather's
  /// input, scatter's output).
  void check_blocks(const char* op, std::span<const BufferRef> blocks, const BufferRef& mine) const {
    const bool is_gather = std::string_view(op) == "gather";
    DTENSOR_CHECK(blocks.size() == static_cast<std::size_t>(size()),
                  describe() + ": " + op + ": the root needs one block per member (" +
                      std::to_string(size()) + "), got " + std::to_string(blocks.size()));
    for (const BufferRef& b : blocks) {
      check_buffer(op, b, "block");
      if (is_gather) {
        check_same_dtype(op, mine, b);
      } else {
        check_same_dtype(op, b, mine);
      }
    }
    DTENSOR_CHECK(blocks[rank_].count == mine.count,
                  describe() + ": " + op + ": the root's own block has " +
                      std::to_string(blocks[rank_].count) + " elements but its " +
                      (is_gather ? "input" : "output") + " has " + std::to_string(mine.count));
  }

  // ---- algorithms (run on the executor) -----------------------------------------------------------------

  /// dst = src (same count; the root's own block of gather and scatter).
  static void copy_block(const BufferRef& dst, const BufferRef& src) {
    if (src.count > 0 && dst.data != src.data) {
      std::memmove(dst.data, src.data, src.nbytes());
    }
  }

  /// A member of gather (send) or scatter (receive): its one transfer with the root.
  void member_transfer(bool receive, const BufferRef& b, int root, std::uint64_t slot,
                       std::chrono::milliseconds t) {
    if (b.count == 0) {
      return;
    }
    auto ub = context_->createUnboundBuffer(b.data, b.nbytes());
    if (receive) {
      ub->recv(root, sized(slot, b.nbytes()));
    } else {
      ub->send(root, sized(slot, b.nbytes()));
    }
    if (!(receive ? ub->waitRecv(t) : ub->waitSend(t))) {
      throw Error("the operation was aborted");
    }
  }

  /// The root of gather (receive) or scatter (send): posts a transfer of blocks[m] with every other
  /// member m, then copies its own block (`own_copy`) while they run, then waits for all of them.
  template <class OwnCopy>
  void root_transfers(bool receive, std::span<const BufferRef> blocks, std::uint64_t slot,
                      std::chrono::milliseconds t, OwnCopy&& own_copy) {
    const auto deadline = Clock::now() + t;
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> ubs;
    for (int i = 1; i < size(); ++i) {
      const int m = receive ? (rank_ - i + size()) % size() : (rank_ + i) % size();
      if (blocks[m].count > 0) {
        ubs.push_back(context_->createUnboundBuffer(blocks[m].data, blocks[m].nbytes()));
        if (receive) {
          ubs.back()->recv(m, sized(slot, blocks[m].nbytes()));
        } else {
          ubs.back()->send(m, sized(slot, blocks[m].nbytes()));
        }
      }
    }
    own_copy();
    for (auto& ub : ubs) {
      if (!(receive ? ub->waitRecv(remaining(deadline)) : ub->waitSend(remaining(deadline)))) {
        throw Error("the operation was aborted");
      }
    }
  }

  void run_all_reduce(BufferRef buf, ReduceOp op, std::uint32_t tag, std::chrono::milliseconds t) {
    ::gloo::AllreduceOptions o(context_);
    with_type(buf.dtype, [&]<class T>(T) {
      o.setOutput(static_cast<T*>(buf.data), static_cast<std::size_t>(buf.count));
    });
    o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
    o.setReduceFunction(reduce_function(buf.dtype, op));
    o.setTag(tag);
    o.setTimeout(t);
    ::gloo::allreduce(o);
  }

  /// out = block rank_ of every member's input, reduced in rank order: ((b0 op b1) op b2) op ... .
  /// Each member sends block i of its input straight to member i, which receives the n-1 blocks into the
  /// group's scratch (so a rank receives (n-1)/n of its input, like a ring, but in one round) and folds
  /// them into `out` in rank order as they arrive: block m is folded once blocks 0..m are in, whatever
  /// order they came in, so the result is bitwise the same on every run and equals a rank-order
  /// reduction. No per-call allocation beyond gloo's two unbound-buffer handles.
  void run_reduce_scatter(BufferRef in, BufferRef out, std::span<const std::int64_t> counts,
                          std::span<const std::int64_t> displs, ReduceOp op, std::uint32_t seq,
                          std::chrono::milliseconds t) {
    const int n = size();
    const std::size_t es = dtype_size(in.dtype);
    const std::int64_t mine = counts[rank_];
    const std::size_t bytes = static_cast<std::size_t>(mine) * es;
    auto* in_bytes = static_cast<const char*>(in.data);
    if (state_->options.reduce_scatter_via_all_reduce && n > 1 && in.count > 0) {
      char* tmp = scratch(in.nbytes());
      std::memcpy(tmp, in.data, in.nbytes());
      run_all_reduce({tmp, in.count, in.dtype, in.device}, op, seq, t);
      std::memcpy(out.data, tmp + displs[rank_] * es, bytes);
      return;
    }
    if (n == 1) {
      std::memmove(out.data, in_bytes + displs[0] * es, bytes);
      return;
    }
    const auto deadline = Clock::now() + t;
    const std::uint64_t slot = own_slot(seq);
    // An output inside the input (in place): keep our own block and the outgoing ones intact until sent.
    const bool overlap = bytes > 0 && in.count > 0 &&
                         static_cast<const char*>(out.data) < in_bytes + in.nbytes() &&
                         in_bytes < static_cast<const char*>(out.data) + bytes;
    // Scratch slots: member m < rank_ at m, m > rank_ at m - 1, and (when overlapping) our own at n - 1.
    char* st = bytes > 0 ? scratch(bytes * static_cast<std::size_t>(overlap ? n : n - 1)) : nullptr;
    auto slot_of = [&](int m) { return static_cast<std::size_t>(m < rank_ ? m : m - 1) * bytes; };
    // One receive handle per member over the whole scratch (cached with it): gloo reports which member a
    // completion came from only per handle.
    auto* ubs = bytes > 0 ? scratch_buffers() : nullptr;
    for (int i = 1; i < n && ubs != nullptr; ++i) {
      const int src = (rank_ - i + n) % n;
      ubs[src]->recv(src, sized(slot, bytes), slot_of(src), bytes);
    }
    std::unique_ptr<::gloo::transport::UnboundBuffer> ib;
    int nsend = 0;
    for (int i = 1; i < n; ++i) {
      const int dst = (rank_ + i) % n;
      if (counts[dst] > 0) {
        if (!ib) {
          ib = context_->createUnboundBuffer(const_cast<char*>(in_bytes), in.nbytes());
        }
        ib->send(dst, sized(slot, static_cast<std::size_t>(counts[dst]) * es),
                 static_cast<std::size_t>(displs[dst]) * es, static_cast<std::size_t>(counts[dst]) * es);
        ++nsend;
      }
    }
    auto wait_sends = [&] {
      for (; nsend > 0; --nsend) {
        if (!ib->waitSend(remaining(deadline))) {
          throw Error("the operation was aborted");
        }
      }
    };
    if (bytes > 0) {
      const char* own = in_bytes + displs[rank_] * es;
      if (overlap) {
        wait_sends();
        std::memcpy(st + static_cast<std::size_t>(n - 1) * bytes, own, bytes);
        own = st + static_cast<std::size_t>(n - 1) * bytes;
      }
      const auto fn = reduce_function(in.dtype, op);
      const auto count = static_cast<std::size_t>(mine);
      auto block = [&](int m) -> const char* { return m == rank_ ? own : st + slot_of(m); };
      auto wait_for = [&](int m) {
        if (m != rank_ && !ubs[m]->waitRecv(remaining(deadline))) {
          throw Error("the operation was aborted");
        }
      };
      wait_for(0);
      wait_for(1);
      fn(out.data, block(0), block(1), count);
      for (int m = 2; m < n; ++m) {
        wait_for(m);
        fn(out.data, out.data, block(m), count);
      }
    }
    wait_sends();
  }

  /// Pairwise exchange: member i receives in[send_displs[i] .. + send_counts[i]) into its
  /// out[recv_displs[me] .. + recv_counts[me]) (element units; `es` bytes each). Zero-sized blocks are
  /// skipped on both sides. All receives and sends are posted before waiting on any.
  void exchange(BufferRef in, std::span<const std::int64_t> send_counts,
                std::span<const std::int64_t> send_displs, BufferRef out,
                std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                std::size_t es, std::uint64_t slot, std::chrono::milliseconds t) {
    const int n = size();
    const auto deadline = Clock::now() + t;
    std::unique_ptr<::gloo::transport::UnboundBuffer> ib, ob;
    int nsend = 0, nrecv = 0;
    for (int i = 1; i < n; ++i) {
      const int src = (rank_ - i + n) % n;
      if (recv_counts[src] > 0) {
        if (!ob) {
          ob = context_->createUnboundBuffer(out.data, out.nbytes());
        }
        ob->recv(src, sized(slot, static_cast<std::size_t>(recv_counts[src]) * es),
                 static_cast<std::size_t>(recv_displs[src]) * es,
                 static_cast<std::size_t>(recv_counts[src]) * es);
        ++nrecv;
      }
    }
    for (int i = 1; i < n; ++i) {
      const int dst = (rank_ + i) % n;
      if (send_counts[dst] > 0) {
        if (!ib) {
          ib = context_->createUnboundBuffer(in.data, in.nbytes());
        }
        ib->send(dst, sized(slot, static_cast<std::size_t>(send_counts[dst]) * es),
                 static_cast<std::size_t>(send_displs[dst]) * es,
                 static_cast<std::size_t>(send_counts[dst]) * es);
        ++nsend;
      }
    }
    if (send_counts[rank_] > 0 && recv_counts[rank_] > 0) {
      DTENSOR_CHECK(send_counts[rank_] == recv_counts[rank_],
                    describe() + ": sends " + std::to_string(send_counts[rank_]) +
                        " elements to itself but expects " + std::to_string(recv_counts[rank_]));
      std::memmove(static_cast<char*>(out.data) + recv_displs[rank_] * es,
                   static_cast<const char*>(in.data) + send_displs[rank_] * es,
                   static_cast<std::size_t>(recv_counts[rank_]) * es);
    }
    for (int i = 0; i < nrecv; ++i) {
      if (!ob->waitRecv(remaining(deadline))) {
        throw Error("the operation was aborted");
      }
    }
    for (int i = 0; i < nsend; ++i) {
      if (!ib->waitSend(remaining(deadline))) {
        throw Error("the operation was aborted");
      }
    }
  }

  // ---- failures -----------------------------------------------------------------------------------------

  void publish_error(bool is_timeout, const std::string& msg) {
    if (published_.exchange(true)) {
      return;
    }
    std::string v = (is_timeout ? "T" : "E") + msg;
    try {
      store_->set("err/" + std::to_string(rank_), std::string_view(v));
    } catch (...) { // the store may be gone with the failing process: the peers still fail, less precisely
    }
  }

  /// The reason a member published, waiting up to `patience` for one to appear. Timeouts first.
  std::optional<std::pair<bool, std::string>> peer_error(std::chrono::milliseconds patience) {
    const auto deadline = Clock::now() + patience;
    for (;;) {
      std::optional<std::pair<bool, std::string>> found;
      for (int r = 0; r < size(); ++r) {
        if (r == rank_) {
          continue;
        }
        std::optional<std::vector<char>> v;
        try {
          v = store_->try_get("err/" + std::to_string(r));
        } catch (...) { // the store may be gone with a failed process: no reason to read
        }
        if (v && !v->empty()) {
          bool t = (*v)[0] == 'T';
          if (!found || (t && !found->first)) {
            found = std::pair{t, std::string(v->begin() + 1, v->end())};
          }
        }
      }
      if (found || Clock::now() >= deadline) {
        return found;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  /// The exception wait() rethrows for a failed op, with the context a user needs.
  std::exception_ptr translate(std::exception_ptr e, const OpDesc& d, Clock::time_point start) {
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
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    std::string head = describe() + ": " + d.to_string();
    std::string msg;
    std::optional<std::string> aborted;
    {
      std::lock_guard lock(m_);
      aborted = aborted_;
    }
    if (aborted) {
      msg = head + " failed: the group was aborted: " + *aborted;
    } else if (is_timeout) {
      msg = head + " timed out after " + std::to_string(ms) + " ms (limit " +
            std::to_string(timeout().count()) + " ms): a member did not arrive" +
            (d.sizes_must_match() ? ", or the members disagree on the sizes (counts)" : "") + " [" + reason +
            "]";
    } else if (transport) {
      if (auto peer = peer_error(std::chrono::milliseconds(1000))) {
        is_timeout = peer->first;
        msg = head + " failed after " + std::to_string(ms) + " ms because a peer failed: " + peer->second;
        publish_error(is_timeout, peer->second); // pass the root cause on, not a chain
      } else {
        msg = head + " failed after " + std::to_string(ms) + " ms: " + reason;
      }
    } else {
      msg = head + " failed: " + reason;
    }
    publish_error(is_timeout, msg);
    return is_timeout ? std::make_exception_ptr(TimeoutError(msg)) : std::make_exception_ptr(Error(msg));
  }

  std::shared_ptr<GlooRankState> state_;
  std::string prefix_;
  std::shared_ptr<PrefixStore> store_;
  std::vector<int> global_ranks_;
  int rank_;
  std::shared_ptr<GlooContext> context_;

  mutable std::mutex m_;
  std::chrono::milliseconds timeout_;
  std::uint32_t seq_ = 0;
  int creations_ = 0;
  std::map<std::tuple<int, int, bool>, std::uint32_t> p2p_seq_;
  std::optional<std::string> aborted_;
  std::atomic<bool> published_{false};

  // Per-group scratch of the ops on the executor (one at a time): bytes, integers, flags.
  std::unique_ptr<char[]> scratch_;
  std::size_t scratch_bytes_ = 0;
  std::vector<std::int64_t> ints_;
  std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> scratch_ubs_; // over scratch_, per member

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
  DTENSOR_CHECK(size > 0 && rank >= 0 && rank < size, "make_gloo_backend: rank " + std::to_string(rank) +
                                                          " is out of range for size " +
                                                          std::to_string(size));
  DTENSOR_CHECK(store != nullptr, "make_gloo_backend: the store is null");
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
  state->options = options;
  std::vector<int> all(size);
  std::iota(all.begin(), all.end(), 0);
  return detail::GlooBackendImpl::create(state, options.prefix + "/world", std::move(all), rank,
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

} // namespace dtensor
