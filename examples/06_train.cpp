// 06: a small model trained for a number of steps in a chosen parallel layout, checked against the same
// training on one rank.
//
// Run as 4 processes: dtensor-run --nproc-per-node 4 ./example_06_train --layout fsdp_tp --steps 50
// On GPUs (the nvcc build of this file, examples/06_train_cuda.cu; see "On CUDA" below), one process per GPU:
//                     dtensor-run --nproc-per-node 4 ./example_06_train_cuda --layout fsdp_tp --dtype float
//   --layout tp|ddp|fsdp|hsdp|fsdp_tp   how the parameters are held and reduced (default fsdp_tp)
//   --device cpu|cuda                    where parameters, activations, gradients and optimizer state live:
//                                        cpu in example_06_train (gloo, or MPI under mpirun), cuda in
//                                        example_06_train_cuda (NCCL; the default there)
//   --mesh REP,DP,TP                     the mesh (default: from the layout, see below)
//   --steps N                            training steps (default 50)
//   --dtype double|float                 the element type of parameters, activations and gradients
//                                        (default double)
//   --tokens N --hidden H --ffn F --vocab V   the sizes (default 38, 18, 30, 37: none divides by 4)
//   --no-check                           skip the one-rank reference (benchmarks: large sizes)
//   --json FILE                          rank 0 writes the measurements as one JSON object
//   --print-comm                         rank 0 prints the collectives of one step
//   --checkpoint                         tp and ddp: activation checkpointing of every block (each keeps
//                                        its input only and runs again in the backward; the sharded
//                                        layouts recompute their blocks anyway)
//
// The model: a vocab-parallel embedding, kBlocks blocks of (rms_norm, an MLP in tensor + sequence parallel,
// a residual), a final rms_norm and a head whose logits stay sharded on the vocabulary (cross_entropy as
// loss_parallel: no gather of the logits). One mesh type for every layout, (rep, dp, tp): the tokens are
// sharded over rep and dp (and over tp between the tensor-parallel regions), the TP weights over tp.
//
//   ids [S(0),S(0),R] --embedding, W_emb (V, H) [R,R,S(0)]--> [S(0),S(0),P] --reduce_scatter(tp)--> h
//   block: h [S(0),S(0),S(0)] --rms_norm--> --all_gather(tp)--> [S(0),S(0),R] --linear W1 (F, H)
//   [R,R,S(0)]-->
//          gelu --linear W2 (H, F) [R,R,S(1)]--> [S(0),S(0),P] --reduce_scatter(tp)--> + h
//   head:  --rms_norm--> --all_gather(tp)--> linear W_out (V, H) [R,R,S(0)] --> logits [S(0),S(0),S(1)]
//          --cross_entropy--> loss (the mean over every token of the step)
//
// The layouts (mesh when --mesh is not given, for 4 ranks):
//   tp       (1, 1, 4)  parameters replicated over the batch axes, gradients reduced by DDPReducer over dp
//   ddp      (1, 4, 1)  the same code: DDP's buckets all-reduced over dp while the backward runs
//   fsdp     (1, 4, 1)  one FlatParamGroup per block (and one for the embedding, one for the head),
//                       Fsdp<"dp">, run by FsdpSchedule (parallel/schedule.hpp): prefetch (the next group's
//                       all_gather issued before the current group computes), reshard_after_forward (the
//                       backward gathers again and recomputes the block's forward from its saved input),
//                       one reduce_scatter per group, asynchronous (at most two in flight: each holds its
//                       group's unsharded gradient buffer)
//   hsdp     (2, 2, 1)  the same with Hsdp<"rep", "dp">: reduce_scatter over dp, all_reduce over rep
//   fsdp_tp  (1, 2, 2)  FSDP over dp of parameters that are tensor-parallel over tp
// Every layout then clips the gradients by their global norm (clip_grad_norm, over the flat groups for the
// sharded layouts) and steps AdamW on its local shards (Optimizer::step(index, group)). The
// parameters start from the sharding-invariant RNG (parallel/param_init.hpp), so every layout starts from the
// one-rank weights. The default sizes are uneven: 38 tokens, hidden 18, ffn 30, vocab 37 on 4 ranks.
//
// Self-check: the same training runs on one rank in this process (a group of this rank alone,
// world.new_group({rank}): a one-rank communicator of the world's backend, so no second backend is needed;
// a (1, 1, 1) mesh, parameters replicated and reduced as the tp/ddp layout does, clipped with
// clip_grad_norm), in the same element type on the same device. The loss at every step and every final
// parameter must agree within 1e-10 in double, 1e-5 in float (relative for the loss, against max(1,
// |value|) for the parameters); the program exits 1 otherwise.
//
// Communication pins: every training step runs under a CommDebugMode, and its collectives (op, mesh axis,
// count) must equal the ones the layout implies, derived from the model's structure (kBlocks blocks, the
// FSDP groups, DDP's buckets) by expected_comms below; the program names the differences and exits 1
// otherwise.
//
// Time split (rank 0, milliseconds per step): the example times its communication regions on the training
// thread with a steady clock: every blocking redistribute (the tensor-parallel all_gathers and
// reduce_scatters and their duals in the backward, the rep/tp reductions of gradients) and every wait on an
// asynchronous collective (FSDP's params() / reduce-scatter waits, DDP's finish()). cross_entropy's two
// all_reduces of one value per row and the clip's all_reduce of one double run inside ops and count as
// compute. "exposed" is that blocked time in the steps run with overlap; "communication" is the same
// regions measured in the steps run with overlap off (1, 6, 11, ...: each asynchronous collective waited
// for as soon as it is issued, numerically the same step), i.e. the whole time of a step's communication;
// "compute" is the step time minus the exposed communication. On a machine with fewer cores than ranks a
// blocked wait also holds the time the peers need to reach the collective, so these are upper bounds.
// Rank 0 also reports the minor page faults its process takes per step (getrusage, every thread), in the
// steps with overlap.
//
// On CUDA (example_06_train_cuda: this file compiled by nvcc, linked with NCCL and cuBLAS): each process
// trains on the GPU NCCL gives it, cuda:(LOCAL_RANK mod the visible devices). Every tensor of the model is
// a CUDA tensor: the parameters are initialised there by the sharding-invariant RNG, the step's tokens are
// made on the host and distributed from rank 0 as CUDA tensors, the GEMMs are cuBLAS, the norms, gelu,
// embedding, loss, DDP's buckets, FSDP's flat buffers, the clip and AdamW are the library's kernels on the
// tensors' stream, and the collectives are NCCL's (the one-rank reference runs on one-rank NCCL
// communicators on the same GPU). The same collectives are pinned every step. What comes to the host is
// small (cross_entropy's per-row statistics, the norms' partial sums, the loss) or for the comparison (the
// final parameters). Each step ends with a device synchronisation, so its time includes its kernels; the
// communication regions are host time there (an NCCL wait orders the stream and returns), so the split
// into compute and communication is not measured on CUDA. Exits 77 (ctest's skip) when no CUDA device is
// visible. Several ranks on one GPU (a test setup) need their own NCCL_HOSTID each: with
// DTENSOR_TEST_HOSTID_PER_RANK=1 the program sets it from RANK, as tests/nccl/nccl_suite.cu does (and
// NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=lo in the environment).

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/comm/init.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops.hpp>
#include <dtensor/parallel.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/resource.h>

// The CUDA path exists when nvcc compiles this file (the library's local kernels then run on CUDA tensors)
// and NCCL is linked (examples/06_train_cuda.cu, target example_06_train_cuda).
#if DTENSOR_LOCAL_OPS_CUDA && DTENSOR_HAS_NCCL
#define DTENSOR_TRAIN_CUDA 1
#include <cuda_runtime_api.h>
#include <dtensor/core/cuda_devices.hpp>
#else
#define DTENSOR_TRAIN_CUDA 0
#endif

using namespace dtensor;

namespace {

using Mesh = MeshShape<Axis<"rep">, Axis<"dp">, Axis<"tp">>;
using R = Replicate;
using P = Partial<>;
template <int D>
using S = Shard<D>;

/// The model's sizes (set once by main from the flags).
struct Sizes {
  std::int64_t tokens = 38, hidden = 18, ffn = 30, vocab = 37;
};
Sizes sizes;
/// Where every tensor of the model lives (set once by main from --device).
Device device = Device::cpu();
constexpr int kBlocks = 3;
constexpr double kLr = 1e-2, kMaxNorm = 0.5; // the early steps clip

enum class Layout { tp, ddp, fsdp, hsdp, fsdp_tp };

/// `t` on the host: itself there, else a copy.
template <class U, int R>
Tensor<U, R> to_host(const Tensor<U, R>& t) {
  return t.device().is_cpu() ? t : t.to(Device::cpu());
}
/// A host tensor moved to `device` (itself on the host): small values a collective reduces, since NCCL
/// reduces device memory only.
template <class U, int R>
Tensor<U, R> on_device(const Tensor<U, R>& t) {
  return device.is_cpu() ? t : t.to(device);
}
/// Waits for the work queued on the device (nothing on the host).
void sync_device() {
#if DTENSOR_TRAIN_CUDA
  if (device.is_cuda()) {
    detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", "06_train");
  }
#endif
}

/// Heap bytes live now, and their peak since reset_heap_peak(): bench_train (bench/train/train_bench.cpp)
/// builds this file with bench/common/alloc_counter.hpp, which counts every operator new; here they are 0.
#ifdef DTENSOR_TRAIN_COUNT_HEAP
std::int64_t heap_live() {
  return bench::alloc::live();
}
std::int64_t heap_peak() {
  return bench::alloc::peak();
}
void reset_heap_peak() {
  bench::alloc::reset_peak();
}
#else
std::int64_t heap_live() {
  return 0;
}
std::int64_t heap_peak() {
  return 0;
}
void reset_heap_peak() {}
#endif

// ---- communication pins ----------------------------------------------------------------------------------

/// Collectives of one step: (op, mesh axes as CommDebugMode labels them) -> count.
using CommCounts = std::map<std::pair<std::string, std::string>, std::int64_t>;

/// The collectives one training step of `layout` must issue, from the model's structure: kBlocks blocks,
/// for the sharded layouts kBlocks + 2 FSDP groups, for the replicated ones `buckets` DDP buckets. Every
/// mesh axis issues its ops whatever its size (a collective over one rank is still called).
CommCounts expected_comms(Layout layout, int buckets, bool checkpoint) {
  const std::int64_t b = kBlocks;
  CommCounts c;
  // distribute_tensor of the step's ids and targets from rank 0: the shape broadcast, the blocks scattered.
  c[{"broadcast", "rep*dp*tp"}] = 2;
  c[{"scatter", "rep*dp*tp"}] = 2;
  // cross_entropy on logits [S(0),S(0),S(1)]: the row max and the row sums over the vocab axis, the mean
  // over each axis that shards the rows.
  c[{"all_reduce", "tp"}] += 2;
  c[{"all_reduce", "rep"}] += 1;
  c[{"all_reduce", "dp"}] += 1;
  // A rms_norm gain's gradient is Partial on every axis, a matrix's on rep and dp (its rows are its own on
  // tp). Each Partial axis that is not reduced by DDP or FSDP is all-reduced, one op per axis.
  if (layout == Layout::tp || layout == Layout::ddp) {
    // TP + SP: forward one all_gather (before W1, before the head) and one reduce_scatter (after W2, after
    // the embedding) per region; the backward runs their duals.
    c[{"all_gather", "tp"}] = 2 * (b + 1);
    c[{"reduce_scatter", "tp"}] = 2 * (b + 1);
    if (checkpoint) { // each block's forward runs again in the backward, with its all_gather and
                      // reduce_scatter
      c[{"all_gather", "tp"}] += b;
      c[{"reduce_scatter", "tp"}] += b;
    }
    c[{"all_reduce", "dp"}] += buckets;                // DDP: one per bucket
    c[{"all_reduce", "rep"}] += (b + 1) + (2 * b + 2); // every gradient (a second batch axis)
    c[{"all_reduce", "tp"}] += b + 1;                  // the gains (sequence parallel)
    c[{"all_reduce", "tp"}] += 1; // clip_grad_norm: one double over the axes where some gradient is sharded
    return c;
  }
  const std::int64_t groups = b + 2;
  // FSDP: each group gathered for the forward, again for the backward (but the head, which runs its
  // forward and backward at once); the blocks and the embedding recompute their forward in the backward,
  // with their tensor-parallel collectives.
  c[{"all_gather", "dp"}] = groups + (b + 1);
  c[{"all_gather", "tp"}] = (b + 1) + b + (b + 1);
  c[{"reduce_scatter", "tp"}] = (b + 1) + (b + 1) + (b + 1);
  c[{"reduce_scatter", "dp"}] = groups; // one per group
  c[{"all_reduce", "tp"}] += b + 1;     // the gains, before packing
  if (layout == Layout::fsdp) {
    c[{"all_reduce", "rep"}] += (b + 1) + (2 * b + 2); // rep is no FSDP axis: every gradient, before packing
  } else {
    c[{"all_reduce", "rep"}] += groups; // HSDP: each group's reduced shard over the replicas
  }
  // clip_grad_norm over the groups: one double over the axes where gradient shards differ (the FSDP axis dp,
  // and tp, where the matrices are sharded); the replicas over rep hold the same sum.
  c[{"all_reduce", "dp*tp"}] += 1;
  return c;
}

/// Empty when `comm` recorded exactly `want`; otherwise the differences.
std::string compare_comms(const CommDebugMode& comm, const CommCounts& want) {
  CommCounts got;
  for (const auto& [key, e] : comm.entries()) {
    got[key] = e.count;
  }
  std::string diff;
  auto note = [&](const auto& key, std::int64_t w, std::int64_t g) {
    if (w != g) {
      diff += " " + key.first + "(" + key.second + "): " + std::to_string(g) + " where " + std::to_string(w) +
              " expected;";
    }
  };
  for (const auto& [key, w] : want) {
    note(key, w, got.count(key) ? got[key] : 0);
  }
  for (const auto& [key, g] : got) {
    if (!want.count(key)) {
      note(key, 0, g);
    }
  }
  return diff;
}

/// The model, its trainers and their timing, in element type T (float or double).
template <class T>
struct Model {
  // Parameters (unsharded placements) and their gradients as the ops' backward gives them.
  using Ids = DTensor<std::int64_t, 1, Mesh, S<0>, S<0>, R>;
  using Act = DTensor<T, 2, Mesh, S<0>, S<0>, S<0>>; // (tokens, H) between the TP regions
  using Gain = DTensor<T, 1, Mesh, R, R, R>;         // rms_norm's weight (H)
  using ColW = DTensor<T, 2, Mesh, R, R, S<0>>;      // W_emb (V, H), W1 (F, H), W_out (V, H)
  using RowW = DTensor<T, 2, Mesh, R, R, S<1>>;      // W2 (H, F)
  using DGain = DTensor<T, 1, Mesh, P, P, P>;        // rows sharded on every axis
  using DColW = DTensor<T, 2, Mesh, P, P, S<0>>;
  using DRowW = DTensor<T, 2, Mesh, P, P, S<1>>;

  /// Seconds the training thread spent in communication regions (see the top of the file).
  struct CommClock {
    bool overlap = true; ///< false: every asynchronous collective is waited for as soon as it is issued
    double blocked = 0;
    template <class F>
    decltype(auto) operator()(F&& f) {
      const auto t0 = std::chrono::steady_clock::now();
      struct Add {
        CommClock& c;
        std::chrono::steady_clock::time_point t0;
        ~Add() { c.blocked += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
      } add{*this, t0};
      return std::forward<F>(f)();
    }
  };

  // ---- the model: forward with the backward's context, on any mesh -------------------------------------

  struct BlockGrads {
    Act dh;
    DGain dg;
    DColW dw1;
    DRowW dw2;
  };
  struct BlockOut {
    Act h;
    std::function<BlockGrads(const Act&)> back;
  };

  /// h + W2 gelu(W1 rms_norm(h)), tensor + sequence parallel.
  static BlockOut block(const Act& h, const Gain& g, const ColW& w1, const RowW& w2, CommClock& clock) {
    auto [n, norm_back] = rms_norm<1>(h, g, 1e-6, with_backward);                            // [S,S,S]
    auto [x, ag_back] = clock([&] { return redistribute_with_backward<S<0>, S<0>, R>(n); }); // all_gather
    auto [u, mm1_back] = linear(x, w1, with_backward);                                       // [S,S,S(1)]
    auto [a, gelu_back] = gelu(u, with_backward);
    auto [v, mm2_back] = linear(a, w2, with_backward); // [S,S,P]
    auto [v_sp, rs_back] = clock([&] { return redistribute_with_backward<S<0>, S<0>, S<0>>(v); });
    auto [out, add_back] = add(h, v_sp, with_backward);
    auto back = [&clock, norm_back, ag_back, mm1_back, gelu_back, mm2_back, rs_back,
                 add_back](const Act& dout) -> BlockGrads {
      auto [dh_res, dv_sp] = add_back(dout);
      auto [da, dw2] = mm2_back(clock([&] { return rs_back(dv_sp); }));
      auto [dx, dw1] = mm1_back(gelu_back(da));
      auto [dh_norm, dg] = norm_back(clock([&] { return ag_back(dx); }));
      return {add(dh_res, dh_norm), dg, dw1, dw2};
    };
    return {out, back};
  }

  struct EmbOut {
    Act h;
    std::function<DColW(const Act&)> back;
  };
  static EmbOut embed(const Ids& ids, const ColW& w, CommClock& clock) {
    auto [e, emb_back] = embedding(ids, w, with_backward); // [S,S,P]
    auto [h, rs_back] =
        clock([&] { return redistribute_with_backward<S<0>, S<0>, S<0>>(e); }); // reduce_scatter
    return {h, [&clock, emb_back, rs_back](const Act& dh) {
              return emb_back(clock([&] { return rs_back(dh); }));
            }};
  }

  struct HeadGrads {
    Act dh;
    DGain dg;
    DColW dw;
  };
  struct HeadOut {
    double loss;
    std::function<HeadGrads()> back;
  };
  static HeadOut head(const Act& h, const Ids& targets, const Gain& g, const ColW& w, CommClock& clock) {
    auto [n, norm_back] = rms_norm<1>(h, g, 1e-6, with_backward);
    auto [x, ag_back] = clock([&] { return redistribute_with_backward<S<0>, S<0>, R>(n); });
    auto [logits, mm_back] = linear(x, w, with_backward); // [S(0),S(0),S(1)]: the vocabulary over tp
    auto [loss, loss_back] = cross_entropy(logits, targets, with_backward);
    auto back = [&clock, norm_back, ag_back, mm_back, loss_back]() -> HeadGrads {
      auto [dx, dw] = mm_back(loss_back(1.0));
      auto [dh, dg] = norm_back(clock([&] { return ag_back(dx); }));
      return {dh, dg, dw};
    };
    return {static_cast<double>(loss.local().item()), back};
  }

  /// The step's tokens: a fixed random mapping to learn (target = (3 id + 1) mod V).
  static std::pair<Ids, Ids> batch(const DeviceMesh<Mesh>& mesh, int step) {
    Tensor<std::int64_t, 1> ids({sizes.tokens}), targets({sizes.tokens});
    for (std::int64_t i = 0; i < sizes.tokens; ++i) {
      const std::uint64_t z = (std::uint64_t(step) * 1000003u + std::uint64_t(i) * 7919u) * 2654435761u;
      ids(i) = static_cast<std::int64_t>((z >> 16) % sizes.vocab);
      targets(i) = (3 * ids(i) + 1) % sizes.vocab;
    }
    // Every rank passes a tensor on the device (only rank 0's contents are read).
    return {distribute_tensor<S<0>, S<0>, R>(mesh, on_device(ids)),
            distribute_tensor<S<0>, S<0>, R>(mesh, on_device(targets))};
  }

  /// The parameters, unsharded, from the sharding-invariant RNG (the same on every mesh).
  struct Weights {
    ColW emb;
    std::vector<Gain> g;
    std::vector<ColW> w1;
    std::vector<RowW> w2;
    Gain gf;
    ColW out;
  };
  static Weights init_weights(const DeviceMesh<Mesh>& mesh) {
    init::InitKeys keys(2024);
    Weights w{zeros<T, R, R, S<0>>(mesh, {sizes.vocab, sizes.hidden}, device),
              {},
              {},
              {},
              zeros<T, R, R, R>(mesh, {sizes.hidden}, device),
              zeros<T, R, R, S<0>>(mesh, {sizes.vocab, sizes.hidden}, device)};
    init::normal_(w.emb, 0.0, 1.0, keys.next());
    for (int b = 0; b < kBlocks; ++b) {
      w.g.push_back(zeros<T, R, R, R>(mesh, {sizes.hidden}, device));
      init::ones_(w.g.back());
      w.w1.push_back(zeros<T, R, R, S<0>>(mesh, {sizes.ffn, sizes.hidden}, device));
      init::kaiming_uniform_(w.w1.back(), keys.next(), std::sqrt(5.0));
      w.w2.push_back(zeros<T, R, R, S<1>>(mesh, {sizes.hidden, sizes.ffn}, device));
      init::kaiming_uniform_(w.w2.back(), keys.next(), std::sqrt(5.0));
    }
    init::ones_(w.gf);
    init::kaiming_uniform_(w.out, keys.next(), std::sqrt(5.0));
    return w;
  }

  /// What a training run gives: the losses, the final parameters (full, on the host), the time split.
  struct Trained {
    std::vector<double> losses, norms;
    std::vector<Tensor<T, 2>> mats;
    std::vector<Tensor<T, 1>> vecs;
    double step_s = 0, exposed_s = 0, comm_s = 0; ///< per step (see the top of the file)
    double serial_step_s = 0;                     ///< the steps with overlap off, per step
    double faults_per_step = 0; ///< minor page faults of the process per step (the steps with overlap)
    std::string comm_mismatch;  ///< the first step whose collectives differ from expected_comms, and how
    /// Heap bytes (bench_train only): live before step 0, peak from step 1 on (the optimizer state exists),
    /// live after the last step.
    std::int64_t heap_start = 0, heap_peak = 0, heap_end = 0;
    /// This rank's parameters, gradients and AdamW state (2 values per parameter element), in bytes.
    std::int64_t state_bytes = 0;

    /// Rank 0 prints the step's collectives (print_comm); the first mismatch is kept.
    void pin(int step, const CommDebugMode& comm, const CommCounts& want, bool print_comm) {
      if (print_comm && step == 0) {
        std::printf("collectives of step 1 (each checked against the layout's, every step):\n%s",
                    comm.to_string().c_str());
      }
      const std::string diff = compare_comms(comm, want);
      if (!diff.empty() && comm_mismatch.empty()) {
        comm_mismatch =
            "step " + std::to_string(step + 1) + " ran other collectives than the layout's:" + diff;
      }
    }
  };

  /// A step's wall time and the minor page faults the process took during it (getrusage: every thread,
  /// gloo's included).
  struct Timed {
    double seconds = 0;
    double faults = 0;
  };
  static double minor_faults() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_minflt);
  }
  template <class Step>
  static Timed timed(Step&& step) {
    const double f0 = minor_faults();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    sync_device(); // the step's kernels are part of its time
    return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
            minor_faults() - f0};
  }

  /// Timing bookkeeping shared by the trainers: step 0 warms up; steps 1, 6, 11, ... run with overlap off
  /// (they measure all the communication); the others with overlap (they measure the step and its exposed
  /// part).
  struct Timing {
    double step_s = 0, exposed_s = 0, comm_s = 0, serial_step_s = 0, faults = 0;
    int timed = 0, serial = 0;
    static bool serial_step(int step, int steps) { return steps >= 3 && step % 5 == 1; }
    void record(int step, int steps, const Timed& t, double blocked) {
      if (serial_step(step, steps)) {
        comm_s += blocked;
        serial_step_s += t.seconds;
        ++serial;
      } else if (step >= 1 || steps < 3) {
        step_s += t.seconds;
        exposed_s += blocked;
        faults += t.faults;
        ++timed;
      }
    }
    void to(Trained& t) const {
      t.step_s = step_s / std::max(timed, 1);
      t.exposed_s = exposed_s / std::max(timed, 1);
      t.comm_s = comm_s / std::max(serial, 1);
      t.serial_step_s = serial_step_s / std::max(serial, 1);
      t.faults_per_step = faults / std::max(timed, 1);
    }
  };

  // ---- tp and ddp: replicated parameters, DDP's buckets over dp -------------------------------------------

  /// A gradient after DDP's reduction over dp (Replicate there, Partial still over rep and, for gains, tp).
  template <class G>
  using ReadyT = decltype(std::declval<DDPReducer<"dp", T, Mesh>&>().ready(0, std::declval<G>()));

  static Trained train_replicated(const DeviceMesh<Mesh>& mesh, Layout layout, int steps, bool print,
                                  bool print_comm, bool checkpoint) {
    Weights w = init_weights(mesh);
    const int n = 3 + 3 * kBlocks; // parameters in registration order: emb, (g, w1, w2) per block, gf, out
    std::vector<std::int64_t> numels{w.emb.local().numel()};
    for (int b = 0; b < kBlocks; ++b) {
      numels.insert(numels.end(), {w.g[b].local().numel(), w.w1[b].local().numel(), w.w2[b].local().numel()});
    }
    numels.insert(numels.end(), {w.gf.local().numel(), w.out.local().numel()});
    DDPReducer<"dp", T, Mesh> reducer(mesh, numels,
                                      {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048});
    optim::AdamW opt({.lr = kLr, .weight_decay = 0.01});
    Trained out;
    Timing timing;
    const CommCounts want = expected_comms(layout, static_cast<int>(reducer.buckets().size()), checkpoint);
    for (const std::int64_t e : numels) {
      out.state_bytes += 4 * e * std::int64_t(sizeof(T));
    }
    out.heap_start = heap_live();
    for (int step = 0; step < steps; ++step) {
      if (step == 1) {
        reset_heap_peak();
      }
      CommDebugMode comm;
      CommClock clock{.overlap = !Timing::serial_step(step, steps)};
      const auto [ids, targets] = batch(mesh, step);
      double loss = 0, norm = 0;
      const Timed took = timed([&] {
        // Forward, keeping each layer's backward context (with --checkpoint a block keeps its input only).
        auto e = embed(ids, w.emb, clock);
        std::vector<BlockOut> blocks;
        const Act* h = &e.h;
        auto block_fn = [&clock](const Act& in, const Gain& g, const ColW& w1, const RowW& w2,
                                 WithBackwardTag) {
          BlockOut r = block(in, g, w1, w2, clock);
          return WithBackward<Act, std::function<BlockGrads(const Act&)>>{r.h, r.back};
        };
        for (int b = 0; b < kBlocks; ++b) {
          if (checkpoint) {
            auto [y, back] = activation_checkpoint(block_fn, *h, w.g[b], w.w1[b], w.w2[b]);
            blocks.push_back({y, back});
          } else {
            blocks.push_back(block(*h, w.g[b], w.w1[b], w.w2[b], clock));
          }
          h = &blocks.back().h;
        }
        auto hd = head(*h, targets, w.gf, w.out, clock);
        loss = hd.loss;
        // Backward: each gradient handed to the reducer as soon as it exists (its bucket's all_reduce starts
        // when the bucket is complete). In the step with overlap off they are handed over after the backward
        // and the buckets waited for at once, so the wait measures all of DDP's communication.
        std::vector<std::function<void()>> deferred;
        auto ready = [&](int i, const auto& g, auto& slot) {
          auto go = [&reducer, &slot, i, g] { slot.emplace(reducer.ready(i, g)); };
          if (clock.overlap) {
            go();
          } else {
            deferred.push_back(go);
          }
        };
        std::optional<ReadyT<DColW>> g_out, g_emb;
        std::optional<ReadyT<DGain>> g_gf;
        std::vector<std::optional<ReadyT<DGain>>> g_g(kBlocks);
        std::vector<std::optional<ReadyT<DColW>>> g_w1(kBlocks);
        std::vector<std::optional<ReadyT<DRowW>>> g_w2(kBlocks);
        auto hg = hd.back();
        ready(n - 1, hg.dw, g_out);
        ready(n - 2, hg.dg, g_gf);
        Act dh = hg.dh;
        for (int b = kBlocks - 1; b >= 0; --b) {
          auto bg = blocks[static_cast<std::size_t>(b)].back(dh);
          ready(3 + 3 * b, bg.dw2, g_w2[b]);
          ready(2 + 3 * b, bg.dw1, g_w1[b]);
          ready(1 + 3 * b, bg.dg, g_g[b]);
          dh = bg.dh;
        }
        ready(0, e.back(dh), g_emb);
        clock([&] { // waits for the buckets still in flight
          for (auto& f : deferred) {
            f();
          }
          reducer.finish();
        });
        // The reductions left: over rep (a second batch axis) and, for the gains, over tp (sequence
        // parallel).
        std::vector<Gain> gg;
        std::vector<ColW> gw1;
        std::vector<RowW> gw2;
        for (int b = 0; b < kBlocks; ++b) {
          gg.push_back(clock([&] { return g_g[b]->template redistribute<R, R, R>(); }));
          gw1.push_back(clock([&] { return g_w1[b]->template redistribute<R, R, S<0>>(); }));
          gw2.push_back(clock([&] { return g_w2[b]->template redistribute<R, R, S<1>>(); }));
        }
        const ColW gemb = clock([&] { return g_emb->template redistribute<R, R, S<0>>(); });
        const Gain ggf = clock([&] { return g_gf->template redistribute<R, R, R>(); });
        const ColW gout = clock([&] { return g_out->template redistribute<R, R, S<0>>(); });
        // Clip by the global norm (one all_reduce of one double over tp), then AdamW on the local shards.
        norm = [&]<std::size_t... B>(std::index_sequence<B...>) {
          return clip_grad_norm(kMaxNorm, gemb, ggf, gout, gg[B]..., gw1[B]..., gw2[B]...);
        }
        (std::make_index_sequence<kBlocks>{});
        opt.step(0, w.emb, gemb);
        for (int b = 0; b < kBlocks; ++b) {
          opt.step(1 + 3 * b, w.g[b], gg[b]);
          opt.step(2 + 3 * b, w.w1[b], gw1[b]);
          opt.step(3 + 3 * b, w.w2[b], gw2[b]);
        }
        opt.step(n - 2, w.gf, ggf);
        opt.step(n - 1, w.out, gout);
      });
      timing.record(step, steps, took, clock.blocked);
      out.pin(step, comm, want, print_comm);
      out.losses.push_back(loss);
      out.norms.push_back(norm);
      if (print) {
        std::printf("step %3d/%d  loss %.6f  grad norm %.4f  %6.1f ms%s\n", step + 1, steps, loss, norm,
                    took.seconds * 1e3, clock.overlap ? "" : "  (overlap off)");
        std::fflush(stdout);
      }
    }
    out.heap_peak = steps > 1 ? heap_peak() : 0;
    out.heap_end = heap_live();
    out.mats.push_back(to_host(w.emb.full_tensor()));
    for (int b = 0; b < kBlocks; ++b) {
      out.vecs.push_back(to_host(w.g[b].full_tensor()));
      out.mats.push_back(to_host(w.w1[b].full_tensor()));
      out.mats.push_back(to_host(w.w2[b].full_tensor()));
    }
    out.vecs.push_back(to_host(w.gf.full_tensor()));
    out.mats.push_back(to_host(w.out.full_tensor()));
    timing.to(out);
    return out;
  }

  // ---- fsdp, hsdp, fsdp_tp: one FlatParamGroup per block
  // ---------------------------------------------------

  template <class FsdpLayout>
  static Trained train_sharded(const DeviceMesh<Mesh>& mesh, Layout layout, int steps, bool print,
                               bool print_comm) {
    using EmbGroup = FlatParamGroup<T, Mesh, FsdpLayout, Params<Param<2, R, R, S<0>>>>;
    using BlockGroup =
        FlatParamGroup<T, Mesh, FsdpLayout, Params<Param<1>, Param<2, R, R, S<0>>, Param<2, R, R, S<1>>>>;
    using HeadGroup = FlatParamGroup<T, Mesh, FsdpLayout, Params<Param<1>, Param<2, R, R, S<0>>>>;
    std::vector<BlockGroup> gb;
    std::optional<EmbGroup> ge;
    std::optional<HeadGroup> gh;
    {
      const Weights w = init_weights(mesh); // sharded into the groups' flat buffers, then dropped
      ge.emplace(w.emb);
      for (int b = 0; b < kBlocks; ++b) {
        gb.emplace_back(w.g[b], w.w1[b], w.w2[b]);
      }
      gh.emplace(w.gf, w.out);
    }
    optim::AdamW opt({.lr = kLr, .weight_decay = 0.01});
    Trained out;
    Timing timing;
    const CommCounts want = expected_comms(layout, 0, false);
    out.state_bytes = 4 * ge->sharded_numel() + 4 * gh->sharded_numel();
    for (const auto& g : gb) {
      out.state_bytes += 4 * g.sharded_numel();
    }
    out.state_bytes *= std::int64_t(sizeof(T));
    out.heap_start = heap_live();
    for (int step = 0; step < steps; ++step) {
      if (step == 1) {
        reset_heap_peak();
      }
      CommDebugMode comm;
      CommClock clock{.overlap = !Timing::serial_step(step, steps)};
      const auto [ids, targets] = batch(mesh, step);
      double loss = 0, norm = 0;
      // The FSDP schedule (parallel/schedule.hpp) over the groups in forward order: the next group's
      // all_gather in flight while one computes, each group resharded after its forward and gathered again
      // for its backward, at most two reductions in flight (each holds its group's unsharded gradient
      // buffer); with overlap off, each collective waited for as soon as it is issued.
      FsdpSchedule sched(
          {.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2, .overlap = clock.overlap});
      sched.add(*ge);
      for (const auto& g : gb) {
        sched.add(g);
      }
      sched.add(*gh);
      const Timed took = timed([&] {
        // Forward: only the block inputs are kept.
        std::vector<Act> inputs;
        inputs.push_back(sched.forward(*ge, [&](const ColW& w_emb) { return embed(ids, w_emb, clock).h; }));
        for (int b = 0; b < kBlocks; ++b) {
          inputs.push_back(sched.forward(gb[b], [&](const Gain& g, const ColW& w1, const RowW& w2) {
            return block(inputs.back(), g, w1, w2, clock).h;
          }));
        }
        // The head: forward and backward in one call (its parameters stay gathered in between).
        std::optional<Act> dh;
        sched.backward(*gh, [&](const Gain& gf, const ColW& w_out) {
          auto hd = head(inputs.back(), targets, gf, w_out, clock);
          loss = hd.loss;
          auto hg = hd.back();
          dh.emplace(hg.dh);
          return std::tuple{hg.dg, hg.dw};
        });
        // Backward: each block recomputes its forward from its saved input with the backward's context.
        for (int b = kBlocks - 1; b >= 0; --b) {
          sched.backward(gb[b], [&](const Gain& g, const ColW& w1, const RowW& w2) {
            auto bg = block(inputs[static_cast<std::size_t>(b)], g, w1, w2, clock).back(*dh);
            dh.emplace(bg.dh);
            return std::tuple{bg.dg, bg.dw1, bg.dw2};
          });
        }
        sched.backward(*ge,
                       [&](const ColW& w_emb) { return std::tuple{embed(ids, w_emb, clock).back(*dh)}; });
        sched.finish();
        // Clip by the global norm over the groups (one all_reduce of one double), then AdamW on the shards.
        norm = clip_grad_norm(kMaxNorm, *ge, gb, *gh);
        int index = 0;
        auto step_group = [&](auto& group) {
          opt.step(index++, group);
          group.zero_grad();
        };
        step_group(*ge);
        for (auto& g : gb) {
          step_group(g);
        }
        step_group(*gh);
      });
      clock.blocked += sched.stats().blocked_seconds;
      timing.record(step, steps, took, clock.blocked);
      out.pin(step, comm, want, print_comm);
      out.losses.push_back(loss);
      out.norms.push_back(norm);
      if (print) {
        std::printf("step %3d/%d  loss %.6f  grad norm %.4f  %6.1f ms%s\n", step + 1, steps, loss, norm,
                    took.seconds * 1e3, clock.overlap ? "" : "  (overlap off)");
        std::fflush(stdout);
      }
    }
    out.heap_peak = steps > 1 ? heap_peak() : 0;
    out.heap_end = heap_live();
    // The final parameters, gathered, in the order train_replicated gives them.
    ge->unshard();
    out.mats.push_back(to_host(std::get<0>(ge->params()).full_tensor()));
    for (auto& g : gb) {
      g.unshard();
      auto [gain, w1, w2] = g.params();
      out.vecs.push_back(to_host(gain.full_tensor()));
      out.mats.push_back(to_host(w1.full_tensor()));
      out.mats.push_back(to_host(w2.full_tensor()));
    }
    gh->unshard();
    auto [gf, w_out] = gh->params();
    out.vecs.push_back(to_host(gf.full_tensor()));
    out.mats.push_back(to_host(w_out.full_tensor()));
    timing.to(out);
    return out;
  }

}; // struct Model

template <class X>
double max_relative(const std::vector<X>& a, const std::vector<X>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (std::int64_t e = 0; e < a[i].numel(); ++e) {
      const double x = a[i].data()[e], y = b[i].data()[e];
      d = std::max(d, std::abs(x - y) / std::max(1.0, std::abs(y)));
    }
  }
  return d;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "06_train: %s\nusage: 06_train [--layout tp|ddp|fsdp|hsdp|fsdp_tp] [--mesh REP,DP,TP] "
               "[--device cpu|cuda] [--steps N] [--dtype double|float] [--tokens N] [--hidden H] [--ffn F] "
               "[--vocab V] [--no-check] [--json FILE] [--print-comm] [--checkpoint]\n",
               why);
  std::exit(2);
}

struct Options {
  const char* layout_name = "fsdp_tp";
  Layout layout = Layout::fsdp_tp;
  int steps = 50;
  bool check = true, print_comm = false, checkpoint = false;
  std::string json;
};

/// Trains in element type T as `opt` says, checks against one rank, prints; the exit status.
template <class T>
int train_main(ProcessGroup& world, const DeviceMesh<Mesh>& mesh, const Options& opt) {
  using M = Model<T>;
  const bool print = world.rank() == 0;
  auto run = [&](const DeviceMesh<Mesh>& m, Layout l, bool p) {
    switch (l) {
    case Layout::fsdp:
      return M::template train_sharded<Fsdp<"dp">>(m, l, opt.steps, p, opt.print_comm && p);
    case Layout::hsdp:
    case Layout::fsdp_tp:
      return M::template train_sharded<Hsdp<"rep", "dp">>(m, l, opt.steps, p, opt.print_comm && p);
    default:
      return M::train_replicated(m, l, opt.steps, p, opt.print_comm && p, opt.checkpoint);
    }
  };
  const typename M::Trained got = run(mesh, opt.layout, print);
  bool ok = got.comm_mismatch.empty();
  if (!ok) {
    std::fprintf(stderr, "rank %d: %s\n", world.rank(), got.comm_mismatch.c_str());
  }
  // The heap per rank (bench_train counts it; see Trained): the largest over the ranks.
  Tensor<double, 1> heap_here({3});
  heap_here(0) = double(got.heap_start);
  heap_here(1) = double(got.heap_peak);
  heap_here(2) = double(got.heap_end);
  Tensor<double, 1> heap_max = on_device(heap_here);
  all_reduce(heap_max, ReduceOp::max, world);
  const Tensor<double, 1> heap = to_host(heap_max);
#ifdef DTENSOR_TRAIN_COUNT_HEAP
  // At the optimizer step every parameter, gradient and AdamW state is live on the heap at once.
  if (opt.steps > 1 && heap(1) < double(got.state_bytes)) {
    std::fprintf(stderr, "rank %d: heap peak %.0f bytes below the %lld bytes of state this rank holds\n",
                 world.rank(), heap(1), static_cast<long long>(got.state_bytes));
    ok = false;
  }
#endif
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-10;
  double loss_diff = 0, param_diff = 0;
  if (opt.check) {
    // The same training on one rank: a group of this rank alone (made by its one member; a one-rank
    // communicator of the world's backend), a (1, 1, 1) mesh, replicated parameters.
    const ProcessGroup one = world.new_group({world.rank()});
    const typename M::Trained want = run(init_device_mesh<Mesh>(one, 1, 1, 1), Layout::ddp, false);
    if (!want.comm_mismatch.empty()) {
      std::fprintf(stderr, "the one-rank reference: %s\n", want.comm_mismatch.c_str());
      ok = false;
    }
    for (int s = 0; s < opt.steps; ++s) {
      loss_diff = std::max(loss_diff, std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]));
    }
    param_diff = std::max(max_relative(got.mats, want.mats), max_relative(got.vecs, want.vecs));
    ok = ok && loss_diff <= tol && param_diff <= tol;
  }
  if (print) {
    const double ms = 1e3;
    if (device.is_cuda()) { // the communication regions are host time there (see "On CUDA" at the top)
      std::printf("time per step on rank 0: %.2f ms, its kernels and collectives included (%.2f ms in the "
                  "steps with overlap off)\n",
                  got.step_s * ms, got.serial_step_s * ms);
    } else {
      std::printf("time per step on rank 0: %.2f ms = compute %.2f ms + exposed communication %.2f ms; "
                  "communication %.2f ms (measured in the steps with overlap off, %.2f ms a step: %.0f%% of "
                  "it hidden)\n",
                  got.step_s * ms, (got.step_s - got.exposed_s) * ms, got.exposed_s * ms, got.comm_s * ms,
                  got.serial_step_s * ms,
                  got.comm_s > 0 ? 100.0 * std::max(0.0, 1.0 - got.exposed_s / got.comm_s) : 0.0);
    }
    std::printf("minor page faults per step on rank 0: %.0f\n", got.faults_per_step);
    if (heap(1) > 0) {
      std::printf("heap per rank (largest over ranks): %.3f MB before training, peak %.3f MB in the steps, "
                  "%.3f MB after\n",
                  heap(0) / 1e6, heap(1) / 1e6, heap(2) / 1e6);
    }
    if (opt.check) {
      std::printf("against one rank: max relative difference of the losses %.1e, of the final parameters "
                  "%.1e (%s, tolerance %.0e)\n",
                  loss_diff, param_diff, std::is_same_v<T, float> ? "float" : "double", tol);
      std::printf("%s\n",
                  ok ? "OK: every step's loss and the final parameters equal the one-rank training's, "
                       "every step's collectives the layout's"
                     : "MISMATCH with the one-rank training or the expected collectives");
    } else {
      std::printf("%s\n", ok ? "OK: every step's collectives are the layout's (no one-rank check: --no-check)"
                             : "MISMATCH with the expected collectives");
    }
    if (!opt.json.empty()) {
      std::FILE* f = std::fopen(opt.json.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "06_train: cannot write %s\n", opt.json.c_str());
        return 1;
      }
      std::fprintf(
          f,
          "{\"suite\": \"train\", \"layout\": \"%s\", \"dtype\": \"%s\", \"device\": \"%s\", \"ranks\": %d, "
          "\"mesh\": [%d, %d, %d], \"blocks\": %d, \"tokens\": %lld, \"hidden\": %lld, \"ffn\": %lld, "
          "\"vocab\": %lld, \"steps\": %d, \"step_ms\": %.4f, \"compute_ms\": %.4f, "
          "\"exposed_ms\": %.4f, \"comm_ms\": %.4f, \"serial_step_ms\": %.4f, \"minor_faults_per_step\": "
          "%.1f, "
          "\"heap_start_bytes\": %.0f, \"heap_peak_bytes\": %.0f, \"heap_end_bytes\": %.0f, "
          "\"state_bytes\": %.0f, \"losses\": [",
          opt.layout_name, std::is_same_v<T, float> ? "float32" : "float64", device.is_cpu() ? "cpu" : "cuda",
          world.size(), mesh.size(0), mesh.size(1), mesh.size(2), kBlocks, (long long)sizes.tokens,
          (long long)sizes.hidden, (long long)sizes.ffn, (long long)sizes.vocab, opt.steps, got.step_s * ms,
          (got.step_s - got.exposed_s) * ms, got.exposed_s * ms, got.comm_s * ms, got.serial_step_s * ms,
          got.faults_per_step, heap(0), heap(1), heap(2), double(got.state_bytes));
      for (int s = 0; s < opt.steps; ++s) {
        std::fprintf(f, "%s%.8g", s ? ", " : "", got.losses[s]);
      }
      std::fprintf(f, "], \"check\": \"%s\"}\n",
                   !ok         ? "FAILED"
                   : opt.check ? "one-rank reference and collectives"
                               : "collectives");
      std::fclose(f);
    }
  }
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  Options opt;
  std::string mesh_arg, dtype = "double", device_name = DTENSOR_TRAIN_CUDA ? "cuda" : "cpu";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-check") {
      opt.check = false;
      continue;
    }
    if (a == "--print-comm") {
      opt.print_comm = true;
      continue;
    }
    if (a == "--checkpoint") {
      opt.checkpoint = true;
      continue;
    }
    if (i + 1 >= argc) {
      usage(("missing the value of " + a).c_str());
    }
    auto size = [&] {
      const long long v = std::atoll(argv[++i]);
      if (v < 1) {
        usage((a + " takes a positive number").c_str());
      }
      return static_cast<std::int64_t>(v);
    };
    if (a == "--layout") {
      opt.layout_name = argv[++i];
    } else if (a == "--mesh") {
      mesh_arg = argv[++i];
    } else if (a == "--steps") {
      opt.steps = std::atoi(argv[++i]);
    } else if (a == "--dtype") {
      dtype = argv[++i];
    } else if (a == "--device") {
      device_name = argv[++i];
    } else if (a == "--tokens") {
      sizes.tokens = size();
    } else if (a == "--hidden") {
      sizes.hidden = size();
    } else if (a == "--ffn") {
      sizes.ffn = size();
    } else if (a == "--vocab") {
      sizes.vocab = size();
    } else if (a == "--json") {
      opt.json = argv[++i];
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  if (dtype != "double" && dtype != "float") {
    usage(("--dtype takes double or float, not " + dtype).c_str());
  }
  if (device_name != "cpu" && device_name != "cuda") {
    usage(("--device takes cpu or cuda, not " + device_name).c_str());
  }
  InitOptions init; // the host build: the backend init_process_group picks (gloo; MPI under mpirun)
#if DTENSOR_TRAIN_CUDA
  if (device_name != "cuda") {
    usage("--device cpu: this is the CUDA build (example_06_train_cuda); the host build is example_06_train");
  }
  if (const CudaDevices visible = probe_cuda_devices(); visible.count == 0) {
    if (visible.unusable()) { // a GPU CUDA cannot use (an old driver) is an error, never a skip
      std::fprintf(stderr, "06_train: CUDA cannot use this machine's GPU: %s\n", visible.reason().c_str());
      return 1;
    }
    std::printf("06_train: no CUDA device visible (%s): skipped\n", visible.reason().c_str());
    return 77; // ctest's skip code
  }
  if (std::getenv("DTENSOR_TEST_HOSTID_PER_RANK") != nullptr) {
    // Several ranks on one GPU (a test setup): NCCL must see them as different hosts.
    const std::string id = "dtensor-06-train-host-" + std::to_string(read_dist_env().rank);
    ::setenv("NCCL_HOSTID", id.c_str(), 1);
  }
  init.backend = "nccl"; // on cuda:(LOCAL_RANK mod the visible devices), which becomes the current device
#else
  if (device_name != "cpu") {
    usage("--device cuda: this is the host build; the CUDA build is example_06_train_cuda "
          "(examples/06_train_cuda.cu, built where nvcc and NCCL are found)");
  }
#endif
  ProcessGroup world = init_process_group(init);
#if DTENSOR_TRAIN_CUDA
  int index = 0;
  detail::check_cuda(cudaGetDevice(&index), "cudaGetDevice", "06_train");
  device = Device::cuda(index);
#endif
  const int n = world.size();
  const struct {
    const char* name;
    Layout layout;
    int rep, dp, tp; // 0: the rest of the ranks
  } layouts[] = {{"tp", Layout::tp, 1, 1, 0},
                 {"ddp", Layout::ddp, 1, 0, 1},
                 {"fsdp", Layout::fsdp, 1, 0, 1},
                 {"hsdp", Layout::hsdp, 2, 0, 1},
                 {"fsdp_tp", Layout::fsdp_tp, 1, 0, 2}};
  const auto* chosen = std::find_if(std::begin(layouts), std::end(layouts),
                                    [&](const auto& l) { return std::string(opt.layout_name) == l.name; });
  if (chosen == std::end(layouts)) {
    usage((std::string("unknown layout ") + opt.layout_name).c_str());
  }
  opt.layout_name = chosen->name;
  opt.layout = chosen->layout;
  int rep = chosen->rep, dp = chosen->dp, tp = chosen->tp;
  if (!mesh_arg.empty() && std::sscanf(mesh_arg.c_str(), "%d,%d,%d", &rep, &dp, &tp) != 3) {
    usage(("--mesh takes REP,DP,TP, not " + mesh_arg).c_str());
  }
  int& rest = dp == 0 ? dp : tp; // the axis that takes the remaining ranks
  if (rest == 0) {
    rest = n / std::max(1, rep * (dp == 0 ? tp : dp));
  }
  if (rep * dp * tp != n || opt.steps < 1) {
    usage(("the mesh (" + std::to_string(rep) + ", " + std::to_string(dp) + ", " + std::to_string(tp) +
           ") does not have the " + std::to_string(n) + " ranks, or --steps < 1")
              .c_str());
  }
  auto mesh = init_device_mesh<Mesh>(world, rep, dp, tp);
  if (world.rank() == 0) {
    std::printf("training %d blocks (hidden %lld, ffn %lld, vocab %lld, %lld tokens a step, %s on %s) for %d "
                "steps, layout %s on (rep=%d, dp=%d, tp=%d) over %s, AdamW, clip at %.1f\n",
                kBlocks, (long long)sizes.hidden, (long long)sizes.ffn, (long long)sizes.vocab,
                (long long)sizes.tokens, dtype.c_str(), device.to_string().c_str(), opt.steps, chosen->name,
                rep, dp, tp, std::string(world.backend_name()).c_str(), kMaxNorm);
  }
  return dtype == "float" ? train_main<float>(world, mesh, opt) : train_main<double>(world, mesh, opt);
}
