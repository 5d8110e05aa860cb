#pragma once
// The training step of any model of the contract (nn/contract.hpp: an ordered list of units and a loss)
// as a type of the library: a step is the forward and backward of one batch, the data-parallel reduction
// of the gradients overlapped with the backward, the clip by the global norm and the optimizer's step. Two
// schedules:
//
//   nn::DdpTrainer<Model, "dp">         parameters replicated over every batch axis; DDPReducer's buckets
//                                       all-reduce the gradients over "dp" while the backward runs; the
//                                       other axes a gradient is Partial on (a second batch axis, cp, tp for
//                                       the norms' weights under sequence parallelism) are reduced after it
//   nn::FsdpTrainer<Model, Policy, C>   one FlatParamGroup per unit with parameters (FSDP2's fully_shard
//                                       of each unit), sharded by Policy (Fsdp<"dp"> or Hsdp<"rep", "dp">;
//                                       the parameters' tp placements kept) and run by FsdpSchedule: the
//                                       next group's all_gather in flight while one computes, each unit
//                                       resharded after its forward and gathered again for its backward
//                                       (which recomputes the unit's forward from its saved input: activation
//                                       checkpointing per unit), the reductions asynchronous
//                                       (options.schedule). C is the compute type: the gathered parameters,
//                                       the activations, and the input and target where they are floating
//                                       (bfloat16: mixed precision with T shards, the all_gather in C,
//                                       gradients reduced in ReduceT).
//
//   nn::FsdpTrainer<Model, Fsdp<"dp">> trainer(mesh, std::move(model), {.max_norm = 1.0});
//   optim::AdamW opt({.lr = 3e-3});
//   for (...) { opt.set_lr(lr); nn::StepResult r = trainer.step(input, target, opt); }
//   trainer.step(std::span(micro_batches), opt);   // K (input, target) pairs: accumulated, reduced once
//   trainer.with_gathered([&](const auto& m) { ... });    // evaluation, sampling, reading the weights
//   double val = trainer.loss(input, target);              // forward only
//   save_training_state(trainer, dir, opt, progress);     // train/train_state.hpp (with dtensor::checkpoint)
//
// The input is what the model's first unit takes and the target what its loss takes with the last unit's
// output (nn::LanguageModel: token ids and next tokens). Every rank makes the same calls in the same order,
// as for any collective. The optimizer's parameter indices are the parameters' order (DdpTrainer) or the
// groups' (FsdpTrainer: one per unit with parameters, in the order of the forward): the same for every run
// of one trainer type, so a training state saved by one resumes on another layout of the same trainer. A
// trainer holds references into its own members: it is neither copied nor moved.
#include <array>
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
#include "dtensor/core/nest.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/train/clip.hpp"
#include "dtensor/train/ddp.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/fsdp_schedule.hpp"

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

/// The FSDP group of a unit U (std::tuple<>: a unit without parameters has none).
template <class U, class T, class Mesh, class Policy, class ReduceT, class C,
          bool = (unit_param_count<U> > 0)>
struct unit_group {
  using type = FlatParamGroup<T, Mesh, Policy, params_of<U>, ReduceT, C>;
};
template <class U, class T, class Mesh, class Policy, class ReduceT, class C>
struct unit_group<U, T, Mesh, Policy, ReduceT, C, false> {
  using type = std::tuple<>;
};
/// The groups of an element of units(): a unit's group, or a run's std::vector of them.
template <class E, class T, class Mesh, class Policy, class ReduceT, class C>
struct element_group {
  using type = typename unit_group<E, T, Mesh, Policy, ReduceT, C>::type;
};
template <class U, class A, class T, class Mesh, class Policy, class ReduceT, class C>
struct element_group<std::vector<U, A>, T, Mesh, Policy, ReduceT, C> {
  using type = std::vector<typename unit_group<U, T, Mesh, Policy, ReduceT, C>::type>;
};
/// The groups of a model: one entry per element of its units().
template <class Model, class Policy, class ReduceT, class C, class Units = units_t<Model>>
struct model_groups;
template <class Model, class Policy, class ReduceT, class C, class... E>
struct model_groups<Model, Policy, ReduceT, C, std::tuple<E...>> {
  using type = std::tuple<typename element_group<std::remove_cvref_t<E>, model_value_t<Model>,
                                                 model_mesh_t<Model>, Policy, ReduceT, C>::type...>;
};
template <class Model, class Policy, class ReduceT, class C>
using model_groups_t = typename model_groups<Model, Policy, ReduceT, C>::type;

/// The group G of a unit (std::tuple<> for one without parameters).
template <class G, class U>
G group_of_unit(U& u) {
  if constexpr (std::is_same_v<G, std::tuple<>>) {
    return {};
  } else {
    return std::apply([](const auto&... p) { return G(p...); }, u.parameters());
  }
}

/// The group(s) G of an element of units(): a unit's group, or a run's std::vector of them.
template <class G, class E>
G group_of_element(E& e) {
  if constexpr (is_unit_run<std::remove_cvref_t<E>>::value) {
    G v;
    v.reserve(e.size());
    for (auto& u : e) {
      v.push_back(group_of_unit<typename G::value_type>(u));
    }
    return v;
  } else {
    return group_of_unit<G>(e);
  }
}

template <class Groups, class Units, std::size_t... I>
Groups make_groups(Units units, std::index_sequence<I...>) {
  return Groups{group_of_element<std::tuple_element_t<I, Groups>>(std::get<I>(units))...};
}

/// The groups of a model's units.
template <class Groups, class Units>
Groups make_groups(Units units) {
  return make_groups<Groups>(units, std::make_index_sequence<std::tuple_size_v<Units>>{});
}

/// A tuple of references to the groups of a nest of groups, the units without parameters left out: what
/// clip, the optimizer and the training state take.
template <class Groups>
auto param_groups(Groups& groups) {
  return std::apply(
      [](auto&... e) {
        return std::tuple_cat([](auto& x) {
          using X = std::remove_cvref_t<decltype(x)>;
          if constexpr (std::is_same_v<X, std::tuple<>> || std::is_same_v<X, std::vector<std::tuple<>>>) {
            return std::tuple<>{};
          } else {
            return std::tie(x);
          }
        }(e)...);
      },
      groups);
}

/// The mean loss of model `m` (any element type) on one batch, no backward.
template <class M, class Input, class Target>
double model_loss(M& m, const Input& input, const Target& target) {
  using C = model_value_t<M>;
  auto units = m.units();
  const auto y = forward_units<0>(units, in_compute_type<C>(input));
  return scalar_value(m.loss_function()(y, in_compute_type<C>(target)));
}

/// What the trainers share: the mesh, the options, and the step on one batch as a span of one micro-batch.
/// Derived has step(std::span<Batch>, Optimizer&), Batch a pair (input, target).
template <class Derived, class Model>
class TrainerBase {
  static_assert(check_model<Model>());
  using Mesh = model_mesh_t<Model>;

public:
  using model_type = Model;

  TrainerBase(const TrainerBase&) = delete;
  TrainerBase& operator=(const TrainerBase&) = delete;

  const DeviceMesh<Mesh>& mesh() const noexcept { return mesh_; }
  /// The options; changes apply from the next step (e.g. overlap off for a step that measures the whole
  /// communication: options().ddp.overlap, options().schedule.overlap).
  TrainerOptions& options() noexcept { return options_; }

  /// One training step on (input, target): Derived's step on one micro-batch.
  template <class Input, class Target, class Optimizer>
  StepResult step(const Input& input, const Target& target, Optimizer& opt) {
    const std::pair<Input, Target> one{input, target};
    return static_cast<Derived&>(*this).step(std::span(&one, 1), opt);
  }

protected:
  TrainerBase(const DeviceMesh<Mesh>& mesh, TrainerOptions options) : mesh_(mesh), options_(options) {}
  ~TrainerBase() = default;

  template <class Batch, std::size_t E>
  static void check_not_empty(std::span<Batch, E> micro, const char* who) {
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
  using T = model_value_t<Model>;
  using Mesh = model_mesh_t<Model>;
  using Params = decltype(model_parameters(std::declval<Model&>()));
  using Base::mesh_;
  using Base::options_;

public:
  using Base::step;

  DdpTrainer(const DeviceMesh<Mesh>& mesh, Model model, TrainerOptions options = {})
      : Base(mesh, options), model_(std::move(model)), params_(model_parameters(model_)),
        grads_(detail::handles_of(params_)) {
    int first = 0; // each element's first parameter index
    for_each_unit(model_.units(), [&](auto& u, auto element, std::size_t j) {
      if (j == 0) {
        firsts_[element] = first;
      }
      first += int(detail::unit_param_count<std::remove_cvref_t<decltype(u)>>);
    });
    for_each_tensor(params_, [&](const auto& w) {
      numels_.push_back(w.local().numel());
      set_memory_category(w, MemoryCategory::parameters);
    });
  }

  /// One training step on K micro-batches (input, target) of equal size (gradient accumulation, DDP's
  /// no_sync): the first K - 1 backwards add their gradients to the buckets' accumulators with no
  /// communication, the last one's buckets carry the sum; each micro-batch's loss is scaled by 1 / K, so the
  /// step equals one on a batch K times larger. The loss reported is the micro-batches' mean.
  template <class Batch, std::size_t E, class Optimizer>
  StepResult step(std::span<Batch, E> micro, Optimizer& opt) {
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
    const double scale = 1.0 / double(micro.size());
    StepResult result;
    for (std::size_t k = 0; k + 1 < micro.size(); ++k) { // no_sync: into the buckets' accumulators
      result.loss += scale * forward_backward(micro[k], scale, [&](auto element, std::size_t j, auto&& g) {
                       const int first = first_of(element, j);
                       [&]<std::size_t... I>(std::index_sequence<I...>) {
                         (reducer.accumulate(first + int(I), std::move(std::get<I>(g))), ...);
                       }
                       (std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<decltype(g)>>>{});
                     });
    }
    deferred_.clear();
    // A unit's gradients: to DDP now, into their slots (see hand).
    result.loss += scale * forward_backward(micro.back(), scale, [&](auto element, std::size_t j, auto&& g) {
                     const auto t0 = std::chrono::steady_clock::now(); // ready() issues buckets
                     const int first = first_of(element, j);
                     auto& slots = slots_of(element, j);
                     [&]<std::size_t... I>(std::index_sequence<I...>) {
                       (hand(reducer, first + int(I), std::move(std::get<I>(g)), std::get<I>(slots)), ...);
                     }
                     (std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<decltype(g)>>>{});
                     result.blocked_seconds += detail::seconds_since(t0);
                   });
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
  template <class Input, class Target>
  double loss(const Input& input, const Target& target) {
    return detail::model_loss(model_, input, target);
  }
  /// f(model): the model with its parameters (evaluation, sampling, reading the weights).
  template <class F>
  decltype(auto) with_gathered(F&& f) {
    return std::forward<F>(f)(model_);
  }
  /// The sources of the training state (train/train_state.hpp): the parameters.
  auto state() { return std::tie(params_); }

private:
  static constexpr std::size_t kElements = std::tuple_size_v<units_t<Model>>;

  /// Forward and backward of one micro-batch, the loss's gradient scaled by `scale`: each unit's gradients
  /// to on(element, index, grads), the last unit's first. The loss.
  template <class Batch, class On>
  double forward_backward(const Batch& batch, double scale, On&& on) {
    auto units = model_.units();
    const auto target = detail::in_compute_type<T>(batch.second);
    std::function<double()> read;
    auto tail = [&](const auto& y) {
      auto [l, back] = model_.loss_function()(y, target, with_backward);
      read = [l] { return scalar_value(l); };
      return back(scale);
    };
    (void)detail::backprop_units<0>(units, detail::in_compute_type<T>(batch.first), tail, on);
    return read();
  }

  /// The optimizer index of the first parameter of unit j of element `element`.
  template <std::size_t I>
  int first_of(std::integral_constant<std::size_t, I>, std::size_t j) const {
    using U = detail::unit_of_t<std::tuple_element_t<I, units_t<Model>>>;
    return firsts_[I] + int(j) * int(detail::unit_param_count<U>);
  }
  /// The gradient slots of unit j of element `element`.
  template <std::size_t I>
  auto& slots_of(std::integral_constant<std::size_t, I>, std::size_t j) {
    auto& e = std::get<I>(grads_);
    if constexpr (detail::is_unit_run<std::remove_cvref_t<std::tuple_element_t<I, units_t<Model>>>>::value) {
      return e[j];
    } else {
      return e;
    }
  }

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
  std::array<int, kElements> firsts_{};
  std::vector<std::int64_t> numels_;
  std::optional<DDPReducer<Axis, T, Mesh>> reducer_;
  DDPOptions reducer_options_;
  std::vector<std::function<void()>> deferred_; // hand's reductions over the other axes, after finish()
};

/// Sharded parameters, FSDP or HSDP by Policy, compute type C, gradients reduced in ReduceT (see the top of
/// the file).
template <class Model, class Policy, class C = detail::value_or_void_t<Model>,
          class ReduceT = detail::value_or_void_t<Model>>
class FsdpTrainer : public detail::TrainerBase<FsdpTrainer<Model, Policy, C, ReduceT>, Model> {
  using Base = detail::TrainerBase<FsdpTrainer<Model, Policy, C, ReduceT>, Model>;
  using T = model_value_t<Model>;
  using Mesh = model_mesh_t<Model>;
  using Groups = detail::model_groups_t<Model, Policy, ReduceT, C>;
  using Base::options_;
  static constexpr std::size_t kElements = std::tuple_size_v<units_t<Model>>;

public:
  using Base::step;

  /// The groups copy the model's parameters into their shards; the model keeps its units' configuration
  /// only (nn::release_parameters).
  FsdpTrainer(const DeviceMesh<Mesh>& mesh, Model model, TrainerOptions options = {})
      : Base(mesh, options), model_(std::move(model)), groups_(detail::make_groups<Groups>(model_.units())) {
    for_each_unit(model_.units(), [](auto& u, auto, std::size_t) { release_parameters(u); });
  }
  /// One training step under FsdpSchedule, then clip over the groups and opt.step(i, group) for each group
  /// i (the units with parameters, in order); on K micro-batches of equal size (gradient accumulation,
  /// FSDP2's set_requires_gradient_sync(false)): the first K - 1 backwards add each group's gradients to its
  /// unsharded accumulator with no reduction, the last one's reduce_scatters carry the sum; each
  /// micro-batch's loss is scaled by 1 / K, so the step equals one on a batch K times larger. The loss
  /// reported is the micro-batches' mean.
  template <class Batch, std::size_t E, class Optimizer>
  StepResult step(std::span<Batch, E> micro, Optimizer& opt) {
    Base::check_not_empty(micro, "nn::FsdpTrainer");
    const MemoryCategoryScope category(MemoryCategory::activations); // the groups' own say what else is what
    const double scale = 1.0 / double(micro.size());
    StepResult result;
    for (std::size_t k = 0; k < micro.size(); ++k) {
      FsdpSchedule sched(options_.schedule);
      for_each_group([&](auto& g) { sched.add(g); });
      sched.set_requires_gradient_sync(k + 1 == micro.size());
      result.loss += scale * forward_backward(sched, micro[k], scale);
      sched.finish();
      result.blocked_seconds += sched.stats().blocked_seconds;
    }
    result.grad_norm =
        std::apply([&](auto&... g) { return clip_grad_norm(options_.max_norm, g...); }, param_groups());
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
    auto view = gathered_view();
    return std::forward<F>(f)(view);
  }
  /// The mean loss of one batch, no backward (the groups gathered for it).
  template <class Input, class Target>
  double loss(const Input& input, const Target& target) {
    return with_gathered([&](auto& m) { return detail::model_loss(m, input, target); });
  }
  /// The sources of the training state (train/train_state.hpp): the groups.
  auto state() { return param_groups(); }

private:
  auto param_groups() { return detail::param_groups(groups_); }

  /// Unit u (group g) on the gathered parameters.
  template <class U, class G>
  static auto on_params(const U& u, G& g) {
    if constexpr (std::is_same_v<G, std::tuple<>>) {
      return u;
    } else {
      return std::apply([&](const auto&... p) { return u.with_parameters(p...); }, g.params());
    }
  }

  /// The model in C on the gathered parameters: a copy whose units are replaced (C = T), or Model::rebind<C>
  /// made from its units.
  auto gathered_view() {
    auto elements = [&]<std::size_t... I>(std::index_sequence<I...>) {
      auto units = model_.units();
      return std::tuple{[&](auto& e, auto& g) {
        if constexpr (detail::is_unit_run<std::remove_cvref_t<decltype(e)>>::value) {
          std::vector<decltype(on_params(e[0], g[0]))> v;
          for (std::size_t j = 0; j < e.size(); ++j) {
            v.push_back(on_params(e[j], g[j]));
          }
          return v;
        } else {
          return on_params(e, g);
        }
      }(std::get<I>(units), std::get<I>(groups_))...};
    }
    (std::make_index_sequence<kElements>{});
    if constexpr (std::is_same_v<C, T>) {
      Model view = model_;
      auto units = view.units();
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((std::get<I>(units) = std::move(std::get<I>(elements))), ...);
      }
      (std::make_index_sequence<kElements>{});
      return view;
    } else {
      static_assert(
          requires { typename Model::template rebind<C>; },
          "nn::FsdpTrainer::with_gathered in a compute type other than the parameters': the model "
          "gives `template <class U> using rebind = ...` (itself in element type U) and a "
          "constructor from its units in order");
      using View = typename Model::template rebind<C>;
      return std::make_from_tuple<View>(std::move(elements));
    }
  }

  /// Unit u's forward under `sched` (no backward: it is recomputed in unit_backward).
  template <class U, class G, class X>
  static auto unit_forward(FsdpSchedule& sched, const U& u, G& g, const X& x) {
    if constexpr (std::is_same_v<G, std::tuple<>>) {
      return detail::forward_only(u, x);
    } else {
      return sched.forward(
          g, [&](const auto&... p) { return detail::forward_only(u.with_parameters(p...), x); });
    }
  }
  /// Unit u's backward under `sched` for the output gradient `dy(y)` (a callable: the last unit's is the
  /// loss's backward, run after its forward): its forward run again from x, its gradients to its group's
  /// reduction; x's gradient.
  template <class U, class G, class X, class Dy>
  static auto unit_backward(FsdpSchedule& sched, const U& u, G& g, const X& x, Dy&& dy) {
    auto run = [&](const auto&... p) {
      auto [y, back] = u.with_parameters(p...).forward(x, with_backward);
      return back(dy(y));
    };
    if constexpr (std::is_same_v<G, std::tuple<>>) {
      return run().input;
    } else {
      std::optional<decltype(std::apply(run, g.params()).input)> dx;
      sched.backward(g, [&](const auto&... p) {
        auto r = run(p...);
        dx.emplace(std::move(r.input));
        return std::move(r.params);
      });
      return std::move(*dx);
    }
  }

  /// Elements I.. of the units on input x under `sched`; `tail(y)` the loss's forward and backward on the
  /// last unit's output. x's gradient.
  template <std::size_t I, class Units, class X, class Tail>
  auto pass(FsdpSchedule& sched, Units& units, const X& x, Tail& tail) {
    constexpr bool last = I + 1 == kElements;
    auto& e = std::get<I>(units);
    auto& g = std::get<I>(groups_);
    const auto then = [&](const auto& y) {
      if constexpr (last) {
        return tail(y);
      } else {
        return pass<I + 1>(sched, units, y, tail);
      }
    };
    if constexpr (detail::is_unit_run<std::remove_cvref_t<decltype(e)>>::value) {
      const std::size_t n = e.size();
      const std::size_t ahead = last && n > 0 ? n - 1 : n; // the last unit of the model runs at once
      std::vector<X> inputs;                               // each unit keeps its input only
      inputs.reserve(n);
      X h = x;
      for (std::size_t j = 0; j < ahead; ++j) {
        inputs.push_back(h);
        h = unit_forward(sched, e[j], g[j], h);
      }
      auto dy = [&] {
        if constexpr (last) {
          if (ahead < n) {
            return unit_backward(sched, e[n - 1], g[n - 1], h, tail);
          }
        }
        return then(h);
      }();
      for (std::size_t j = ahead; j-- > 0;) {
        dy = unit_backward(sched, e[j], g[j], inputs[j], [&](const auto&) { return dy; });
      }
      return dy;
    } else if constexpr (last) {
      return unit_backward(sched, e, g, x, tail);
    } else {
      const auto y = unit_forward(sched, e, g, x);
      auto dy = pass<I + 1>(sched, units, y, tail);
      return unit_backward(sched, e, g, x, [&](const auto&) { return dy; });
    }
  }

  /// Forward and backward of one micro-batch under `sched`, the loss's gradient scaled by `scale`: the loss.
  template <class Batch>
  double forward_backward(FsdpSchedule& sched, const Batch& batch, double scale) {
    auto units = model_.units();
    const auto target = detail::in_compute_type<C>(batch.second);
    std::function<double()> read;
    auto tail = [&](const auto& y) {
      auto [l, back] = model_.loss_function()(y, target, with_backward);
      read = [l] { return scalar_value(l); };
      return back(scale);
    };
    (void)pass<0>(sched, units, detail::in_compute_type<C>(batch.first), tail);
    return read();
  }

  template <class F>
  void for_each_group(F&& f) {
    std::apply([&](auto&... e) { (dtensor::detail::for_each_leaf<is_group>(e, f), ...); }, param_groups());
  }
  template <class V>
      struct is_group : std::bool_constant < requires(const V& v) {
    v.identity();
    v.flat_layout();
  } > {};

  Model model_;
  Groups groups_;
};

} // namespace dtensor::nn
