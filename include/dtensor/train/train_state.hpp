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
//
// A pipeline's state is saved in parts (nn::PipelineTrainer::save_state): `dir`/part-<s> holds pp rank s's
// parameters under the same names (their numbers over the whole model) and its optimizer_step with -1 for
// the parameters of other stages; parts.json counts the parts. The parts are written beside `dir` and
// published in one rename. load_training_state reads either form, so a state moves between the trainers
// and pipeline cuts of the same model.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <ranges>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtensor/checkpoint/async_save.hpp"
#include "dtensor/checkpoint/load.hpp"
#include "dtensor/checkpoint/safetensors.hpp"
#include "dtensor/checkpoint/save.hpp"
#include "dtensor/comm/object.hpp"
#include "dtensor/comm/process_group.hpp"
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

/// The parameters a leaf holds: a DTensor one, a FlatParamGroup its own.
template <class S>
inline constexpr std::int64_t leaf_params = 1;
template <FlatGroup S>
inline constexpr std::int64_t leaf_params<S> = std::int64_t(std::tuple_size_v<typename S::params_type>);

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

/// The name of part i of a training state saved in parts.
inline std::string state_part_name(int i) {
  return "part-" + std::to_string(i);
}

/// The tensors of a training state: the leaves a rank holds, each at its optimizer index, its parameters
/// numbered from the number of its first (the numbering is the model's, whoever holds the leaf).
template <class Opt>
class StateWriter {
public:
  explicit StateWriter(const Opt& opt) : opt_(opt) {}

  /// Leaf s (a DTensor or a FlatParamGroup), stepped at optimizer index `index`, its first parameter
  /// numbered `first`. Collective over its mesh for a group (its shards are gathered).
  template <class S>
  void add(const S& s, int index, std::int64_t first) {
    const optim::ParamState* st = opt_.has_state(index) ? &opt_.state(index) : nullptr;
    std::int64_t k = first;
    auto add_param = [&](const auto& p, const std::vector<AnyTensor>& state) {
      const std::string name = std::to_string(k);
      named_.emplace_back("param/" + name, p);
      for (int i = 0; i < 5; ++i) {
        if (state[static_cast<std::size_t>(i)].defined()) {
          named_.emplace_back(std::string(optimizer_state_names[i]) + "/" + name,
                              state_as_dtensor(state[static_cast<std::size_t>(i)], p));
        }
      }
      steps_.resize(std::max(steps_.size(), static_cast<std::size_t>(k + 1)), -1);
      steps_[static_cast<std::size_t>(k++)] = st != nullptr ? st->step : 0;
    };
    if constexpr (AnyDTensor<S>) {
      std::vector<AnyTensor> state(5);
      for (int i = 0; st != nullptr && i < 5; ++i) {
        state[static_cast<std::size_t>(i)] = optimizer_state_at(*st, i);
      }
      add_param(s, state);
    } else {
      // The group's flat shards (parameters and each state tensor) gathered and cut into its parameters.
      using S2 = optim::state_t<typename S::value_type>;
      const auto params = s.unflatten_shard(s.local_param());
      std::vector<std::vector<AnyTensor>> per(std::tuple_size_v<decltype(params)>, std::vector<AnyTensor>(5));
      for (int i = 0; st != nullptr && i < 5; ++i) {
        const AnyTensor& a = optimizer_state_at(*st, i);
        if (a.defined()) {
          const auto parts = s.unflatten_shard(a.view(Extents{a.numel()}).template as<S2, 1>());
          std::size_t j = 0;
          std::apply(
              [&](const auto&... q) {
                ((per[j++][static_cast<std::size_t>(i)] = AnyTensor(q.local())), ...);
              },
              parts);
        }
      }
      std::size_t j = 0;
      std::apply([&](const auto&... p) { (add_param(p, per[j++]), ...); }, params);
    }
  }

  /// The tensors to save: the leaves', the optimizer's step counts (`params` entries, the model's
  /// parameters: -1 for those this writer was not given) and `progress`, Replicate on `mesh`.
  template <class M>
  std::vector<checkpoint::Named> finish(const M& mesh, std::int64_t params,
                                        const TrainingProgress& progress) {
    DTENSOR_CHECK(!named_.empty(), "save_training_state: no parameters");
    steps_.resize(static_cast<std::size_t>(params), -1);
    auto replicated = [&](const std::vector<std::int64_t>& v) {
      Tensor<std::int64_t, 1> t({static_cast<std::int64_t>(v.size())});
      std::copy(v.begin(), v.end(), t.data());
      using D = replicated_vector_t<std::int64_t, shape_of_mesh<M>>;
      return D(mesh, t, {t.numel()});
    };
    named_.emplace_back("optimizer_step", replicated(steps_));
    named_.emplace_back("progress", replicated({progress.step, progress.data_position, progress.rng_seed,
                                                progress.rng_offset}));
    return std::move(named_);
  }

private:
  const Opt& opt_;
  std::vector<checkpoint::Named> named_;
  std::vector<std::int64_t> steps_; ///< by parameter number
};

/// A training state opened for reading: one checkpoint directory, or the parts of one saved in parts
/// (parts.json: their count; part-<i>, a checkpoint directory each). Every parameter's tensors are in one
/// part; the step counts are merged over the parts.
class StateReader {
public:
  explicit StateReader(const std::filesystem::path& dir) : dir_(dir) {
    const std::filesystem::path list = dir / "parts.json";
    if (!std::filesystem::exists(list)) {
      parts_.emplace_back(dir);
    } else {
      checkpoint::File file(list, O_RDONLY);
      std::string text(file.size(), '\0');
      file.read_at(text.data(), text.size(), 0, "the parts");
      const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      DTENSOR_CHECK(j.is_object() && j.contains("parts") && j["parts"].is_number_integer() &&
                        j["parts"].get<int>() >= 1,
                    list.string() + ": not a training state's list of parts (no \"parts\": count)");
      for (int i = 0; i < j["parts"].get<int>(); ++i) {
        parts_.emplace_back(dir / state_part_name(i));
      }
    }
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      for (const auto& entry : parts_[i].tensors()) {
        where_.try_emplace(entry.first, i);
      }
      const checkpoint::SavedTensor& t = parts_[i].tensor("optimizer_step");
      DTENSOR_CHECK(t.shape.size() == 1 && (i == 0 || t.shape[0] == std::int64_t(steps_.size())),
                    "load_training_state " + dir.string() + ": its parts count different parameters");
      std::vector<std::int64_t> steps(static_cast<std::size_t>(t.shape[0]));
      parts_[i].read("optimizer_step", DType::int64, Block{t.shape, Extents{0}}, steps.data());
      steps_.resize(steps.size(), -1);
      for (std::size_t k = 0; k < steps.size(); ++k) {
        steps_[k] = std::max(steps_[k], steps[k]);
      }
    }
  }

  /// The part that holds tensor `name`: an Error naming it (and what the first part holds) when none does.
  checkpoint::Reader& part_of(const std::string& name) {
    const auto it = where_.find(name);
    return it != where_.end() ? parts_[it->second] : (parts_.front().tensor(name), parts_.front());
  }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }

  /// The model's parameter count the state was saved for, and parameter k's optimizer steps.
  std::int64_t params() const noexcept { return std::int64_t(steps_.size()); }
  std::int64_t steps(std::int64_t k) const {
    DTENSOR_CHECK(
        k < params() && steps_[std::size_t(k)] >= 0,
        "load_training_state " + dir_.string() + ": the checkpoint holds " + std::to_string(params()) +
            " parameters" +
            (k < params() ? ", and no part holds parameter " + std::to_string(k) : ", the model more"));
    return steps_[std::size_t(k)];
  }

  TrainingProgress progress() {
    std::int64_t v[4];
    parts_.front().read("progress", DType::int64, Block{Extents{4}, Extents{0}}, v);
    return {v[0], v[1], v[2], v[3]};
  }

private:
  std::filesystem::path dir_;
  std::vector<checkpoint::Reader> parts_;
  std::map<std::string, std::size_t, std::less<>> where_;
  std::vector<std::int64_t> steps_;
};

/// Loads leaves of a training state (StateWriter's) into the model's parameters and the optimizer.
template <class Opt>
class StateLoader {
public:
  StateLoader(const std::filesystem::path& dir, Opt& opt) : reader_(dir), opt_(opt) {}

  /// Leaf s (a DTensor: its values in place; a FlatParamGroup: its shards), stepped at optimizer index
  /// `index`, its first parameter numbered `first`; the optimizer's state at `index`. No collective.
  template <class S>
  void load(S& s, int index, std::int64_t first) {
    optim::ParamState st;
    std::int64_t k = first;
    if constexpr (AnyDTensor<S>) {
      auto [value, state] =
          load_param(k, std::type_identity<S>{}, s.mesh(), s.global_shape(), s.local().device(), st);
      local::copy(s.local(), value.local());
      for (int i = 0; i < 5; ++i) {
        if (state[static_cast<std::size_t>(i)]) {
          optimizer_state_at(st, i) = AnyTensor(state[static_cast<std::size_t>(i)]->local().contiguous());
        }
      }
    } else {
      using T = typename S::value_type;
      using S2 = optim::state_t<T>;
      const Device device = s.local_param().device();
      auto loaded = [&]<std::size_t... I>(std::index_sequence<I...>) {
        // Braced with its type: left to right (parameter k, then k + 1), and one pair stays one element.
        using Loaded = std::tuple<loaded_t<typename S::template master_param_type<I>>...>;
        return Loaded{load_param(k, std::type_identity<typename S::template master_param_type<I>>{}, s.mesh(),
                                 s.template global_shape<I>(), device, st)...};
      }
      (std::make_index_sequence<std::tuple_size_v<typename S::params_type>>{});
      std::apply(
          [&](const auto&... l) { local::copy(s.local_param(), s.template flatten_to_shard<T>(l.first...)); },
          loaded);
      for (int i = 0; i < 5; ++i) {
        const bool present = std::apply(
            [&](const auto&... l) { return (l.second[static_cast<std::size_t>(i)].has_value() && ...); },
            loaded);
        if (present) {
          optimizer_state_at(st, i) = AnyTensor(std::apply(
              [&](const auto&... l) {
                return s.template flatten_to_shard<S2>(*l.second[static_cast<std::size_t>(i)]...);
              },
              loaded));
        }
      }
    }
    if (st.step > 0) {
      opt_.load_state(index, std::move(st));
    }
  }

  /// Checks that the model has as many parameters as the checkpoint; the progress.
  TrainingProgress finish(std::int64_t params) {
    DTENSOR_CHECK(params == reader_.params(), "load_training_state: the checkpoint holds " +
                                                  std::to_string(reader_.params()) +
                                                  " parameters, the model " + std::to_string(params));
    return reader_.progress();
  }

private:
  /// Parameter k's value (a DTensor P on `mesh`, the parameter's unsharded placements) and its optimizer
  /// state; k is advanced.
  template <class P, class M>
  loaded_t<P> load_param(std::int64_t& k, std::type_identity<P>, const M& mesh,
                         const typename P::shape_type& global, Device device, optim::ParamState& st) {
    using PS = typename with_element<optim::state_t<typename P::value_type>, P>::type;
    const std::string name = "param/" + std::to_string(k);
    checkpoint::Reader& part = reader_.part_of(name);
    const auto& saved = part.tensor(name);
    DTENSOR_CHECK(saved.shape == to_extents(global),
                  "load_training_state: parameter " + std::to_string(k) + " has global shape " +
                      shape_string(to_extents(global)) + ", the checkpoint's " +
                      AnyTensor::to_string(saved.shape) + ": not the same model");
    P value = part.template load<P>(name, mesh, device);
    std::vector<std::optional<PS>> state(5);
    for (int i = 0; i < 5; ++i) {
      const std::string sn = std::string(optimizer_state_names[i]) + "/" + std::to_string(k);
      if (reader_.contains(sn)) {
        state[static_cast<std::size_t>(i)].emplace(reader_.part_of(sn).template load<PS>(sn, mesh, device));
      }
    }
    st.step = reader_.steps(k);
    ++k;
    return {std::move(value), std::move(state)};
  }

  StateReader reader_;
  Opt& opt_;
};

/// Writes parts.json (the count of parts) into `tmp`, synced with the directory.
inline void write_parts_list(const std::filesystem::path& tmp, int parts) {
  const std::string text = nlohmann::json{{"parts", parts}}.dump() + "\n";
  checkpoint::File out(tmp / "parts.json", O_WRONLY | O_CREAT | O_TRUNC);
  out.write_all(text.data(), text.size());
  out.sync();
  checkpoint::sync_directory(tmp);
}

/// Saves a rank's part of a training state saved in parts (`named`: its part's tensors, on the part's
/// world) as part `across.rank()` of `dir`. Collective over `across` (one rank of each part: a pp group)
/// and each part's world. The parts are written beside `dir` and published together in one rename: a
/// reader sees the previous state or this one, whole.
inline void save_state_parts(const std::filesystem::path& dir, const std::vector<checkpoint::Named>& named,
                             const ProcessGroup& across) {
  namespace fs = std::filesystem;
  const fs::path tmp = checkpoint::detail::sibling(dir, ".tmp");
  const ProcessGroup& world = named.front().world();
  const ObjectOptions on{named.front().device()};
  checkpoint::save(tmp / state_part_name(across.rank()), named);
  (void)all_gather_object(std::string(), across, on); // every part is in
  std::string error;
  if (across.rank() == 0 && world.rank() == 0) {
    try {
      for (const auto& e : fs::directory_iterator(tmp)) { // an interrupted save's other parts
        const std::string name = e.path().filename().string();
        int i = -1;
        if (std::sscanf(name.c_str(), "part-%d", &i) != 1 || name != state_part_name(i) ||
            i >= across.size()) {
          fs::remove_all(e.path());
        }
      }
      write_parts_list(tmp, across.size());
      checkpoint::detail::swap_in(tmp, dir);
    } catch (const std::exception& e) {
      error = "save_training_state " + dir.string() + ": " + e.what();
    }
  }
  for (const ProcessGroup* g : {&across, &world}) { // the outcome to every rank
    for (const std::string& e : all_gather_object(error, *g, on)) {
      error = error.empty() ? e : error;
    }
  }
  DTENSOR_CHECK(error.empty(), error);
}

/// save_state_parts in the background (checkpoint/async_save.hpp): the parts' directories made and the
/// blocks copied on this thread, the files, indexes, parts.json and the one rename on threads.
inline checkpoint::PendingSave save_state_parts_async(const std::filesystem::path& dir,
                                                      const std::vector<checkpoint::Named>& named,
                                                      const ProcessGroup& across) {
  namespace fs = std::filesystem;
  const ProcessGroup& world = named.front().world();
  const Device device = named.front().device();
  checkpoint::detail::check_save(dir, named, {});
  Store* store = world.backend().job_store();
  if (store == nullptr) {
    return checkpoint::PendingSave::now([&] { save_state_parts(dir, named, across); });
  }
  const fs::path tmp = checkpoint::detail::sibling(dir, ".tmp");
  const bool leader = world.rank() == 0; // writes its part's index
  checkpoint::detail::on_rank0(across, device, [&] {
    if (leader) { // the publisher (part 0's leader): an empty tmp
      fs::remove_all(tmp);
      fs::create_directories(tmp);
    }
  });
  checkpoint::detail::on_rank0(world, device, [&] {
    checkpoint::detail::prepare_save(dir / state_part_name(across.rank()),
                                     tmp / state_part_name(across.rank()), named);
  });
  const int parts = across.size();
  auto publish = [tmp, parts] { write_parts_list(tmp, parts); };
  const checkpoint::detail::SaveSlot slot{across.rank(), parts, state_part_name(across.rank())};
  return checkpoint::PendingSave([dir, tmp, snap = checkpoint::detail::snapshots(named), store, slot,
                                  keys = checkpoint::detail::collective_key("async_save", dir),
                                  publish](const std::atomic<bool>& cancel) {
    return checkpoint::detail::finish_async_save(dir, tmp, snap, {}, slot, *store, keys, publish, cancel);
  });
}

/// The tensors of the training state of `sources` (StateWriter's), in order. Collective over the sources'
/// mesh for an FSDP group.
template <class Opt, class... Sources>
std::vector<checkpoint::Named> state_tensors(const Opt& opt, const TrainingProgress& progress,
                                             const Sources&... sources) {
  StateWriter<Opt> writer(opt);
  int index = 0; // the optimizer index of the leaf
  std::int64_t params = 0;
  auto leaf = [&](const auto& s) {
    writer.add(s, index++, params);
    params += leaf_params<std::remove_cvref_t<decltype(s)>>;
  };
  (for_each_source(sources, leaf), ...);
  std::vector<checkpoint::Named> named;
  bool done = false;
  auto finish = [&](const auto& s) {
    if (!std::exchange(done, true)) {
      named = writer.finish(s.mesh(), params, progress);
    }
  };
  (for_each_source(sources, finish), ...);
  DTENSOR_CHECK(done, "save_training_state: no parameters");
  return named;
}

/// The tensors of a pipeline stage's part of the training state (nn::PipelineTrainer's for_each_state).
template <class Trainer, class Opt>
std::vector<checkpoint::Named> stage_state_tensors(Trainer& trainer, const Opt& opt,
                                                   const TrainingProgress& progress) {
  StateWriter<Opt> writer(opt);
  trainer.for_each_state([&](const auto& g, int index, std::int64_t first) { writer.add(g, index, first); });
  return writer.finish(trainer.mesh(), trainer.parameter_count(), progress);
}

} // namespace detail

/// Saves the training state into the checkpoint directory `dir` (see the top of this file). Collective over
/// the sources' mesh.
template <class Opt, class... Sources>
void save_training_state(const std::filesystem::path& dir, const Opt& opt, const TrainingProgress& progress,
                         const Sources&... sources) {
  checkpoint::save(dir, detail::state_tensors(opt, progress, sources...));
}

/// Loads the training state saved by save_training_state (or by nn::PipelineTrainer, in parts) into the
/// sources (the same model's parameters, on any mesh and layout: DTensors get their values in place, FSDP
/// groups their shards) and the optimizer (each leaf's state at its index), and returns the progress.
/// Reads only what this rank holds.
template <class Opt, class... Sources>
TrainingProgress load_training_state(const std::filesystem::path& dir, Opt& opt, Sources&&... sources) {
  detail::StateLoader<Opt> loader(dir, opt);
  int index = 0;
  std::int64_t params = 0;
  auto leaf = [&](auto& s) {
    loader.load(s, index++, params);
    params += detail::leaf_params<std::remove_cvref_t<decltype(s)>>;
  };
  (detail::for_each_source(sources, leaf), ...);
  return loader.finish(params);
}

} // namespace dtensor

namespace dtensor {

/// Saves a trainer's training state into `dir`: nn::DdpTrainer's and nn::FsdpTrainer's (their state())
/// as one checkpoint, nn::PipelineTrainer's in one part per pp rank (for_each_state: each stage's groups
/// under the model's parameter numbers). Collective over every rank of the trainer.
template <class Trainer, class Opt>
requires(!std::is_convertible_v<Trainer&, std::filesystem::path>) void save_training_state(
    Trainer& trainer, const std::filesystem::path& dir, const Opt& opt, const TrainingProgress& progress) {
  if constexpr (requires { trainer.pp_group(); }) {
    detail::save_state_parts(dir, detail::stage_state_tensors(trainer, opt, progress), trainer.pp_group());
  } else {
    std::apply([&](auto&... s) { save_training_state(dir, opt, progress, s...); }, trainer.state());
  }
}

/// save_training_state(trainer, ...) in the background (checkpoint/async_save.hpp): on this thread the
/// state's tensors are gathered (an FSDP group's shards: a collective, as in the synchronous save) and
/// copied to the host; threads write them and publish `dir` in one rename while training goes on, so a
/// state the next step changes is saved with the values of this call. Collective over every rank of the
/// trainer; wait() on the result (on every rank) before the next save of `dir`.
template <class Trainer, class Opt>
requires(!std::is_convertible_v<Trainer&, std::filesystem::path>) checkpoint::PendingSave
    save_training_state_async(Trainer& trainer, const std::filesystem::path& dir, const Opt& opt,
                              const TrainingProgress& progress) {
  if constexpr (requires { trainer.pp_group(); }) {
    return detail::save_state_parts_async(dir, detail::stage_state_tensors(trainer, opt, progress),
                                          trainer.pp_group());
  } else {
    return std::apply(
        [&](auto&... s) { return checkpoint::save_async(dir, detail::state_tensors(opt, progress, s...)); },
        trainer.state());
  }
}

/// Loads a training state saved by any trainer of the same model (or by save_training_state's sources)
/// into `trainer` and `opt`: the layout, the trainer and the pipeline's cut may differ. The progress.
template <class Trainer, class Opt>
requires(!std::is_convertible_v<Trainer&, std::filesystem::path>) TrainingProgress
    load_training_state(Trainer& trainer, const std::filesystem::path& dir, Opt& opt) {
  if constexpr (requires { trainer.pp_group(); }) {
    detail::StateLoader<Opt> loader(dir, opt);
    trainer.for_each_state([&](auto& g, int index, std::int64_t first) { loader.load(g, index, first); });
    return loader.finish(trainer.parameter_count());
  } else {
    return std::apply([&](auto&... s) { return load_training_state(dir, opt, s...); }, trainer.state());
  }
}

} // namespace dtensor
