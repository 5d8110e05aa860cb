#pragma once
// nn::PipelineTrainer: the training step of any model of the contract (nn/contract.hpp) pipelined over a
// pp group, FSDP (or HSDP) and the model's own tensor, sequence and context parallelism inside each stage:
// PP x FSDP x TP.
//
//   using Mesh = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
//   const auto mesh = init_device_mesh<Mesh>(world, 2, 2, 2);
//   const auto stage = mesh.slice<"dp", "tp">();                 // the model lives on (dp, tp)
//   nn::LanguageModel<float, L, nn::TransformerBlock> gpt(stage, config, layers, keys);
//   nn::PipelineTrainer<decltype(gpt), Fsdp<"dp">> trainer(mesh.group<"pp">(), stage, std::move(gpt),
//       {.schedule = Schedule::interleaved_one_f_one_b, .chunks = 2});    // or zero_bubble_h1, zero_bubble_v
//   nn::StepResult r = trainer.step(std::span(micro_batches), opt);   // m (input, target) pairs
//   double val = trainer.loss(input, target);                         // forward only, every rank
//   save_training_state(trainer, dir, opt, progress);   // train/train_state.hpp: one part per pp rank
//
// The stages are cut at unit boundaries: the model's units() holds one run of blocks (a std::vector), split
// into p v model stages (p the pp group's size, v = chunks; pipeline_layers: the first `blocks % (p v)`
// stages get one block more); the units before the run go with model stage 0, those after it with the last.
// pp rank s holds the chunks of model stages c p + s (ZB-V: s and 2p - 1 - s). The constructor keeps this rank's units, one
// FlatParamGroup per unit with parameters (as nn::FsdpTrainer groups them), sharded by Policy over the
// stage's mesh; the other units' parameters are released. A step runs the m micro-batches in the schedule's
// order (run_pipeline, train/pipeline_run.hpp) with the run's activations (in C) crossing each boundary:
//   - FSDP inside a stage: every group's all_gather is started at the beginning of the step (all of this
//     rank's groups, one pipeline stage's worth of parameters) and waited for at first use; the groups stay
//     gathered for all m micro-batches; the first m - 1 backwards of a chunk accumulate their gradients
//     unsharded and its last reduce_scatters the sum (once per step, not per micro-batch: see
//     pipeline_run.hpp for why).
//   - With options.recompute each block keeps only its input and runs its forward again in its backward.
//   - Under ZB-H1 and ZB-V (splits_backward) a chunk's backward is B, each unit's backward split
//     (nn::forward_split: the blocks' weight GEMMs deferred), and its W delivers the units' gradients; the
//     gradients are those of the fused backward bit for bit.
//   - The loss of micro-batch k is scaled by 1 / m, so the step equals one on the m micro-batches together
//     (nn::DdpTrainer's and nn::FsdpTrainer's step on the same span).
//   - The clip is by the global norm over every stage: each stage's sum of squares (total_norm over its
//     mesh) and the last stage's loss are added over pp in one all_reduce of two doubles, so every rank
//     reports the same loss and norm.
//   - The optimizer's parameter indices are nn::FsdpTrainer's: the groups in the order of the units.
// Every rank passes the same micro-batches (stage 0 reads the inputs, the last stage the targets). A dry run
// (dtensor::dry_run: no neighbour sends the activations' shapes) needs the model's boundary_shape(input),
// the global shape of what crosses a boundary (nn::LanguageModel: (batch, sequence, hidden)). A trainer
// holds references into its own members: it is neither copied nor moved.
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/train/clip.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/pipeline_run.hpp"
#include "dtensor/train/pipeline_schedule.hpp"
#include "dtensor/train/trainer.hpp"

namespace dtensor::nn {

/// How nn::PipelineTrainer runs a step.
struct PipelineTrainerOptions {
  Schedule schedule = Schedule::one_f_one_b;
  int chunks = 1;        ///< model stages per pp rank (v: any under interleaved 1F1B, 2 under ZB-V, else 1)
  double max_norm = 1.0; ///< clip_grad_norm's bound over every stage (infinity: no clipping)
  /// Activation recomputation (Megatron's --recompute-activations, torch's activation checkpointing): a
  /// block keeps only its input from its forward and runs the forward again in its backward. A stage then
  /// holds one activation per block and micro-batch in flight instead of every intermediate, for one more
  /// forward of the blocks a step.
  bool recompute = false;
};

namespace detail {

/// The index of the one run (a std::vector) among a model's units (the elements' count: none, or several).
template <class Units>
constexpr std::size_t run_index() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    std::size_t found = sizeof...(I), count = 0;
    ((is_unit_run<std::remove_cvref_t<std::tuple_element_t<I, Units>>>::value ? (found = I, ++count) : 0),
     ...);
    return count == 1 ? found : sizeof...(I);
  }
  (std::make_index_sequence<std::tuple_size_v<Units>>{});
}

/// A chunk's holding of element E's group(s): the run's groups (this chunk's blocks), or an end unit's group
/// when this chunk holds it.
template <class G>
struct chunk_holding {
  using type = std::optional<G>;
};
template <class G, class A>
struct chunk_holding<std::vector<G, A>> {
  using type = std::vector<G, A>;
};
template <class Groups>
struct chunk_groups;
template <class... G>
struct chunk_groups<std::tuple<G...>> {
  using type = std::tuple<typename chunk_holding<G>::type...>;
};

} // namespace detail

/// PP x FSDP x TP training of any model of the contract (see the top of the file). C is the compute type:
/// the gathered parameters and the activations that cross the stages.
template <class Model, class Policy, class C = detail::value_or_void_t<Model>,
          class ReduceT = detail::value_or_void_t<Model>>
class PipelineTrainer {
  static_assert(check_model<Model>());
  using T = model_value_t<Model>;
  using Mesh = model_mesh_t<Model>;
  using Units = units_t<Model>;
  static constexpr std::size_t kElements = std::tuple_size_v<Units>;
  static constexpr std::size_t kRun = detail::run_index<Units>();
  static_assert(
      kRun < kElements,
      "nn::PipelineTrainer: the model's units() holds exactly one run of blocks (a std::vector) to cut "
      "into stages; the units before it go with the first stage, those after it with the last");
  using Groups = detail::model_groups_t<Model, Policy, ReduceT, C>;
  using ChunkGroups = typename detail::chunk_groups<Groups>::type;

  /// One model stage of this rank: its blocks [first, last) of the run, and the units before or after the
  /// run with the ends.
  struct Chunk {
    int stage = 0, first = 0, last = 0;
    ChunkGroups groups;
    int backwards = 0; ///< this step's backwards (B under a splitting schedule) so far
    int weights = 0;   ///< this step's W's so far (splitting schedules)
  };
  /// A chunk's W's of one micro-batch: each unit's gradients delivered to its group.
  using Weights = std::vector<std::function<void()>>;

  void check_chunks(const PipelineTrainerOptions& o) const {
    const bool ok = o.schedule == Schedule::interleaved_one_f_one_b
                        ? o.chunks >= 1
                        : o.chunks == (o.schedule == Schedule::zero_bubble_v ? 2 : 1);
    DTENSOR_CHECK(ok, "nn::PipelineTrainer: " + std::to_string(o.chunks) + " chunks per pp rank under " +
                          schedule_name(o.schedule) +
                          "; several chunks need interleaved 1F1B, and ZB-V runs exactly 2");
  }

public:
  using model_type = Model;

  PipelineTrainer(const ProcessGroup& pp, const DeviceMesh<Mesh>& stage_mesh, Model model,
                  PipelineTrainerOptions options = {})
      : pp_(pp), mesh_(stage_mesh), options_(options), model_(std::move(model)) {
    check_chunks(options);
    const int p = pp.size(), s = pp.rank(), stages = p * options.chunks;
    auto units = model_.units();
    const int layers = int(std::get<kRun>(units).size());
    chunks_.resize(std::size_t(options.chunks));
    for (int c = 0; c < options.chunks; ++c) {
      Chunk& k = chunks_[std::size_t(c)];
      k.stage = pipeline_stage(options.schedule, p, s, c);
      std::tie(k.first, k.last) = pipeline_layers(layers, stages, k.stage); // says how they split
      hold(k, units, stages, std::make_index_sequence<kElements>{});
    }
    // The groups hold this rank's parameters; the others are not needed.
    for_each_unit(units, [](auto& u, auto, std::size_t) { release_parameters(u); });
  }
  PipelineTrainer(const PipelineTrainer&) = delete;
  PipelineTrainer& operator=(const PipelineTrainer&) = delete;

  const DeviceMesh<Mesh>& mesh() const noexcept { return mesh_; }
  const ProcessGroup& pp_group() const noexcept { return pp_; }
  /// The options; changes apply from the next step (the chunks stay those the constructor split by).
  PipelineTrainerOptions& options() noexcept { return options_; }
  /// The last step's pipeline run on this rank: its order, its time and the time in the chunks.
  const PipelineRunStats& last_run() const noexcept { return last_run_; }
  /// This rank's model stages and their blocks [first, last) of the run.
  std::vector<std::tuple<int, int, int>> stages() const {
    std::vector<std::tuple<int, int, int>> out;
    for (const Chunk& k : chunks_) {
      out.emplace_back(k.stage, k.first, k.last);
    }
    return out;
  }

  /// One training step on the micro-batches (input, target) (see the top of the file). blocked_seconds is
  /// the time this rank spent inside the pipeline outside its chunks: waiting for its neighbours and the
  /// exchanges (the bubble); the FSDP all_gathers' waits are inside the chunks' first forwards.
  template <class Batch, std::size_t E, class Optimizer>
  StepResult step(std::span<Batch, E> micro, Optimizer& opt) {
    DTENSOR_CHECK(!micro.empty(), "nn::PipelineTrainer::step: no micro-batch to train on");
    const MemoryCategoryScope category(MemoryCategory::activations); // the groups' own say what else is what
    for_each_group([](auto& g) { (void)g.unshard(async_op); });      // waited for at first use
    using Act = act_of<std::remove_cvref_t<decltype(micro[0].first)>>;
    const int m = int(micro.size());
    check_chunks(options_);
    for (const Chunk& k : chunks_) { // the stages were cut for the constructor's schedule
      DTENSOR_CHECK(k.stage ==
                        pipeline_stage(options_.schedule, pp_.size(), pp_.rank(), int(&k - &chunks_[0])),
                    std::string("nn::PipelineTrainer::step: ") + schedule_name(options_.schedule) +
                        " places the chunks on other model stages than the schedule this trainer was built "
                        "for (ZB-V's V against Megatron's interleaving)");
    }
    const bool split = splits_backward(options_.schedule);
    double loss = 0;
    std::map<std::pair<int, int>, std::function<std::optional<Act>(std::optional<Act>)>> pending;
    std::map<std::pair<int, int>, std::shared_ptr<Weights>> pending_weights;
    PipelineChunks<Act> fns;
    fns.forward = [&](int c, int mb, std::optional<Act> in) {
      std::shared_ptr<Weights> w;
      if (split) {
        w = pending_weights[{c, mb}] = std::make_shared<Weights>();
      }
      return forward(chunks_[std::size_t(c)], micro[std::size_t(mb)], std::move(in), m, loss,
                     &pending[{c, mb}], std::move(w));
    };
    fns.backward = [&](int c, int mb, std::optional<Act> dout) {
      const auto it = pending.find({c, mb});
      auto din = it->second(std::move(dout));
      pending.erase(it);
      ++chunks_[std::size_t(c)].backwards;
      return din;
    };
    if (split) {
      fns.weight = [&](int c, int mb) {
        const auto it = pending_weights.find({c, mb});
        for (auto& w : *it->second) {
          w();
        }
        pending_weights.erase(it);
        ++chunks_[std::size_t(c)].weights;
      };
    }
    last_run_ = run_pipeline(pp_, mesh_, fns,
                             {.schedule = options_.schedule,
                              .shape = {.stages = pp_.size(), .microbatches = m, .chunks = options_.chunks},
                              .device = device(),
                              .boundary_shape = boundary_shape([&](int mb) -> const auto& {
                                return micro[std::size_t(mb)].first;
                              })});
    for (Chunk& k : chunks_) {
      DTENSOR_CHECK(k.backwards == m && (!split || k.weights == m),
                    "nn::PipelineTrainer::step: model stage " + std::to_string(k.stage) + " ran " +
                        std::to_string(k.backwards) + " backwards and " + std::to_string(k.weights) +
                        " W's of " + std::to_string(m) + " micro-batches");
      k.backwards = 0;
      k.weights = 0;
    }
    // The global norm: each stage's sum of squares (total_norm over the stage's mesh) and the last stage's
    // loss added over pp in one all_reduce.
    const auto held = held_groups();
    const double stage_norm = std::apply([](const auto&... g) { return total_norm(l2_norm, g...); }, held);
    Tensor<double, 1> host({2});
    host.data()[0] = stage_norm * stage_norm;
    host.data()[1] = loss;                                                  // 0 but on the last stage
    Tensor<double, 1> sums = device().is_cuda() ? host.to(device()) : host; // meta: the host's, with NaN
    all_reduce(sums, ReduceOp::sum, pp_);
    const Tensor<double, 1> total = device().is_cuda() ? sums.to(Device::cpu()) : sums;
    StepResult result;
    result.loss = total.data()[1];
    result.grad_norm = std::sqrt(total.data()[0]);
    result.blocked_seconds = last_run_.total_s - last_run_.compute_s;
    std::apply([&](const auto&... g) { clip_grads_with_norm(options_.max_norm, result.grad_norm, g...); },
               held);
    for (Chunk& k : chunks_) { // the optimizer's indices: nn::FsdpTrainer's
      for_each_group_of(k, [&](auto& g, int index) {
        g.reshard();
        opt.step(index, g);
        g.zero_grad();
      });
    }
    return result;
  }
  /// One step on one micro-batch (no pipelining: the stages run one after the other).
  template <class Input, class Target, class Optimizer>
  StepResult step(const Input& input, const Target& target, Optimizer& opt) {
    const std::pair<Input, Target> one{input, target};
    return step(std::span(&one, 1), opt);
  }

  /// The mean loss of one batch, no backward: a forward-only pass through the stages; every rank returns
  /// it. The groups are gathered for it and resharded after.
  template <class Input, class Target>
  double loss(const Input& input, const Target& target) {
    for_each_group([](auto& g) { (void)g.unshard(async_op); });
    const std::pair<Input, Target> one{input, target};
    using Act = act_of<Input>;
    double loss = 0;
    PipelineChunks<Act> fns;
    fns.forward = [&](int c, int, std::optional<Act> in) {
      return forward<Act>(chunks_[std::size_t(c)], one, std::move(in), 1, loss, nullptr);
    };
    (void)run_pipeline(pp_, mesh_, fns,
                       {.schedule = options_.schedule, // where the chunks are (ZB-V's V)
                        .shape = {.stages = pp_.size(), .microbatches = 1, .chunks = options_.chunks},
                        .device = device(),
                        .forward_only = true,
                        .boundary_shape = boundary_shape([&](int) -> const auto& { return input; })});
    for_each_group([](auto& g) { g.reshard(); });
    Tensor<double, 1> sum = Tensor<double, 1>::full({1}, loss, device().is_cuda() ? device() : Device::cpu());
    all_reduce(sum, ReduceOp::sum, pp_);
    return sum.item();
  }

  /// f(index, w) for every parameter of this rank's units, gathered (w a DTensor of its declared
  /// placements on the stage mesh, in the compute type): index is its place in nn::model_parameters' order.
  /// The groups are resharded after.
  template <class F>
  void for_each_parameter(F&& f) {
    for_each_state([&](auto& g, int, std::int64_t first) {
      g.unshard();
      int i = int(first);
      std::apply([&](const auto&... w) { (f(i++, w), ...); }, g.params());
      g.reshard();
    });
  }

  /// f(group, optimizer index, first) for every group this rank holds, in the order of the units: first is
  /// the number of the group's first parameter in nn::model_parameters' order. What
  /// save_training_state(trainer, ...) saves (train/train_state.hpp: one part per pp rank).
  template <class F>
  void for_each_state(F&& f) {
    const auto firsts = element_firsts();
    constexpr int per_block =
        int(detail::unit_param_count<detail::unit_of_t<std::tuple_element_t<kRun, Units>>>);
    for (Chunk& k : chunks_) {
      for_each_group_of(k, [&](auto& g, int index, std::size_t element, int block) {
        f(g, index, std::int64_t(firsts[element]) + (element == kRun ? block * per_block : 0));
      });
    }
  }
  /// The model's parameters, every stage's.
  std::int64_t parameter_count() { return element_firsts().back(); }

private:
  /// What crosses a stage boundary for an input of type Input: the run's input in C.
  template <class Input>
  using act_of = std::remove_cvref_t<decltype(std::declval<PipelineTrainer&>().template ends_forward<0, kRun>(
      std::declval<Chunk&>(), detail::in_compute_type<C>(std::declval<const Input&>())))>;

  /// run_pipeline's boundary_shape from the model's boundary_shape(input), where it has one (a dry run
  /// needs it).
  template <class InputOf>
  std::function<std::vector<std::int64_t>(int)> boundary_shape(InputOf input_of) const {
    if constexpr (requires { model_.boundary_shape(input_of(0)); }) {
      return
          [this, input_of](int mb) { return std::vector<std::int64_t>(model_.boundary_shape(input_of(mb))); };
    } else {
      return {};
    }
  }

  /// The parameters' device (every model stage holds a block: pipeline_layers gives each at least one).
  Device device() const { return std::get<kRun>(chunks_.front().groups).front().local_param().device(); }

  /// Chunk k's groups: its blocks of the run, and the units before the run (model stage 0) or after it (the
  /// last model stage).
  template <std::size_t... I>
  void hold(Chunk& k, Units& units, int stages, std::index_sequence<I...>) {
    (hold_element<I>(k, std::get<I>(units), stages), ...);
  }
  template <std::size_t I, class E>
  void hold_element(Chunk& k, E& e, int stages) {
    using G = std::tuple_element_t<I, Groups>;
    auto& held = std::get<I>(k.groups);
    if constexpr (I == kRun) {
      for (int b = k.first; b < k.last; ++b) {
        held.push_back(detail::group_of_unit<typename G::value_type>(e[std::size_t(b)]));
      }
    } else if ((I < kRun && k.stage == 0) || (I > kRun && k.stage == stages - 1)) {
      held.emplace(detail::group_of_unit<G>(e));
    }
  }

  /// f(group, optimizer index, element, block) for each group chunk k holds, in the order of the units.
  template <class F>
  void for_each_group_of(Chunk& k, F&& f) {
    int index = 0; // the groups before the element over the whole model
    visit_groups(k, f, index, std::make_index_sequence<kElements>{});
  }
  template <class F, std::size_t... I>
  void visit_groups(Chunk& k, F& f, int& index, std::index_sequence<I...>) {
    (visit_group<I>(k, f, index), ...);
  }
  template <std::size_t I, class F>
  void visit_group(Chunk& k, F& f, int& index) {
    using G = std::tuple_element_t<I, Groups>;
    auto& held = std::get<I>(k.groups);
    if constexpr (I == kRun) {
      for (std::size_t b = 0; b < held.size(); ++b) {
        call(f, held[b], index + k.first + int(b), I, k.first + int(b));
      }
      index += blocks();
    } else if constexpr (!std::is_same_v<G, std::tuple<>>) {
      if (held) {
        call(f, *held, index, I, 0);
      }
      ++index;
    }
  }
  template <class F, class G>
  static void call(F& f, G& g, int index, std::size_t element, int block) {
    if constexpr (std::is_invocable_v<F&, G&, int, std::size_t, int>) {
      f(g, index, element, block);
    } else {
      f(g, index);
    }
  }

  int blocks() { return int(std::get<kRun>(model_.units()).size()); }

  /// Each element's first parameter number in nn::model_parameters' order, and the count after the last.
  std::array<int, kElements + 1> element_firsts() {
    std::array<int, kElements + 1> firsts{};
    int first = 0;
    for_each_unit(model_.units(), [&](auto& u, auto element, std::size_t j) {
      if (j == 0) {
        firsts[element] = first;
      }
      first += int(detail::unit_param_count<std::remove_cvref_t<decltype(u)>>);
    });
    firsts[kElements] = first;
    return firsts;
  }

  template <class F>
  void for_each_group(F&& f) {
    for (Chunk& k : chunks_) {
      for_each_group_of(k, [&](auto& g, int) { f(g); });
    }
  }

  /// Handles of every group this rank holds (copies share the groups' state), by element: what total_norm
  /// and the clip take.
  auto held_groups() { return held_groups(std::make_index_sequence<kElements>{}); }
  template <std::size_t... I>
  auto held_groups(std::index_sequence<I...>) {
    return std::tuple_cat(held_of<I>()...);
  }
  /// Element I's groups over this rank's chunks: a tuple of one vector, or of none (no parameters).
  template <std::size_t I>
  auto held_of() {
    using G = std::tuple_element_t<I, Groups>;
    if constexpr (I == kRun) {
      G all;
      for (Chunk& k : chunks_) {
        const auto& held = std::get<I>(k.groups);
        all.insert(all.end(), held.begin(), held.end());
      }
      return std::tuple{std::move(all)};
    } else if constexpr (std::is_same_v<G, std::tuple<>>) {
      return std::tuple<>{};
    } else {
      std::vector<G> all;
      for (Chunk& k : chunks_) {
        if (const auto& held = std::get<I>(k.groups)) {
          all.push_back(*held);
        }
      }
      return std::tuple{std::move(all)};
    }
  }

  /// A unit's gradients (or, split, its W) to deliver now, or with `weights` at the chunk's W.
  template <class Group, class Last, class G>
  static void hand(Group& group, Last last, G g, Weights* weights) {
    const auto now = [&group, last](const auto& grads) {
      if constexpr (std::invocable<decltype(grads)>) {
        deliver(group, last(), grads());
      } else {
        deliver(group, last(), grads);
      }
    };
    if (weights != nullptr) {
      weights->push_back([g = std::move(g), now] { now(g); });
    } else {
      now(g);
    }
  }

  /// A unit's gradients into its group: accumulated unsharded, reduce_scattered with the chunk's last
  /// backward (W under a splitting schedule) of the step.
  template <class Group, class Grads>
  static void deliver(Group& group, bool last, const Grads& g) {
    if constexpr (!std::is_same_v<Group, std::tuple<>>) {
      std::apply(
          [&](const auto&... d) { last ? group.reduce_gradients(d...) : group.accumulate_gradients(d...); },
          g);
    }
  }

  /// Unit u on group g's gathered parameters.
  template <class U, class G>
  static auto on_params(const U& u, G& g) {
    if constexpr (std::is_same_v<G, std::tuple<>>) {
      return u;
    } else {
      return std::apply([&](const auto&... p) { return u.with_parameters(p...); }, g.params());
    }
  }

  /// Elements I..End of the units on x with chunk k's groups, no backward: their output.
  template <std::size_t I, std::size_t End, class X>
  auto ends_forward(Chunk& k, const X& x) {
    if constexpr (I == End) {
      return x;
    } else {
      return ends_forward<I + 1, End>(
          k, detail::forward_only(on_params(std::get<I>(model_.units()), *std::get<I>(k.groups)), x));
    }
  }
  /// Elements I..End of the units on x with chunk k's groups and their backward: {y, back}, back(dy) x's
  /// gradient, the units' gradients delivered to their groups (reduced when last() says so).
  template <std::size_t I, std::size_t End, class X, class Last>
  auto ends_backprop(Chunk& k, const X& x, Last last, std::shared_ptr<Weights> weights) {
    if constexpr (I == End) {
      return std::pair{x, std::function<X(const X&)>([](const X& d) { return d; })};
    } else {
      auto& group = *std::get<I>(k.groups);
      auto [y, back] = on_params(std::get<I>(model_.units()), group).forward(x, with_backward);
      auto [z, rest] = ends_backprop<I + 1, End>(k, y, last, weights);
      using Z = decltype(z);
      auto chain = [back = std::move(back), rest = std::move(rest), &group, last, weights](const Z& dz) {
        auto [dx, g] = back(rest(dz));
        hand(group, last, std::move(g), weights.get());
        return dx;
      };
      using DX = decltype(chain(std::declval<const Z&>()));
      return std::pair{std::move(z), std::function<DX(const Z&)>(std::move(chain))};
    }
  }

  /// The forward of chunk k on one micro-batch (`in`: the previous stage's output; none on stage 0), its
  /// loss scaled by 1 / m added to `loss` on the last stage. With `backward` set, the chunk's backward
  /// is left there: it takes the next stage's input gradient (none on the last) and returns this one's
  /// (none on stage 0), delivering the units' gradients to their groups.
  template <class Act, class Batch>
  Act forward(Chunk& k, const Batch& batch, std::optional<Act> in, int m, double& loss,
              std::function<std::optional<Act>(std::optional<Act>)>* backward,
              std::shared_ptr<Weights> weights = nullptr) {
    const bool grads = backward != nullptr;
    const double scale = 1.0 / m;
    // Whether a delivery is the chunk's last of the step: at its last backward, or split at its last W.
    const bool split = weights != nullptr;
    const auto last = [&k, m, split] { return (split ? k.weights : k.backwards) + 1 == m; };
    std::function<void(const Act&)> prologue_back;
    Act h = in ? std::move(*in) : [&]() -> Act {
      const auto input = detail::in_compute_type<C>(batch.first);
      if (!grads) {
        return ends_forward<0, kRun>(k, input);
      }
      auto [x, back] = ends_backprop<0, kRun>(k, input, last, weights);
      prologue_back = [back = std::move(back)](const Act& dh) { (void)back(dh); };
      return x;
    }();
    auto& run = std::get<kRun>(model_.units());
    auto& groups = std::get<kRun>(k.groups);
    std::vector<std::function<Act(const Act&)>> block_backs;
    for (std::size_t b = 0; b < groups.size(); ++b) {
      auto& group = groups[b];
      const auto& block = run[std::size_t(k.first) + b];
      const auto layer = on_params(block, group);
      if (!grads) {
        h = detail::forward_only(layer, h);
        continue;
      }
      if (options_.recompute) {
        Act input = h;
        h = detail::forward_only(layer, input);
        block_backs.push_back([&block, &group, input = std::move(input), last, weights](const Act& dy) {
          const auto l = on_params(block, group);
          if (weights) {
            auto [dx, w] = forward_split(l, input).backward(dy);
            hand(group, last, std::move(w), weights.get());
            return dx;
          }
          auto [dx, g] = l.forward(input, with_backward).backward(dy);
          hand(group, last, std::move(g), nullptr);
          return dx;
        });
        continue;
      }
      if (split) {
        auto [y, back] = forward_split(layer, h);
        block_backs.push_back([back = std::move(back), &group, last, weights](const Act& dy) {
          auto [dx, w] = back(dy);
          hand(group, last, std::move(w), weights.get());
          return dx;
        });
        h = std::move(y);
        continue;
      }
      auto [y, back] = layer.forward(h, with_backward);
      block_backs.push_back([back = std::move(back), &group, last](const Act& dy) {
        auto [dx, g] = back(dy);
        hand(group, last, std::move(g), nullptr);
        return dx;
      });
      h = std::move(y);
    }
    std::function<Act()> epilogue_back;
    if (k.stage == pp_.size() * options_.chunks - 1) {
      const auto target = detail::in_compute_type<C>(batch.second);
      const auto loss_function = model_.loss_function();
      if (!grads) {
        loss += scale * scalar_value(loss_function(ends_forward<kRun + 1, kElements>(k, h), target));
        return h;
      }
      auto [y, back] = ends_backprop<kRun + 1, kElements>(k, h, last, weights);
      auto [l, loss_back] = loss_function(y, target, with_backward);
      loss += scale * scalar_value(l);
      epilogue_back = [back = std::move(back), loss_back = std::move(loss_back), scale]() {
        return back(loss_back(scale));
      };
    }
    if (grads) {
      *backward = [block_backs = std::move(block_backs), epilogue_back = std::move(epilogue_back),
                   prologue_back = std::move(prologue_back)](std::optional<Act> dout) -> std::optional<Act> {
        Act d = epilogue_back ? epilogue_back() : std::move(*dout);
        for (auto it = block_backs.rbegin(); it != block_backs.rend(); ++it) {
          d = (*it)(d);
        }
        if (prologue_back) {
          prologue_back(d);
          return std::nullopt;
        }
        return d;
      };
    }
    return h;
  }

  ProcessGroup pp_;
  DeviceMesh<Mesh> mesh_;
  PipelineTrainerOptions options_;
  Model model_;
  std::vector<Chunk> chunks_;
  PipelineRunStats last_run_;
};

} // namespace dtensor::nn
