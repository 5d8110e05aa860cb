#pragma once
// The FSDP schedule: when each flat group's all_gather is issued and waited for, when its gathered buffer is
// dropped, and when its gradients' reduce_scatter is issued and waited for, over an ordered list of groups.
// FlatParamGroup (train/fsdp.hpp) is the mechanism, this is the schedule (FSDP2 splits the same way:
// _fsdp_param_group and _fsdp_state).
//
//   FsdpSchedule sched({.prefetch = 1, .reshard_after_forward = true, .max_reductions = 2});
//   sched.add(emb);                         // the groups, in the order of the forward
//   for (auto& b : blocks) sched.add(b);
//   sched.add(head);
//
//   Act h = sched.forward(emb, [&](const auto& w) { return embed(ids, w); });
//   for (auto& b : blocks) h = sched.forward(b, [&](const auto& g, const auto& w1, const auto& w2) { ... });
//   sched.backward(head, [&](const auto& g, const auto& w) {        // forward and backward of the head
//     ...; dh = ...; return std::tuple{dg, dw};                     // the group's gradients, in order
//   });
//   for (b = last .. first) {
//     sched.backward(blocks[b], [&](const auto&... w) { ...; return std::tuple{...}; });
//   }
//   sched.backward(emb, ...);
//   sched.finish();                         // every reduction done: clip_grad_norm(groups...), opt.step
//
// forward(g, f): issues g's all_gather unless it is gathered or in flight, issues the next `prefetch`
// groups' (forward order) so that they are in flight while g computes, waits for g's, calls f(params...)
// and returns what f returns; with reshard_after_forward it then drops g's gathered buffer, except for the
// last group, whose backward follows at once (FSDP2 does the same for the root).
// backward(g, f): the same with the `prefetch` groups before g (reverse order); a group resharded after its
// forward is gathered again here, and f recomputes what it needs from the saved input (the parameters are
// views into the gathered buffer: the op contexts are built from them). f returns the gradients of g's
// parameters as a tuple, in the group's order; they are reduce-scattered asynchronously (reduce_gradients):
// before a reduction is issued, the oldest ones in flight are waited for until fewer than max_reductions
// are (each holds its group's unsharded gradient buffer, so the cap bounds that memory). Then g is
// resharded. finish() waits for every reduction still in flight.
//
// Options: reshard_after_forward = false keeps every group gathered from its forward to its backward
// (ZeRO-2: the memory of the whole model gathered, one all_gather per group per step instead of two).
// overlap = false waits for each asynchronous collective as soon as it is issued: the same collectives in
// the same order (numerically the same step), which measures the whole time of a step's communication.
// stats() counts the all_gathers and reductions issued and the seconds the calling thread was blocked in
// waits (and in the calls that issue reductions: a gradient Partial over a non-FSDP axis is all-reduced
// there first, blocking).
//
// Gradient accumulation: set_requires_gradient_sync(false) for the first K - 1 micro-batches makes
// backward accumulate each group's gradients unsharded (no reduction), and the last micro-batch's
// backward, with sync back on, reduces the sum once: K micro-batches equal one batch K times larger.
//
// Every rank makes the same calls in the same order, as for any collective. Groups are handles
// (FlatParamGroup copies share their state): the schedule keeps copies, and forward/backward find a group
// by its identity(); a group that was not added is an error naming the call.

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/core/error.hpp"
#include "dtensor/train/fsdp.hpp"

namespace dtensor {

struct FsdpScheduleOptions {
  int prefetch = 1; ///< groups whose all_gather is in flight beside the current one's compute
  bool reshard_after_forward = true; ///< drop the gathered buffer after the forward, gather again in backward
  int max_reductions = 2;            ///< gradient reductions in flight at most (each holds a gradient buffer)
  bool overlap = true;               ///< false: wait for every collective as soon as it is issued
};

/// What one schedule did since it was made or since reset_stats().
struct FsdpScheduleStats {
  double blocked_seconds = 0; ///< time in waits (and in the calls issuing reductions)
  int all_gathers = 0;        ///< unshards issued
  int reductions = 0;         ///< gradient reductions issued
};

class FsdpSchedule {
public:
  FsdpSchedule() = default;
  explicit FsdpSchedule(FsdpScheduleOptions options) : options_(options) {
    DTENSOR_CHECK(options.prefetch >= 0,
                  "FsdpSchedule: prefetch must be >= 0, not " + std::to_string(options.prefetch));
    DTENSOR_CHECK(options.max_reductions >= 1,
                  "FsdpSchedule: max_reductions must be >= 1, not " + std::to_string(options.max_reductions));
  }

  /// Appends a group to the forward order (the schedule keeps a copy of the handle).
  template <class Group>
  void add(Group group) {
    for (const Entry& e : entries_) {
      DTENSOR_CHECK(e.identity != group.identity(), "FsdpSchedule::add: group " +
                                                        std::to_string(&e - entries_.data()) +
                                                        " was added already");
    }
    entries_.push_back({group.identity(), [group]() mutable { return group.unshard(async_op); },
                        [group] { return group.is_unsharded(); }});
  }

  std::size_t size() const noexcept { return entries_.size(); }
  const FsdpScheduleOptions& options() const noexcept { return options_; }
  const FsdpScheduleStats& stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }

  /// Runs group's forward: f(params...) with the group gathered (see the top of the file).
  template <class Group, class F>
  decltype(auto) forward(Group& group, F&& f) {
    const std::size_t i = index_of(group, "forward");
    gather(i);
    for (std::size_t k = 1; k <= static_cast<std::size_t>(options_.prefetch) && i + k < entries_.size();
         ++k) {
      gather(i + k);
    }
    auto params = blocked([&] { return group.params(); });
    const bool reshard = options_.reshard_after_forward && i + 1 < entries_.size();
    if constexpr (std::is_void_v<decltype(std::apply(f, params))>) {
      std::apply(f, params);
      if (reshard) {
        group.reshard();
      }
    } else {
      auto out = std::apply(f, params);
      if (reshard) {
        group.reshard();
      }
      return out;
    }
  }

  /// Runs group's backward: f(params...) returns the gradients of its parameters as a tuple, which are
  /// reduced asynchronously; then the group is resharded (see the top of the file).
  template <class Group, class F>
  void backward(Group& group, F&& f) {
    const std::size_t i = index_of(group, "backward");
    gather(i);
    for (std::size_t k = 1; k <= static_cast<std::size_t>(options_.prefetch) && k <= i; ++k) {
      gather(i - k);
    }
    auto grads = [&] {
      auto params = blocked([&] { return group.params(); });
      return std::apply(f, params);
    }();
    if (!sync_) {
      std::apply([&](const auto&... g) { group.accumulate_gradients(g...); }, grads);
      group.reshard();
      return;
    }
    while (static_cast<int>(in_flight_.size()) >= options_.max_reductions) {
      blocked([&] { in_flight_.front().wait(); });
      in_flight_.pop_front();
    }
    FsdpWork work = blocked([&] {
      return std::apply([&](const auto&... g) { return group.reduce_gradients(async_op, g...); }, grads);
    });
    ++stats_.reductions;
    if (options_.overlap) {
      in_flight_.push_back(std::move(work));
    } else {
      blocked([&] { work.wait(); });
    }
    group.reshard();
  }

  /// Waits for every reduction in flight, oldest first: the gradient shards are complete.
  void finish() {
    while (!in_flight_.empty()) {
      blocked([&] { in_flight_.front().wait(); });
      in_flight_.pop_front();
    }
  }
  /// Gradient accumulation (FSDP2's set_requires_gradient_sync): with false, backward adds each group's
  /// gradients to its unsharded accumulator (FlatParamGroup::accumulate_gradients) and reduces nothing;
  /// set true again before the last micro-batch's backward, whose reductions carry the whole sum.
  void set_requires_gradient_sync(bool sync) noexcept { sync_ = sync; }
  bool requires_gradient_sync() const noexcept { return sync_; }

  /// Reductions issued and not yet waited for by the schedule.
  int reductions_in_flight() const noexcept { return static_cast<int>(in_flight_.size()); }

private:
  struct Entry {
    const void* identity;
    std::function<FsdpWork()> unshard;
    std::function<bool()> is_unsharded;
  };

  template <class Group>
  std::size_t index_of(const Group& group, const char* call) const {
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].identity == group.identity()) {
        return i;
      }
    }
    detail::throw_error(std::string("FsdpSchedule::") + call + ": the group was not added to the schedule (" +
                        std::to_string(entries_.size()) + " groups added)");
  }

  /// Issues group i's all_gather unless it is gathered or in flight (waited for at once without overlap).
  void gather(std::size_t i) {
    Entry& e = entries_[i];
    if (e.is_unsharded()) {
      return;
    }
    FsdpWork work = e.unshard();
    ++stats_.all_gathers;
    if (!options_.overlap) {
      blocked([&] { work.wait(); });
    }
  }

  template <class F>
  std::invoke_result_t<F&> blocked(F&& f) {
    const auto start = std::chrono::steady_clock::now();
    struct Add {
      double& to;
      std::chrono::steady_clock::time_point start;
      ~Add() { to += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
    } add{stats_.blocked_seconds, start};
    return f();
  }

  FsdpScheduleOptions options_;
  std::vector<Entry> entries_;
  std::deque<FsdpWork> in_flight_;
  FsdpScheduleStats stats_;
  bool sync_ = true;
};

} // namespace dtensor
