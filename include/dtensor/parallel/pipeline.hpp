#pragma once
// Pipeline parallelism: stages on a `pp` group, micro-batches run by a GPipe or a 1F1B schedule, every
// exchange between neighbouring stages posted with batch_isend_irecv.
//
//   PipelineStage<float> stage;
//   stage.forward = [&](int mb, const Tensor<float, 2>& in) { ... return out; };      // in: empty on stage 0
//   stage.backward = [&](int mb, const Tensor<float, 2>& dout) { ... return din; };   // dout: empty on the
//   last stage.input_shape = {rows, hidden};  stage.output_shape = {rows, hidden}; PipelineStats s =
//   run_pipeline(pp_group, stage, /*microbatches=*/8, Schedule::one_f_one_b);
//
// The stage keeps what its backward needs per micro-batch (by `mb`); the last stage's backward computes
// its own loss gradient (dout is empty there), the first stage's returns an empty tensor or its input's
// gradient. 1F1B (Megatron / torch's Schedule1F1B): stage s runs min(p - s - 1, m) warm-up forwards, then
// alternates one forward and one backward, then the remaining backwards; after a forward in the steady
// state it sends its activation and receives the next gradient in one batch_isend_irecv, after a backward
// it sends its gradient and receives the next activation in one. No stage waits on a send whose peer
// is itself waiting on a send, for any number of stages and micro-batches, because every pair of
// neighbours posts the matching send and receive in the same batch. GPipe runs all forwards, then all
// backwards in reverse. `blocking_pairs` (for tests) replaces each batch with a blocking send followed by a
// blocking receive: that ordering deadlocks, which the timeout of the group turns into an error.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "dtensor/comm/p2p.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/parallel/pipeline_schedule.hpp"

namespace dtensor {

template <class T>
struct PipelineStage {
  std::function<Tensor<T, 2>(int microbatch, const Tensor<T, 2>& input)> forward;
  std::function<Tensor<T, 2>(int microbatch, const Tensor<T, 2>& output_grad)> backward;
  std::array<std::int64_t, 2> input_shape{};  ///< of the activation received from the previous stage
  std::array<std::int64_t, 2> output_shape{}; ///< of the activation sent to the next stage
  Device device = Device::cpu();
};

/// Where a stage's time went in one run_pipeline.
struct PipelineStats {
  double total_s = 0;   ///< wall time of the schedule on this stage
  double compute_s = 0; ///< in forward and backward
  int forwards = 0;
  int backwards = 0;
  /// The fraction of the time not computing (waiting on neighbours: the bubble, plus transfer time).
  double idle_fraction() const { return total_s > 0 ? 1.0 - compute_s / total_s : 0.0; }
};

struct PipelineOptions {
  Schedule schedule = Schedule::one_f_one_b;
  bool blocking_pairs = false; ///< tests only: send, then receive, each blocking (deadlocks)
};

namespace detail {

template <class T>
class PipelineRun {
public:
  PipelineRun(const ProcessGroup& pp, PipelineStage<T>& stage, PipelineOptions o)
      : pp_(pp), stage_(stage), o_(o), s_(pp.rank()), p_(pp.size()) {}

  PipelineStats run(int m) {
    DTENSOR_CHECK(m >= 1, "run_pipeline: need at least one micro-batch, got " + std::to_string(m));
    DTENSOR_CHECK(o_.schedule != Schedule::interleaved_one_f_one_b,
                  "run_pipeline: a PipelineStage is one stage per rank; interleaved 1F1B runs several chunks "
                  "per rank (pipeline_order gives its order)");
    const auto t0 = std::chrono::steady_clock::now();
    if (o_.schedule == Schedule::gpipe) {
      for (int i = 0; i < m; ++i) {
        send_forward(forward(i, recv_forward()));
      }
      for (int i = m - 1; i >= 0; --i) {
        send_backward(backward(i, recv_backward()));
      }
    } else {
      const int warmup = std::min(p_ - s_ - 1, m);
      const int steady = m - warmup;
      int f = 0; // next forward
      int b = 0; // next backward
      for (int i = 0; i < warmup; ++i) {
        send_forward(forward(f++, recv_forward()));
      }
      Tensor<T, 2> input = steady > 0 ? recv_forward() : Tensor<T, 2>{};
      for (int i = 0; i < steady; ++i) {
        const Tensor<T, 2> out = forward(f++, input);
        const Tensor<T, 2> grad = send_forward_recv_backward(out);
        const Tensor<T, 2> din = backward(b++, grad);
        if (i == steady - 1) {
          send_backward(din);
        } else {
          input = send_backward_recv_forward(din);
        }
      }
      for (int i = 0; i < warmup; ++i) {
        send_backward(backward(b++, recv_backward()));
      }
    }
    stats_.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return stats_;
  }

private:
  bool first() const { return s_ == 0; }
  bool last() const { return s_ == p_ - 1; }

  Tensor<T, 2> forward(int mb, const Tensor<T, 2>& in) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor<T, 2> out = stage_.forward(mb, in);
    stats_.compute_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++stats_.forwards;
    return out;
  }
  Tensor<T, 2> backward(int mb, const Tensor<T, 2>& grad) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor<T, 2> din = stage_.backward(mb, grad);
    stats_.compute_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++stats_.backwards;
    return din;
  }

  Tensor<T, 2> recv_forward() {
    if (first()) {
      return {};
    }
    Tensor<T, 2> in(stage_.input_shape, stage_.device);
    exchange({}, {P2POp(P2POp::irecv, in, s_ - 1, pp_, kForward)});
    return in;
  }
  Tensor<T, 2> recv_backward() {
    if (last()) {
      return {};
    }
    Tensor<T, 2> g(stage_.output_shape, stage_.device);
    exchange({}, {P2POp(P2POp::irecv, g, s_ + 1, pp_, kBackward)});
    return g;
  }
  void send_forward(const Tensor<T, 2>& out) {
    if (!last()) {
      check(out, stage_.output_shape, "output");
      exchange({P2POp(P2POp::isend, out, s_ + 1, pp_, kForward)}, {});
    }
  }
  void send_backward(const Tensor<T, 2>& din) {
    if (!first()) {
      check(din, stage_.input_shape, "input gradient");
      exchange({P2POp(P2POp::isend, din, s_ - 1, pp_, kBackward)}, {});
    }
  }
  /// The activation to the next stage and the gradient from it, in one batch.
  Tensor<T, 2> send_forward_recv_backward(const Tensor<T, 2>& out) {
    if (last()) {
      return {};
    }
    check(out, stage_.output_shape, "output");
    Tensor<T, 2> g(stage_.output_shape, stage_.device);
    exchange({P2POp(P2POp::isend, out, s_ + 1, pp_, kForward)},
             {P2POp(P2POp::irecv, g, s_ + 1, pp_, kBackward)});
    return g;
  }
  /// The gradient to the previous stage and the next activation from it, in one batch.
  Tensor<T, 2> send_backward_recv_forward(const Tensor<T, 2>& din) {
    if (first()) {
      return {};
    }
    check(din, stage_.input_shape, "input gradient");
    Tensor<T, 2> in(stage_.input_shape, stage_.device);
    exchange({P2POp(P2POp::isend, din, s_ - 1, pp_, kBackward)},
             {P2POp(P2POp::irecv, in, s_ - 1, pp_, kForward)});
    return in;
  }

  void exchange(std::vector<P2POp> sends, std::vector<P2POp> recvs) {
    if (o_.blocking_pairs) {
      for (const P2POp& op : sends) {
        batch_isend_irecv(std::vector<P2POp>{op}).front().wait();
      }
      for (const P2POp& op : recvs) {
        batch_isend_irecv(std::vector<P2POp>{op}).front().wait();
      }
      return;
    }
    std::vector<P2POp> ops = std::move(sends);
    ops.insert(ops.end(), recvs.begin(), recvs.end());
    for (Work& w : batch_isend_irecv(ops)) {
      w.wait();
    }
  }

  void check(const Tensor<T, 2>& t, const std::array<std::int64_t, 2>& shape, const char* what) const {
    DTENSOR_CHECK(t.shape() == shape, "run_pipeline: stage " + std::to_string(s_) + "'s " + what +
                                          " has shape " + shape_to_string(t.shape()) +
                                          ", the stage declared " + shape_to_string(shape));
  }

  static constexpr int kForward = 1;
  static constexpr int kBackward = 2;
  ProcessGroup pp_;
  PipelineStage<T>& stage_;
  PipelineOptions o_;
  int s_;
  int p_;
  PipelineStats stats_;
};

} // namespace detail

/// Runs `microbatches` forward and backward passes of this rank's stage (rank s of `pp` is stage s) with the
/// schedule of `options` (see the top of this file).
template <class T>
PipelineStats run_pipeline(const ProcessGroup& pp, PipelineStage<T>& stage, int microbatches,
                           PipelineOptions options = {}) {
  return detail::PipelineRun<T>(pp, stage, options).run(microbatches);
}

} // namespace dtensor
