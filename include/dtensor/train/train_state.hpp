#pragma once
// The full training state in a sharded checkpoint (checkpoint/): the parameters, the optimizer's state
// (AdamW's moments and step counts, SGD's momentum, master weights) and where the run is (step, data
// position, random stream), saved under names that do not depend on the layout, so that a run saved on one
// mesh and layout resumes on another (saved under FSDP x TP on 4 ranks, resumed under TP on 2) and, on the
// same layout, goes on bit for bit as if it had not stopped.
//
//   // the sources, in a fixed order: DTensor parameters and FSDP groups, in tuples and vectors, nested
//   save_training_state("run/step-100", opt, {.step = 100, .data_position = pos}, emb_group, block_groups,
//                       head_group);
//   ...                                            // another process, mesh or layout: the same model
//   TrainingProgress p = load_training_state("run/step-100", opt, params);   // params: a tuple of DTensors
//
// Sources are visited in order; each leaf is one optimizer index (0, 1, ...: the index its step(index, ...)
// used) and holds one or more parameters, numbered in order over the whole call: a DTensor is one parameter,
// a FlatParamGroup its parameters in its order (stepped as one index: Optimizer::step(index, group)). So
// the parameter numbering, and with it the checkpoint's names, is the model's, whatever the grouping:
//
//   param/<k>            parameter k, in its unsharded placements (an FSDP group's gathered over its axes)
//   <state>/<k>          the optimizer's state of parameter k in the same placements, in state_t (float for
//                        bfloat16 and float parameters): exp_avg, exp_avg_sq, max_exp_avg_sq,
//                        momentum_buffer, master (those the optimizer holds)
//   optimizer_step       per parameter, the optimizer steps its index has taken
//   progress             TrainingProgress's four numbers
//
// save is collective over the mesh (FSDP groups all_gather their shards, one group at a time; checkpoint::
// save then writes every block once); load reads what each rank holds, with no collective (a group's shard is
// cut from the loaded unsharded tensors locally). Loading checks that the checkpoint holds the same
// number of parameters of the same global shapes (an error names the first that differs).

#include <cstdint>
#include <filesystem>
#include <optional>
#include <ranges>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/checkpoint/load.hpp"
#include "dtensor/checkpoint/save.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/optim.hpp"

namespace dtensor {

/// Where a training run is, besides its parameters and optimizer state.
struct TrainingProgress {
  std::int64_t step = 0;          ///< training steps done
  std::int64_t data_position = 0; ///< the data loader's position (samples or batches consumed)
  std::int64_t rng_seed = 0;      ///< the key of the run's random stream (dropout, sampling)
  std::int64_t rng_offset = 0;    ///< and its offset: the draws done
};

namespace detail {

/// The optimizer state tensors a checkpoint carries, by name.
inline constexpr const char* optimizer_state_names[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                        "momentum_buffer", "master"};
/// State tensor i (optimizer_state_names' order) of `s` (a ParamState, const or not).
template <class State>
auto& optimizer_state_at(State& s, int i) {
  decltype(&s.exp_avg) fields[] = {&s.exp_avg, &s.exp_avg_sq, &s.max_exp_avg_sq, &s.momentum_buffer,
                                   &s.master};
  return *fields[i];
}

template <class G>
concept FlatGroup = requires(const G& g) {
  g.local_param();
  g.flat_layout();
  typename G::params_type;
};

template <class G>
struct is_std_tuple : std::false_type {};
template <class... E>
struct is_std_tuple<std::tuple<E...>> : std::true_type {};

/// f(leaf) for each DTensor and FlatParamGroup of a nest of tuples and ranges, in order.
template <class S, class F>
void for_each_source(S&& s, F&& f) {
  using V = std::remove_cvref_t<S>;
  if constexpr (AnyDTensor<V> || FlatGroup<V>) {
    f(s);
  } else if constexpr (is_std_tuple<V>::value) {
    std::apply([&](auto&&... e) { (for_each_source(e, f), ...); }, s);
  } else {
    for (auto&& e : s) {
      for_each_source(e, f);
    }
  }
}

/// The MeshShape of a DeviceMesh type (or reference).
template <class M>
using shape_of_mesh = typename mesh_shape_of<std::remove_cvref_t<M>>::type;

/// All-Replicate DTensor type of element T and rank 1 on mesh Shape.
template <class Shape>
struct ReplicateAll {
  static constexpr PlacementList list() { return PlacementList(Shape::rank, Placement::replicate()); }
};
template <class T, class Shape>
using replicated_vector_t = dtensor_from_t<T, 1, Shape, &ReplicateAll<Shape>::list>;

/// The DTensor type of P's placements with element type S.
template <class S, class P>
struct with_element;
template <class S, class T, int R, class Shape, class... Q>
struct with_element<S, DTensor<T, R, Shape, Q...>> {
  using type = DTensor<S, R, Shape, Q...>;
};

/// A parameter's optimizer state tensor `a` (its shard's elements, state_t) as a DTensor placed like p.
template <class P>
auto state_as_dtensor(const AnyTensor& a, const P& p) {
  using S = optim::state_t<typename P::value_type>;
  using D = typename with_element<S, P>::type;
  return D(p.mesh(), a.view(to_extents(p.local().shape())).template as<S, P::rank>().contiguous(),
           p.global_shape());
}

/// What load_training_state reads for one parameter: its value and its optimizer state tensors.
template <class P>
using loaded_t = std::pair<
    P, std::vector<std::optional<typename with_element<optim::state_t<typename P::value_type>, P>::type>>>;

} // namespace detail

/// Saves the training state into the checkpoint directory `dir` (see the top of this file). Collective over
/// the sources' mesh.
template <class Opt, class... Sources>
void save_training_state(const std::filesystem::path& dir, const Opt& opt, const TrainingProgress& progress,
                         const Sources&... sources) {
  std::vector<checkpoint::Named> named;
  std::vector<std::int64_t> steps; // per parameter
  int index = 0;                   // the optimizer index of the leaf
  auto add_param = [&](const auto& p, const optim::ParamState* st, const std::vector<AnyTensor>& state) {
    const std::string k = std::to_string(steps.size());
    named.emplace_back("param/" + k, p);
    for (int i = 0; i < 5; ++i) {
      if (state[static_cast<std::size_t>(i)].defined()) {
        named.emplace_back(std::string(detail::optimizer_state_names[i]) + "/" + k,
                           detail::state_as_dtensor(state[static_cast<std::size_t>(i)], p));
      }
    }
    steps.push_back(st != nullptr ? st->step : 0);
  };
  auto leaf = [&](const auto& s) {
    using V = std::remove_cvref_t<decltype(s)>;
    const optim::ParamState* st = opt.has_state(index) ? &opt.state(index) : nullptr;
    if constexpr (AnyDTensor<V>) {
      std::vector<AnyTensor> state(5);
      for (int i = 0; st != nullptr && i < 5; ++i) {
        state[static_cast<std::size_t>(i)] = detail::optimizer_state_at(*st, i);
      }
      add_param(s, st, state);
    } else {
      // The group's flat shards (parameters and each state tensor) gathered and cut into its parameters.
      using T = typename V::value_type;
      using S = optim::state_t<T>;
      const auto params = s.unflatten_shard(s.local_param());
      std::vector<std::vector<AnyTensor>> per(std::tuple_size_v<decltype(params)>, std::vector<AnyTensor>(5));
      for (int i = 0; st != nullptr && i < 5; ++i) {
        const AnyTensor& a = detail::optimizer_state_at(*st, i);
        if (a.defined()) {
          const auto parts = s.unflatten_shard(a.view(Extents{a.numel()}).template as<S, 1>());
          std::size_t j = 0;
          std::apply(
              [&](const auto&... q) {
                ((per[j++][static_cast<std::size_t>(i)] = AnyTensor(q.local())), ...);
              },
              parts);
        }
      }
      std::size_t j = 0;
      std::apply([&](const auto&... p) { (add_param(p, st, per[j++]), ...); }, params);
    }
    ++index;
  };
  (detail::for_each_source(sources, leaf), ...);
  DTENSOR_CHECK(!named.empty(), "save_training_state: no parameters");
  // The per-parameter step counts and the progress, Replicate on the first parameter's mesh.
  auto replicated = [&](const std::vector<std::int64_t>& v) {
    Tensor<std::int64_t, 1> t({static_cast<std::int64_t>(v.size())});
    for (std::size_t i = 0; i < v.size(); ++i) {
      t.data()[i] = v[i];
    }
    return t;
  };
  const Tensor<std::int64_t, 1> step_t = replicated(steps);
  const Tensor<std::int64_t, 1> progress_t =
      replicated({progress.step, progress.data_position, progress.rng_seed, progress.rng_offset});
  bool done = false;
  auto add_scalars = [&](const auto& s) {
    if (done) {
      return;
    }
    done = true;
    using D = detail::replicated_vector_t<std::int64_t, detail::shape_of_mesh<decltype(s.mesh())>>;
    named.emplace_back("optimizer_step", D(s.mesh(), step_t, {step_t.numel()}));
    named.emplace_back("progress", D(s.mesh(), progress_t, {4}));
  };
  (detail::for_each_source(sources, add_scalars), ...);
  checkpoint::save(dir, named);
}

/// Loads the training state saved by save_training_state into the sources (the same model's parameters,
/// on any mesh and layout: DTensors get their values in place, FSDP groups their shards) and the optimizer
/// (each leaf's state at its index), and returns the progress. Reads only what this rank holds.
template <class Opt, class... Sources>
TrainingProgress load_training_state(const std::filesystem::path& dir, Opt& opt, Sources&&... sources) {
  checkpoint::Reader reader(dir);
  std::int64_t k = 0;
  int index = 0;
  Tensor<std::int64_t, 1> steps;
  bool have_steps = false;
  // Parameter k's value (a DTensor P on `mesh`, the parameter's unsharded placements) and its optimizer
  // state.
  auto load_param = [&]<class P>(std::type_identity<P>, const auto& mesh,
                                 const typename P::shape_type& global, Device device, optim::ParamState& st) {
    using S = optim::state_t<typename P::value_type>;
    using PS = typename detail::with_element<S, P>::type;
    const std::string name = "param/" + std::to_string(k);
    const auto& saved = reader.tensor(name);
    DTENSOR_CHECK(saved.shape == detail::to_extents(global),
                  "load_training_state: parameter " + std::to_string(k) + " has global shape " +
                      detail::shape_string(detail::to_extents(global)) + ", the checkpoint's " +
                      AnyTensor::to_string(saved.shape) + ": not the same model");
    P value = reader.template load<P>(name, mesh, device);
    std::vector<std::optional<PS>> state(5);
    for (int i = 0; i < 5; ++i) {
      const std::string sn = std::string(detail::optimizer_state_names[i]) + "/" + std::to_string(k);
      if (reader.tensors().count(sn) != 0) {
        state[static_cast<std::size_t>(i)].emplace(reader.template load<PS>(sn, mesh, device));
      }
    }
    if (!have_steps) {
      steps = reader
                  .template load<
                      detail::replicated_vector_t<std::int64_t, detail::shape_of_mesh<decltype(mesh)>>>(
                      "optimizer_step", mesh)
                  .local();
      have_steps = true;
    }
    DTENSOR_CHECK(k < steps.numel(), "load_training_state: the checkpoint holds " +
                                         std::to_string(steps.numel()) + " parameters, the model more");
    st.step = steps.data()[k];
    ++k;
    return std::pair{std::move(value), std::move(state)};
  };
  auto leaf = [&](auto& s) {
    using V = std::remove_cvref_t<decltype(s)>;
    optim::ParamState st;
    if constexpr (AnyDTensor<V>) {
      auto [value, state] =
          load_param(std::type_identity<V>{}, s.mesh(), s.global_shape(), s.local().device(), st);
      local::copy(s.local(), value.local());
      for (int i = 0; i < 5; ++i) {
        if (state[static_cast<std::size_t>(i)]) {
          detail::optimizer_state_at(st, i) =
              AnyTensor(state[static_cast<std::size_t>(i)]->local().contiguous());
        }
      }
    } else {
      using T = typename V::value_type;
      using S = optim::state_t<T>;
      const Device device = s.local_param().device();
      auto loaded = [&]<std::size_t... I>(std::index_sequence<I...>) {
        // Braced with its type: left to right (parameter k, then k + 1), and one pair stays one element.
        using Loaded = std::tuple<detail::loaded_t<typename V::template master_param_type<I>>...>;
        return Loaded{load_param(std::type_identity<typename V::template master_param_type<I>>{}, s.mesh(),
                                 s.template global_shape<I>(), device, st)...};
      }
      (std::make_index_sequence<std::tuple_size_v<typename V::params_type>>{});
      std::apply(
          [&](const auto&... l) { local::copy(s.local_param(), s.template flatten_to_shard<T>(l.first...)); },
          loaded);
      for (int i = 0; i < 5; ++i) {
        const bool present = std::apply(
            [&](const auto&... l) { return (l.second[static_cast<std::size_t>(i)].has_value() && ...); },
            loaded);
        if (present) {
          detail::optimizer_state_at(st, i) = AnyTensor(std::apply(
              [&](const auto&... l) {
                return s.template flatten_to_shard<S>(*l.second[static_cast<std::size_t>(i)]...);
              },
              loaded));
        }
      }
    }
    if (st.step > 0) {
      opt.load_state(index, std::move(st));
    }
    ++index;
  };
  (detail::for_each_source(sources, leaf), ...);
  DTENSOR_CHECK(k == steps.numel(), "load_training_state: the checkpoint holds " +
                                        std::to_string(steps.numel()) + " parameters, the model " +
                                        std::to_string(k));
  TrainingProgress progress;
  bool done = false;
  auto read_progress = [&](const auto& s) {
    if (done) {
      return;
    }
    done = true;
    const auto t =
        reader
            .template load<
                detail::replicated_vector_t<std::int64_t, detail::shape_of_mesh<decltype(s.mesh())>>>(
                "progress", s.mesh())
            .local();
    progress = {t.data()[0], t.data()[1], t.data()[2], t.data()[3]};
  };
  (detail::for_each_source(sources, read_progress), ...);
  return progress;
}

} // namespace dtensor
