#pragma once
// The training step of an nn::LanguageModel as a type of the library: a step is the forward and backward of
// one batch, the data-parallel reduction of the gradients overlapped with the backward, the clip by the
// global norm and the optimizer's step. Two schedules:
//
//   nn::DdpTrainer<Model, "dp">         parameters replicated over every batch axis; DDPReducer's buckets
//                                       all-reduce the gradients over "dp" while the backward runs; the
//                                       other axes a gradient is Partial on (a second batch axis, cp, tp for
//                                       the norms' weights under sequence parallelism) are reduced after it
//   nn::FsdpTrainer<Model, Policy, C>   one FlatParamGroup per block, one for the embedding, one for the
//                                       final norm and the head, sharded by Policy (Fsdp<"dp"> or Hsdp<"rep",
//                                       "dp">; the parameters' tp placements kept) and run by FsdpSchedule:
//                                       the next group's all_gather in flight while one computes, each block
//                                       resharded after its forward and gathered again for its backward
//                                       (which recomputes the block's forward from its saved input), the
//                                       reductions asynchronous (options.schedule). C is the compute type:
//                                       the gathered parameters and the activations (bfloat16: mixed
//                                       precision with T shards, the all_gather in C, gradients reduced in
//                                       ReduceT).
//
//   nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, std::move(model), {.max_norm = 1.0});
//   optim::AdamW opt({.lr = 3e-3});
//   for (...) { opt.set_lr(lr); nn::StepResult r = trainer.step(ids, targets, opt); }
//   trainer.step(std::span(micro_batches), opt);   // K (ids, targets) pairs: accumulated, reduced once
//   trainer.with_gathered([&](const auto& m) { return m.loss(val_ids, val_targets); });   // evaluation
//   std::apply([&](auto&... s) { save_training_state(dir, opt, progress, s...); }, trainer.state());
//
// Every rank makes the same calls in the same order, as for any collective. The optimizer's parameter
// indices are the parameters' order (DdpTrainer) or the groups' (FsdpTrainer): the same for every run of
// one trainer type, so a training state saved by one resumes on another layout of the same trainer. A
// trainer holds references into its own members: it is neither copied nor moved.
#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/parallel/clip.hpp"
#include "dtensor/parallel/ddp.hpp"
#include "dtensor/parallel/fsdp.hpp"
#include "dtensor/parallel/layers/layout.hpp"
#include "dtensor/parallel/layers/model.hpp"
#include "dtensor/parallel/layers/module.hpp"
#include "dtensor/parallel/nest.hpp"
#include "dtensor/parallel/schedule.hpp"

namespace dtensor::nn {

/// What a trainer does besides the model's forward and backward.
struct TrainerOptions {
  double max_norm = 1.0;          ///< clip_grad_norm's bound (infinity: no clipping)
  DDPOptions ddp{};               ///< DdpTrainer's buckets
  FsdpScheduleOptions schedule{}; ///< FsdpTrainer's schedule
};

/// What one step did.
struct StepResult {
  double loss = 0;      ///< the batch's mean loss, before the step
  double grad_norm = 0; ///< the global 2-norm of the gradients, before clipping
  /// The calling thread's time in the data-parallel communication: waits, and the calls that issue it
  /// (FsdpScheduleStats::blocked_seconds; DDPReducer::ready and finish, and the other axes' reductions).
  double blocked_seconds = 0;
};

namespace detail {

template <class V>
struct is_dtensor_leaf : std::bool_constant<AnyDTensor<V>> {};

} // namespace detail

/// f(x) for every DTensor x of a nest of tuples and ranges (a model's parameters()), in order.
template <class P, class F>
void for_each_tensor(P&& p, F&& f) {
  dtensor::detail::for_each_leaf<detail::is_dtensor_leaf>(p, f);
}

namespace detail {

/// A nest of references made a nest of handles (DTensor copies share their memory).
template <class P>
auto handles_of(const P& p) {
  if constexpr (AnyDTensor<P>) {
    return p;
  } else if constexpr (requires { std::tuple_size<P>::value; }) {
    return std::apply(
        [](const auto&... e) { return std::tuple<decltype(handles_of(e))...>{handles_of(e)...}; }, p);
  } else {
    std::vector<decltype(handles_of(p[0]))> v;
    for (const auto& e : p) {
      v.push_back(handles_of(e));
    }
    return v;
  }
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The flat groups nn::FsdpTrainer and nn::PipelineTrainer make of a LanguageModel: one for the embedding,
/// one per block, one for the final norm and the head.
template <class Model, class Policy, class ReduceT, class C>
struct ModelGroups {
  using T = typename Model::value_type;
  using L = typename Model::layout_type;
  using Mesh = typename L::mesh_shape;
  using embedding = FlatParamGroup<T, Mesh, Policy, params_of<Embedding<T, L>>, ReduceT, C>;
  using block = FlatParamGroup<T, Mesh, Policy, params_of<typename Model::block_type>, ReduceT, C>;
  using head = FlatParamGroup<T, Mesh, Policy, params_of_layers<RmsNorm<T, L>, LmHead<T, L>>, ReduceT, C>;
};

/// Group G of a tuple of parameters.
template <class G, class P>
G group_of(const P& params) {
  return std::apply([](const auto&... p) { return G(p...); }, params);
}

/// What the trainers share: the mesh, the options, and the step on one batch as a span of one micro-batch.
/// Derived has step(std::span<const std::pair<ids_type, ids_type>>, Optimizer&).
template <class Derived, class Model>
class TrainerBase {
  using Mesh = typename Model::layout_type::mesh_shape;

public:
  using model_type = Model;
  using ids_type = typename Model::ids_type;

  TrainerBase(const TrainerBase&) = delete;
  TrainerBase& operator=(const TrainerBase&) = delete;

  const DeviceMesh<Mesh>& mesh() const noexcept { return mesh_; }
  /// The options; changes apply from the next step (e.g. overlap off for a step that measures the whole
  /// communication: options().ddp.overlap, options().schedule.overlap).
  TrainerOptions& options() noexcept { return options_; }

  /// One training step on (ids, targets): Derived's step on one micro-batch.
  template <class Optimizer>
  StepResult step(const ids_type& ids, const ids_type& targets, Optimizer& opt) {
    const std::pair<ids_type, ids_type> one{ids, targets};
    return static_cast<Derived&>(*this).step(std::span(&one, 1), opt);
  }

protected:
  TrainerBase(const DeviceMesh<Mesh>& mesh, TrainerOptions options) : mesh_(mesh), options_(options) {}
  ~TrainerBase() = default;

  static void check_not_empty(std::span<const std::pair<ids_type, ids_type>> micro, const char* who) {
    DTENSOR_CHECK(!micro.empty(), std::string(who) + "::step: no micro-batch to train on");
  }

  DeviceMesh<Mesh> mesh_;
  TrainerOptions options_;
};

} // namespace detail

/// Replicated parameters, DDP over the mesh axis `Axis` (see the top of the file).
template <class Model, fixed_string Axis = "dp">
class DdpTrainer : public detail::TrainerBase<DdpTrainer<Model, Axis>, Model> {
  using Base = detail::TrainerBase<DdpTrainer<Model, Axis>, Model>;
  using T = typename Model::value_type;
  using Mesh = typename Model::layout_type::mesh_shape;
  using Params = decltype(std::declval<Model&>().parameters());
  static constexpr int per_block = int(std::tuple_size_v<typename Model::block_type::parameter_types>);
  using Base::mesh_;
  using Base::options_;

public:
  using Base::step;
  using typename Base::ids_type;

  DdpTrainer(const DeviceMesh<Mesh>& mesh, Model model, TrainerOptions options = {})
      : Base(mesh, options), model_(std::move(model)), params_(model_.parameters()),
        grads_(detail::handles_of(params_)) {
    for_each_tensor(params_, [&](const auto& w) {
      numels_.push_back(w.local().numel());
      set_memory_category(w, MemoryCategory::parameters);
    });
  }

  /// One training step on K micro-batches of equal size (gradient accumulation, DDP's no_sync): the first
  /// K - 1 backwards add their gradients to the buckets' accumulators with no communication, the last one's
  /// buckets carry the sum; each micro-batch's loss is scaled by 1 / K, so the step equals one on a batch K
  /// times larger. The loss reported is the micro-batches' mean.
  template <class Optimizer>
  StepResult step(std::span<const std::pair<ids_type, ids_type>> micro, Optimizer& opt) {
    Base::check_not_empty(micro, "nn::DdpTrainer");
    const MemoryCategoryScope category(MemoryCategory::activations); // the layers' own say what else is what
    const DDPOptions& d =
        options_.ddp; // the reducer (its buckets) lives across steps; rebuilt on new options
    if (!reducer_ || d.bucket_cap_bytes != reducer_options_.bucket_cap_bytes ||
        d.first_bucket_cap_bytes != reducer_options_.first_bucket_cap_bytes ||
        d.overlap != reducer_options_.overlap) {
      reducer_.emplace(mesh_, numels_, d);
      reducer_options_ = d;
    }
    DDPReducer<Axis, T, Mesh>& reducer = *reducer_;
    const int blocks = int(model_.blocks.size());
    // f(index of the layer's first parameter, its gradients, their slots) for the layer `part` names.
    auto route = [&](auto part, auto& g, auto&& f) {
      using Part = decltype(part);
      if constexpr (std::is_same_v<Part, EmbeddingPart>) {
        f(0, g, std::get<0>(grads_));
      } else if constexpr (std::is_same_v<Part, HeadPart>) {
        f(1 + blocks * per_block, g, std::get<2>(grads_));
      } else {
        f(1 + part.index * per_block, g, std::get<1>(grads_)[std::size_t(part.index)]);
      }
    };
    const double scale = 1.0 / double(micro.size());
    StepResult result;
    for (std::size_t k = 0; k + 1 < micro.size(); ++k) { // no_sync: into the buckets' accumulators
      result.loss +=
          scale *
          model_.step(
              micro[k].first, micro[k].second,
              [&](auto part, auto&& g) {
                route(part, g, [&](int first, auto& grads, auto&) {
                  [&]<std::size_t... I>(std::index_sequence<I...>) {
                    (reducer.accumulate(first + int(I), std::move(std::get<I>(grads))), ...);
                  }
                  (std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<decltype(grads)>>>{});
                });
              },
              scale);
    }
    deferred_.clear();
    // A layer's gradients, its first parameter's index `first`: to DDP now, into their slots (see hand).
    auto hand_layer = [&](int first, auto& g, auto& slots) {
      const auto t0 = std::chrono::steady_clock::now(); // ready() issues buckets (and waits, overlap off)
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        (hand(reducer, first + int(I), std::move(std::get<I>(g)), std::get<I>(slots)), ...);
      }
      (std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<decltype(g)>>>{});
      result.blocked_seconds += detail::seconds_since(t0);
    };
    result.loss += scale * model_.step(
                               micro.back().first, micro.back().second,
                               [&](auto part, auto&& g) { route(part, g, hand_layer); }, scale);
    const auto t0 = std::chrono::steady_clock::now();
    reducer.finish();
    {
      const MemoryCategoryScope kept(MemoryCategory::gradients);
      for (auto& f : deferred_) {
        f();
      }
      deferred_.clear(); // they hold the gradients before these reductions
    }
    result.blocked_seconds += detail::seconds_since(t0);
    result.grad_norm = clip_grad_norm(options_.max_norm, grads_);
    int index = 0;
    dtensor::detail::for_each_leaf_pair<detail::is_dtensor_leaf>(
        params_, grads_, [&](auto& w, const auto& g) { opt.step(index++, w, g); });
    return result;
  }

  /// The mean loss of one batch, no backward.
  double loss(const ids_type& ids, const ids_type& targets) const { return model_.loss(ids, targets); }
  /// f(model): the model with its parameters (evaluation, sampling, reading the weights).
  template <class F>
  decltype(auto) with_gathered(F&& f) {
    return std::forward<F>(f)(model_);
  }
  /// The sources of the training state (parallel/train_state.hpp): the parameters.
  auto state() { return std::tie(params_); }

private:
  /// Gradient `index` to the reducer. Its slot shares the memory of what ready() returns, which holds the
  /// reduced value once finish() returned; a gradient Partial over other axes too (a second batch axis,
  /// cp, tp for the norms' weights under sequence parallelism) is reduced over them into its slot after
  /// finish(), in order.
  template <class G, class Slot>
  void hand(DDPReducer<Axis, T, Mesh>& reducer, int index, G&& g, Slot& slot) {
    auto r = reducer.ready(index, std::forward<G>(g));
    if constexpr (std::is_same_v<decltype(r), Slot>) {
      slot = std::move(r);
    } else {
      deferred_.push_back([r = std::move(r), &slot] { slot = detail::gradient_as<Slot>(r); });
    }
  }

  Model model_;
  Params params_;
  decltype(detail::handles_of(std::declval<const Params&>())) grads_;
  std::vector<std::int64_t> numels_;
  std::optional<DDPReducer<Axis, T, Mesh>> reducer_;
  DDPOptions reducer_options_;
  std::vector<std::function<void()>> deferred_; // hand's reductions over the other axes, after finish()
};

/// Sharded parameters, FSDP or HSDP by Policy, compute type C, gradients reduced in ReduceT (see the top of
/// the file).
template <class Model, class Policy, class C = typename Model::value_type,
          class ReduceT = typename Model::value_type>
class FsdpTrainer : public detail::TrainerBase<FsdpTrainer<Model, Policy, C, ReduceT>, Model> {
  using Base = detail::TrainerBase<FsdpTrainer<Model, Policy, C, ReduceT>, Model>;
  using T = typename Model::value_type;
  using L = typename Model::layout_type;
  using Mesh = typename L::mesh_shape;
  using View = typename Model::template rebind<C>;
  using Groups = detail::ModelGroups<Model, Policy, ReduceT, C>;
  using EmbGroup = typename Groups::embedding;
  using BlockGroup = typename Groups::block;
  using HeadGroup = typename Groups::head;
  using Base::options_;

public:
  using Base::step;
  using typename Base::ids_type;

  /// The groups copy the model's parameters into their shards; the model keeps its layers' configuration
  /// only (nn::release_parameters).
  FsdpTrainer(const DeviceMesh<Mesh>& mesh, Model model, TrainerOptions options = {})
      : Base(mesh, options), model_(std::move(model)),
        embedding_(detail::group_of<EmbGroup>(model_.embedding.parameters())),
        head_(
            detail::group_of<HeadGroup>(std::tuple_cat(model_.norm.parameters(), model_.head.parameters()))) {
    for (auto& b : model_.blocks) {
      blocks_.push_back(detail::group_of<BlockGroup>(b.parameters()));
    }
    release_parameters(model_.embedding);
    for (auto& b : model_.blocks) {
      release_parameters(b);
    }
    release_parameters(model_.norm);
    release_parameters(model_.head);
  }
  /// One training step under FsdpSchedule, then clip over the groups and opt.step(i, group) for each group
  /// i (embedding, blocks, head); on K micro-batches of equal size (gradient accumulation, FSDP2's
  /// set_requires_gradient_sync(false)): the first K - 1 backwards add each group's gradients to its
  /// unsharded accumulator with no reduction, the last one's reduce_scatters carry the sum; each
  /// micro-batch's loss is scaled by 1 / K, so the step equals one on a batch K times larger. The loss
  /// reported is the micro-batches' mean.
  template <class Optimizer>
  StepResult step(std::span<const std::pair<ids_type, ids_type>> micro, Optimizer& opt) {
    Base::check_not_empty(micro, "nn::FsdpTrainer");
    const MemoryCategoryScope category(MemoryCategory::activations); // the groups' own say what else is what
    const double scale = 1.0 / double(micro.size());
    StepResult result;
    for (std::size_t k = 0; k < micro.size(); ++k) {
      FsdpSchedule sched(options_.schedule);
      for_each_group([&](auto& g) { sched.add(g); });
      sched.set_requires_gradient_sync(k + 1 == micro.size());
      result.loss += scale * forward_backward(sched, micro[k].first, micro[k].second, scale);
      sched.finish();
      result.blocked_seconds += sched.stats().blocked_seconds;
    }
    result.grad_norm = clip_grad_norm(options_.max_norm, embedding_, blocks_, head_);
    int index = 0;
    for_each_group([&](auto& g) {
      opt.step(index++, g);
      g.zero_grad();
    });
    return result;
  }

  /// f(model) with every group gathered: the model in the compute type on the full parameters (evaluation,
  /// sampling, reading the weights). The groups are resharded after.
  template <class F>
  decltype(auto) with_gathered(F&& f) {
    for_each_group([](auto& g) { g.unshard(); });
    struct Reshard {
      FsdpTrainer& t;
      ~Reshard() {
        t.for_each_group([](auto& g) { g.reshard(); });
      }
    } reshard{*this};
    auto [w_emb] = embedding_.params();
    View view{model_.embedding.with_parameters(w_emb),
              {},
              model_.norm.with_parameters(head_.template param<0>()),
              model_.head.with_parameters(head_.template param<1>())};
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      view.blocks.push_back(std::apply(
          [&](const auto&... p) { return model_.blocks[b].with_parameters(p...); }, blocks_[b].params()));
    }
    return std::forward<F>(f)(view);
  }
  /// The mean loss of one batch, no backward (the groups gathered for it).
  double loss(const ids_type& ids, const ids_type& targets) {
    return with_gathered([&](const View& m) { return m.loss(ids, targets); });
  }
  /// The sources of the training state (parallel/train_state.hpp): the groups.
  auto state() { return std::tie(embedding_, blocks_, head_); }

private:
  /// Forward and backward of one batch under `sched`, the loss's gradient scaled by `scale`: the loss.
  double forward_backward(FsdpSchedule& sched, const ids_type& ids, const ids_type& targets, double scale) {
    using Act = act_t<L, C>;
    std::vector<Act> inputs; // each block keeps its input only
    inputs.reserve(blocks_.size());
    Act h = sched.forward(embedding_,
                          [&](const auto& w) { return model_.embedding.with_parameters(w).forward(ids); });
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      inputs.push_back(h);
      h = sched.forward(blocks_[b],
                        [&](const auto&... p) { return model_.blocks[b].with_parameters(p...).forward(h); });
    }
    double loss = 0;
    std::optional<Act> dh;
    sched.backward(head_, [&](const auto& g, const auto& w) { // the head's forward and backward at once
      auto [n, norm_back] = model_.norm.with_parameters(g).forward(h, with_backward);
      auto [l, head_back] = model_.head.with_parameters(w).forward(n, targets, with_backward);
      loss = scalar_value(l);
      auto [dn, head_grads] = head_back(scale);
      auto [d, norm_grads] = norm_back(dn);
      dh.emplace(std::move(d));
      return std::tuple_cat(std::move(norm_grads), std::move(head_grads));
    });
    for (std::size_t b = blocks_.size(); b-- > 0;) {
      sched.backward(blocks_[b], [&](const auto&... p) {
        auto [dx, grads] =
            model_.blocks[b].with_parameters(p...).forward(inputs[b], with_backward).backward(*dh);
        dh.emplace(std::move(dx));
        return grads;
      });
    }
    sched.backward(embedding_, [&](const auto& w) {
      return model_.embedding.with_parameters(w).forward(ids, with_backward).backward(*dh).params;
    });
    return loss;
  }

  template <class F>
  void for_each_group(F&& f) {
    f(embedding_);
    for (auto& b : blocks_) {
      f(b);
    }
    f(head_);
  }

  Model model_;
  EmbGroup embedding_;
  std::vector<BlockGroup> blocks_;
  HeadGroup head_;
};

} // namespace dtensor::nn
