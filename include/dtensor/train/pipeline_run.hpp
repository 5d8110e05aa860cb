#pragma once
// A pipeline of DTensor stages: each rank of a pp group runs one or more chunks (model stages) on its stage's
// sub-mesh, and what crosses a boundary is a DTensor of any rank with its placements, sent shard by shard
// to the rank of the same sub-mesh coordinate on the next stage. The order is pipeline_order's (GPipe, 1F1B,
// interleaved 1F1B, ZB-H1, ZB-V: train/pipeline_schedule.hpp; the zero-bubble ones call weight(chunk, mb),
// the W of a split backward, where their order says).
//
//   using Mesh = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
//   const auto stage_mesh = mesh.slice<"dp", "tp">();           // this stage's (dp, tp) sub-mesh
//   using Act = nn::act_t<L, float>;                            // L's mesh is (dp, tp)
//   PipelineChunks<Act> chunks;
//   // in: none on model stage 0; dout: none on the last model stage (its own loss starts its backward)
//   chunks.forward = [&](int chunk, int mb, std::optional<Act> in) -> Act { ... };
//   chunks.backward = [&](int chunk, int mb, std::optional<Act> dout) -> std::optional<Act> { ... };
//   run_pipeline(mesh.group<"pp">(), stage_mesh, chunks, {.schedule = Schedule::interleaved_one_f_one_b,
//                .shape = {.stages = 2, .microbatches = 4, .chunks = 2}});
//
// Chunk c of pp rank s is model stage c p + s (under ZB-V: s, then 2p - 1 - s). The forward of the last model stage returns its output (not
// sent; its backward starts from its own loss: dout is empty there); the backward of model stage 0 returns
// nothing to send. A chunk keeps what its backward needs per micro-batch. Activations may have another
// global shape in every micro-batch: each send is a header (the micro-batch, the sending model stage, the
// global and the local shape) and the shard; the receiver checks the header against what its order expects
// and the local shape against the shard its coordinate gets of that global shape, and throws an Error
// naming the stage, the micro-batch and both shapes. Sends are asynchronous and waited for at the end;
// on host tensors every header is received ahead (posted at the start in the order needed); the shards
// are received where the order needs them, so the run waits exactly where the schedule's timeline does
// (simulate_pipeline: no order waits on itself). A chunk whose neighbour is on the same rank (one pp rank,
// several chunks) hands its tensor over in memory.
//
// Errors stop every stage, with the cause (host tensors). Each link (a peer rank and a direction) ends a
// run with one more header, "done", sent once everything to and from that peer is sent and checked, and
// each rank receives it ahead with the others, so until a peer has nothing left to refuse a rank has a
// header receive posted on every link it receives on from it. A rank that stops (it refused a shard, a chunk
// threw, or a peer told it to stop) sends an abort header instead on every link it sends on, naming the
// kind, the model stage that found it, the micro-batch and, for a refused shard, the global shape and the
// shard its placements give (a refused shard is received first, so its send completes); the peer's next
// header on that link is the abort, and it stops with that message and passes it on. So the stage that
// sent a shard of the wrong shape reports it too, even after its last send (the done header of that link
// is the one that comes back as an abort), and no rank waits out its timeout: after telling its peers, a
// rank that stops aborts the pp group, so what is still pending on it fails at once (a peer receiving a
// shard from it then fails with its reason, which the group passes on). What the done headers cost:
// one small message per link a step, and a rank's run ends when its neighbours have checked what it sent.
// On CUDA (NCCL), where receives are not posted ahead, the receiving stage reports a mismatch alone.
//
// A dry run (a pp group on the fake backend, backends/fake/backend.hpp: this process plays one stage alone)
// has no neighbour to send headers: a header receive there is left as it was, so each is filled first with
// what this rank expects, its global shape from PipelineRunOptions::boundary_shape (nn::PipelineTrainer
// gives (micro-batch, sequence, hidden)). The shards it receives are zeros.
//
// FSDP inside a stage (nn::PipelineTrainer, train/pipeline_trainer.hpp): each chunk's
// FlatParamGroups are gathered once per step and kept for all its micro-batches; the gradients of the first m
// - 1 backwards accumulate unsharded (accumulate_gradients) and the chunk's last backward reduce_scatters the
// sum (reduce_gradients). Gathering per micro-batch instead would repeat the all_gather and the
// reduce_scatter m times a step for the memory of one chunk's unsharded parameters, which a pipeline stage
// (a fraction of the model) can hold; torchtitan makes the same choice for pipelined FSDP.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "dtensor/comm/p2p.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/flop_counter.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/tensor/dtensor.hpp"
#include "dtensor/train/pipeline_schedule.hpp"

namespace dtensor {

/// The chunks (model stages) of one pp rank (see the top of this file).
template <class Act>
struct PipelineChunks {
  std::function<Act(int chunk, int microbatch, std::optional<Act> input)> forward;
  std::function<std::optional<Act>(int chunk, int microbatch, std::optional<Act> output_grad)> backward;
  /// Under ZB-H1 and ZB-V (splits_backward): backward is B (the input's gradient) and weight W, the
  /// parameters' gradients of the same chunk and micro-batch, run later; nothing crosses a boundary.
  std::function<void(int chunk, int microbatch)> weight{};
};

struct PipelineRunOptions {
  Schedule schedule = Schedule::one_f_one_b;
  PipelineShape shape{};         ///< stages must be the pp group's size
  Device device = Device::cpu(); ///< where the received tensors are made (the chunks' device)
  /// Forwards only (evaluation): micro-batch by micro-batch, each rank's chunks in order; backward is
  /// never called and may be empty.
  bool forward_only = false;
  /// The global shape of what crosses a boundary in micro-batch `mb` (activation and gradient alike). Used
  /// only in a dry run (a pp group on the fake backend), where no neighbour sends it; required there.
  std::function<std::vector<std::int64_t>(int mb)> boundary_shape{};
};

/// What a run did on this rank: the steps in the order run, the time in them and in total.
struct PipelineRunStats {
  std::vector<PipelineAction> order;
  double total_s = 0;
  double compute_s = 0;
  /// Per chunk, the flops (FlopCounter's) of its forwards and of its backwards over every micro-batch: a
  /// dry run's stage costs for simulate_pipeline.
  std::vector<double> forward_flops, backward_flops;
  std::vector<double> weight_flops; ///< per chunk, the W's under a splitting schedule (B's in backward_flops)
  double idle_fraction() const { return total_s > 0 ? 1.0 - compute_s / total_s : 0.0; }
};

namespace detail {

template <class Act>
class TypedPipelineRun {
  static constexpr int R = Act::rank;
  static constexpr std::int64_t kMagic = 0x70697065; // "pipe"
  // magic, kind, micro-batch, stage, then three shapes: a shard's global and local shape (the third
  // unused), or an abort's global shape, the shard the refusing stage expected and the one it got
  static constexpr int kHeader = 4 + 3 * R;

public:
  TypedPipelineRun(const ProcessGroup& pp, const typename Act::mesh_type& stage_mesh,
                   PipelineChunks<Act>& chunks, const PipelineRunOptions& o)
      : pp_(pp), mesh_(stage_mesh), chunks_(chunks), o_(o), s_(pp.rank()), p_(pp.size()),
        stages_(o.shape.stages * o.shape.chunks), guarded_(!o.device.is_cuda()), dry_(pp.dry_run()) {
    DTENSOR_CHECK(!splits_backward(o.schedule) || o.forward_only || chunks.weight,
                  std::string("run_pipeline: ") + schedule_name(o.schedule) +
                      " runs each backward as B and W apart: PipelineChunks needs weight as well");
    DTENSOR_CHECK(o.shape.stages == p_, "run_pipeline: the shape names " + std::to_string(o.shape.stages) +
                                            " stages, the pp group has " + std::to_string(p_) + " ranks");
    DTENSOR_CHECK(chunks.forward && (chunks.backward || o.forward_only),
                  "run_pipeline: PipelineChunks needs forward and backward");
    DTENSOR_CHECK(
        !dry_ || o.boundary_shape,
        "run_pipeline: a dry run (the pp group is on the fake backend) has no neighbour to send the "
        "shapes that cross a boundary: set PipelineRunOptions::boundary_shape");
  }

  PipelineRunStats run() {
    PipelineRunStats st;
    st.forward_flops.assign(std::size_t(o_.shape.chunks), 0.0);
    st.backward_flops.assign(std::size_t(o_.shape.chunks), 0.0);
    st.weight_flops.assign(std::size_t(o_.shape.chunks), 0.0);
    if (o_.forward_only) {
      for (int mb = 0; mb < o_.shape.microbatches; ++mb) {
        for (int c = 0; c < o_.shape.chunks; ++c) {
          st.order.push_back({PipelineAction::Kind::forward, mb, c});
        }
      }
    } else {
      st.order = pipeline_order(o_.schedule, o_.shape, s_);
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (guarded_) {
      post_headers(st.order);
    }
    PipelineAction at{};
    try {
      for (const PipelineAction& a : st.order) {
        at = a;
        step(a, st);
      }
      if (guarded_) {
        finish_links();
      }
      for (Work& w : pending_) {
        w.wait();
      }
    } catch (const std::exception& e) {
      stop(at, e.what());
      throw;
    } catch (...) {
      stop(at, "a chunk threw");
      throw;
    }
    pending_.clear();
    headers_.clear();
    st.total_s = seconds_since(t0);
    return st;
  }

private:
  // A header's kind: an activation or a gradient follows; the last message of a link; or why the sender
  // stopped (a refused activation or gradient, a chunk's forward or backward that threw).
  static constexpr int kForward = 0;
  static constexpr int kBackward = 1;
  static constexpr int kDone = 2;
  static constexpr int kRefusedActivation = 3;
  static constexpr int kRefusedGradient = 4;
  static constexpr int kFailedForward = 5;
  static constexpr int kFailedBackward = 6;

  /// Why a run stopped, as the abort header carries it: the kind, the micro-batch, the model stage that
  /// found it, and for a refused shard the global shape, the local shape that stage expected and the one
  /// it got.
  struct Abort {
    int kind = 0, mb = 0, stage = 0;
    std::array<std::int64_t, R> global{}, expected{}, sent{};

    static Abort parse(const std::int64_t* h) {
      Abort a{int(h[1]), int(h[2]), int(h[3])};
      for (std::size_t d = 0; d < std::size_t(R); ++d) {
        a.global[d] = h[4 + d];
        a.expected[d] = h[4 + R + d];
        a.sent[d] = h[4 + 2 * R + d];
      }
      return a;
    }
  };

  void step(const PipelineAction& a, PipelineRunStats& st) {
    const int g = stage_of(a.chunk);
    if (a.kind == PipelineAction::Kind::weight) { // W: local, nothing to send or receive
      const auto c0 = std::chrono::steady_clock::now();
      const double f0 = FlopCounter::clock();
      chunks_.weight(a.chunk, a.microbatch);
      st.compute_s += seconds_since(c0);
      st.weight_flops[std::size_t(a.chunk)] += FlopCounter::clock() - f0;
      return;
    }
    if (a.kind == PipelineAction::Kind::forward) {
      std::optional<Act> in;
      if (g > 0) {
        in = receive(kForward, a.microbatch, g - 1, g);
      }
      const auto c0 = std::chrono::steady_clock::now();
      const double f0 = FlopCounter::clock();
      Act out = chunks_.forward(a.chunk, a.microbatch, std::move(in));
      st.compute_s += seconds_since(c0);
      st.forward_flops[std::size_t(a.chunk)] += FlopCounter::clock() - f0;
      if (g + 1 < stages_) {
        send(kForward, a.microbatch, g, g + 1, out);
      }
      return;
    }
    std::optional<Act> dout;
    if (g + 1 < stages_) {
      dout = receive(kBackward, a.microbatch, g + 1, g);
    }
    const auto c0 = std::chrono::steady_clock::now();
    const double f0 = FlopCounter::clock();
    std::optional<Act> din = chunks_.backward(a.chunk, a.microbatch, std::move(dout));
    st.compute_s += seconds_since(c0);
    st.backward_flops[std::size_t(a.chunk)] += FlopCounter::clock() - f0;
    if (g > 0) {
      DTENSOR_CHECK(din.has_value(), "run_pipeline: the backward of model stage " + std::to_string(g) +
                                         " (micro-batch " + std::to_string(a.microbatch) +
                                         ") returned no input gradient to send to stage " +
                                         std::to_string(g - 1));
      send(kBackward, a.microbatch, g, g - 1, *din);
    }
  }

  /// The message of abort `a` received on stage `here`.
  std::string abort_message(const Abort& a, int here) const {
    const int kind = a.kind, mb = a.mb, stage = a.stage;
    const std::string who =
        "run_pipeline: stage " + std::to_string(here) + " (pp rank " + std::to_string(s_) + ") stopped: ";
    const std::string where =
        "stage " + std::to_string(stage) + " (pp rank " + std::to_string(rank_of(stage)) + ")";
    if (kind == kFailedForward || kind == kFailedBackward) {
      return who + where + " failed in its " + (kind == kFailedForward ? "forward" : "backward") +
             " of micro-batch " + std::to_string(mb);
    }
    if (kind != kRefusedActivation && kind != kRefusedGradient) {
      return who + "pp rank " + std::to_string(rank_of(stage)) + " sent a header of kind " +
             std::to_string(kind) + " (the stages run different versions)";
    }
    const bool activation = kind == kRefusedActivation;
    const int from = activation ? stage - 1 : stage + 1;
    const std::string sender =
        rank_of(from) == s_ ? "this rank's" : "pp rank " + std::to_string(rank_of(from)) + "'s";
    return who + where + " refused the " + (activation ? "activation" : "gradient") + " of micro-batch " +
           std::to_string(mb) + " from stage " + std::to_string(from) + ": global shape " +
           shape_to_string(a.global) + " as " + sender + " shard of " + shape_to_string(a.sent) +
           ", where its placements give its coordinate a shard of " + shape_to_string(a.expected) +
           " (the stages' sub-meshes or placements differ)";
  }

  /// Host tensors: the links (peer, kind) this rank sends on and receives on, from the order.
  void links(const std::vector<PipelineAction>& order) {
    for (const PipelineAction& a : order) {
      if (a.kind == PipelineAction::Kind::weight) {
        continue;
      }
      const int g = stage_of(a.chunk);
      const bool forward = a.kind == PipelineAction::Kind::forward;
      const int to = forward ? g + 1 : g - 1, from = forward ? g - 1 : g + 1;
      const int kind = forward ? kForward : kBackward;
      if (to >= 0 && to < stages_ && rank_of(to) != s_) {
        send_links_.insert({rank_of(to), kind});
        ++traffic_[rank_of(to)];
      }
      if (from >= 0 && from < stages_ && rank_of(from) != s_) {
        recv_links_.insert({rank_of(from), kind});
        ++traffic_[rank_of(from)];
      }
    }
  }

  /// One message to or from `peer` sent or received (checked): once all are, the done headers of the
  /// links to it go out. Not before: a peer whose shard this rank still may refuse must find a header
  /// receive posted for the abort. Not later either: a peer's run ends when it has its done headers, and
  /// waiting for this rank's whole run would chain every stage's end to stage 0's.
  void count_message(int peer) {
    if (!guarded_ || --traffic_[peer] > 0) {
      return;
    }
    for (const auto& [to, kind] : send_links_) {
      if (to == peer) {
        pending_.push_back(isend(header_of(kDone, 0, 0), peer, pp_, tag(kind, 0)));
      }
    }
  }

  /// The end of a run on host tensors: the peers' done headers waited for (count_message sent this rank's),
  /// so a peer that refused the last shard this rank sent it still reaches it.
  void finish_links() {
    for (auto& [link, posted] : done_) {
      posted.second.wait();
      const std::int64_t* h = posted.first.data();
      if (h[0] != kMagic || h[1] != kDone) {
        take_abort(h);
        DTENSOR_CHECK(h[0] == kMagic && h[1] != kForward && h[1] != kBackward,
                      "run_pipeline: pp rank " + std::to_string(s_) + ": pp rank " +
                          std::to_string(link.first) +
                          " sent more than its order gives (the stages run different schedules or shapes)");
        throw Error(abort_message(*abort_, s_));
      }
    }
    done_.clear();
  }

  /// An abort header received: kept, so that this rank's neighbours learn the same cause.
  void take_abort(const std::int64_t* h) {
    if (h[0] == kMagic && h[1] >= kRefusedActivation) {
      abort_ = Abort::parse(h);
    }
  }

  /// On host tensors, after an error at action `at`: the neighbours are told why (notify), then the pp group
  /// is aborted, so the transfers still pending on it (headers received ahead, shards sent) fail at once
  /// instead of at the group's timeout, here and on the peers.
  void stop(const PipelineAction& at, const std::string& why) {
    if (!guarded_ || notified_) {
      return;
    }
    if (!abort_) {
      abort_ = Abort{at.kind == PipelineAction::Kind::forward ? kFailedForward : kFailedBackward,
                     at.microbatch, stage_of(at.chunk)};
    }
    notify();
    pp_.abort("run_pipeline stopped on pp rank " + std::to_string(s_) + ": " + why);
  }

  /// Tells every peer this rank sends to why it stops (one abort header per link, which the peer's next
  /// header receive on it gets), waiting at most the group's timeout for the headers to leave.
  void notify() {
    notified_ = true;
    std::vector<Work> works;
    for (const auto& [peer, kind] : send_links_) {
      const Tensor<std::int64_t, 1> h = header_of(abort_->kind, abort_->mb, abort_->stage,
                                                  {abort_->global, abort_->expected, abort_->sent});
      try {
        works.push_back(isend(h, peer, pp_, tag(kind, 0)));
      } catch (...) { // a peer or the group gone: nothing to tell
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + pp_.timeout();
    for (Work& w : works) {
      while (!w.is_completed() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
  }

  /// A header on the host: the kind, the micro-batch, the stage and up to three shapes (zeros after).
  static Tensor<std::int64_t, 1> header_of(int kind, int mb, int stage,
                                           std::initializer_list<std::array<std::int64_t, R>> shapes = {}) {
    Tensor<std::int64_t, 1> header = Tensor<std::int64_t, 1>::zeros({kHeader});
    std::int64_t* h = header.data();
    h[0] = kMagic;
    h[1] = kind;
    h[2] = mb;
    h[3] = stage;
    int at = 4;
    for (const auto& shape : shapes) {
      for (std::int64_t e : shape) {
        h[at++] = e;
      }
    }
    return header;
  }

  /// A dry run's header of `kind` for micro-batch `mb` from model stage `from`, as the neighbour would send
  /// it: the global shape from PipelineRunOptions::boundary_shape, the shard this coordinate gets of it.
  Tensor<std::int64_t, 1> expected_header(int kind, int mb, int from) const {
    const std::vector<std::int64_t> shape = o_.boundary_shape(mb);
    DTENSOR_CHECK(shape.size() == std::size_t(R), "run_pipeline: boundary_shape(" + std::to_string(mb) +
                                                      ") has " + std::to_string(shape.size()) +
                                                      " dims; what crosses a boundary has " +
                                                      std::to_string(R));
    std::array<std::int64_t, R> global{};
    std::copy(shape.begin(), shape.end(), global.begin());
    const Block mine = spec_block(detail::to_extents(global), Act::spec, mesh_.sizes(), mesh_.coordinate());
    return header_of(kind, mb, from, {global, detail::to_array<R>(mine.shape)});
  }

  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  /// The pp rank of model stage `stage`, and the model stage of this rank's chunk `chunk`
  /// (pipeline_stage: Megatron's interleaving, or ZB-V's V).
  int rank_of(int stage) const { return pipeline_rank(o_.schedule, p_, stage); }
  int stage_of(int chunk) const { return pipeline_stage(o_.schedule, p_, s_, chunk); }
  int tag(int kind, int part) const { return 1 + 2 * kind + part; }

  /// Host tensors: every header this rank will receive, posted at once in the order it will need them (a
  /// peer's headers on one tag arrive in the order sent, which is the schedule's), so a receive waits for
  /// its shard only. Not on CUDA: NCCL would queue the receives ahead of this rank's sends on one stream.
  void post_headers(const std::vector<PipelineAction>& order) {
    for (const PipelineAction& a : order) {
      if (a.kind == PipelineAction::Kind::weight) {
        continue;
      }
      const int g = stage_of(a.chunk);
      const bool forward = a.kind == PipelineAction::Kind::forward;
      const int from = forward ? g - 1 : g + 1;
      if (from < 0 || from >= stages_ || rank_of(from) == s_) {
        continue;
      }
      const int kind = forward ? kForward : kBackward;
      Tensor<std::int64_t, 1> header =
          dry_ ? expected_header(kind, a.microbatch, from) : Tensor<std::int64_t, 1>({kHeader});
      Work w = irecv(header, rank_of(from), pp_, tag(kind, 0));
      headers_.emplace(std::tuple{kind, a.microbatch, g}, std::pair{header, std::move(w)});
    }
    links(order);
    for (const auto& link : recv_links_) { // each link's last header: done, or why the peer stopped
      Tensor<std::int64_t, 1> header = dry_ ? header_of(kDone, 0, 0) : Tensor<std::int64_t, 1>({kHeader});
      Work w = irecv(header, link.first, pp_, tag(link.second, 0));
      done_.emplace(link, std::pair{header, std::move(w)});
    }
  }

  void send(int kind, int mb, int from, int to, const Act& t) {
    const int peer = rank_of(to);
    if (peer == s_) {
      local_.insert_or_assign(std::tuple{kind, mb, to}, t);
      return;
    }
    std::array<std::int64_t, R> global{}, local{};
    for (std::size_t d = 0; d < std::size_t(R); ++d) {
      global[d] = t.global_shape()[d];
      local[d] = t.local().shape()[d];
    }
    const Tensor<std::int64_t, 1> header = header_of(kind, mb, from, {global, local});
    const auto dev = t.local().device();
    pending_.push_back(isend(dev.is_cuda() ? header.to(dev) : header, peer, pp_, tag(kind, 0)));
    pending_.push_back(isend(t.local().contiguous(), peer, pp_, tag(kind, 1)));
    count_message(peer);
  }

  Act receive(int kind, int mb, int from, int to) {
    const int peer = rank_of(from);
    const char* what = kind == kForward ? "activation" : "gradient";
    if (peer == s_) {
      const auto it = local_.find({kind, mb, to});
      DTENSOR_CHECK(it != local_.end(), "run_pipeline: stage " + std::to_string(to) + " found no " + what +
                                            " of micro-batch " + std::to_string(mb) + " from stage " +
                                            std::to_string(from) + " on its own rank");
      Act t = std::move(it->second);
      local_.erase(it);
      return t;
    }
    const Device dev = o_.device;
    Tensor<std::int64_t, 1> host;
    if (const auto posted = headers_.find({kind, mb, to}); posted != headers_.end()) {
      posted->second.second.wait();
      host = posted->second.first;
      headers_.erase(posted);
    } else {
      Tensor<std::int64_t, 1> wire =
          dev.is_cuda() ? Tensor<std::int64_t, 1>({kHeader}, dev) : Tensor<std::int64_t, 1>({kHeader});
      recv(wire, peer, pp_, tag(kind, 0));
      host = dev.is_cuda() ? wire.to(Device::cpu()) : wire;
    }
    const std::int64_t* h = host.data();
    const std::string at = "run_pipeline: stage " + std::to_string(to) + " (pp rank " + std::to_string(s_) +
                           "), micro-batch " + std::to_string(mb) + ", the " + what + " from stage " +
                           std::to_string(from);
    if (h[0] == kMagic && h[1] >= kRefusedActivation) { // the peer stopped: stop with its cause
      take_abort(h);
      throw Error(abort_message(*abort_, to));
    }
    if (!(h[0] == kMagic && h[1] == kind && h[2] == mb && h[3] == from)) {
      abort_ = Abort{kind == kForward ? kRefusedActivation : kRefusedGradient, mb, to};
      throw Error(at + ": received the header of " +
                  (h[1] == kForward    ? "an activation"
                   : h[1] == kBackward ? "a gradient"
                                       : "the end of the run") +
                  " of micro-batch " + std::to_string(h[2]) + " from stage " + std::to_string(h[3]) +
                  " (the stages run different schedules or shapes)");
    }
    typename Act::shape_type global{};
    std::array<std::int64_t, R> theirs{};
    for (int d = 0; d < R; ++d) {
      global[static_cast<std::size_t>(d)] = h[4 + d];
      theirs[static_cast<std::size_t>(d)] = h[4 + R + d];
    }
    const Block mine = spec_block(detail::to_extents(global), Act::spec, mesh_.sizes(), mesh_.coordinate());
    const auto local_shape = detail::to_array<R>(mine.shape);
    if (local_shape != theirs) {
      abort_ = Abort{kind == kForward ? kRefusedActivation : kRefusedGradient, mb, to};
      for (std::size_t d = 0; d < std::size_t(R); ++d) {
        abort_->global[d] = global[d];
      }
      abort_->expected = local_shape;
      abort_->sent = theirs;
      if (guarded_) { // the shard is taken, so that the sender's send completes
        typename Act::local_type drained(theirs, dev);
        recv(drained, peer, pp_, tag(kind, 1));
      }
      throw Error(at + ": global shape " + shape_to_string(global) + " arrives as a shard of " +
                  shape_to_string(theirs) + ", but " + dtensor::to_string(Act::placements) +
                  " gives this rank's coordinate a shard of " + shape_to_string(local_shape) +
                  " (the stages' sub-meshes or placements differ)");
    }
    typename Act::local_type local(local_shape, dev);
    if (dry_) {
      local.fill({}); // what the fake leaves in a receive with no sender
    }
    recv(local, peer, pp_, tag(kind, 1));
    count_message(peer);
    return Act(mesh_, std::move(local), global);
  }

  ProcessGroup pp_;
  typename Act::mesh_type mesh_;
  PipelineChunks<Act>& chunks_;
  PipelineRunOptions o_;
  int s_, p_, stages_;
  std::vector<Work> pending_;
  bool guarded_; ///< host (or meta) tensors: headers received ahead, done and abort headers on every link
  bool dry_;     ///< a dry run: the pp group is on the fake backend (see the top of this file)
  bool notified_ = false;
  std::optional<Abort> abort_;
  std::set<std::pair<int, int>> send_links_, recv_links_; ///< (peer, kind)
  std::map<int, int> traffic_; ///< peer -> messages still to send it or receive from it this run
  /// Each received link's last header (done, or an abort): (peer, kind) -> the header and its receive.
  std::map<std::pair<int, int>, std::pair<Tensor<std::int64_t, 1>, Work>> done_;
  std::map<std::tuple<int, int, int>, Act> local_; ///< (kind, micro-batch, to stage) -> tensor
  /// Posted headers: (kind, micro-batch, to stage) -> the header and its receive.
  std::map<std::tuple<int, int, int>, std::pair<Tensor<std::int64_t, 1>, Work>> headers_;
};

} // namespace detail

/// Runs the forwards and backwards of this rank's chunks in `options`' schedule (see the top of this file):
/// `pp` is the pipeline group (rank s holds chunks c of model stages c p + s), `stage_mesh` the sub-mesh
/// the chunks' DTensors live on.
template <class Act>
PipelineRunStats run_pipeline(const ProcessGroup& pp, const typename Act::mesh_type& stage_mesh,
                              PipelineChunks<Act>& chunks, const PipelineRunOptions& options) {
  return detail::TypedPipelineRun<Act>(pp, stage_mesh, chunks, options).run();
}

} // namespace dtensor
