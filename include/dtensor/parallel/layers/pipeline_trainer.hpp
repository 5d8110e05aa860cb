#pragma once
// nn::PipelineTrainer: the training step of an nn::LanguageModel pipelined over a pp group, FSDP (or HSDP)
// and the layout's tensor, sequence and context parallelism inside each stage: PP x FSDP x TP.
//
//   using Mesh = MeshShape<Axis<"pp">, Axis<"dp">, Axis<"tp">>;
//   const auto mesh = init_device_mesh<Mesh>(world, 2, 2, 2);
//   const auto stage = mesh.slice<"dp", "tp">();                 // the model's layout L lives on (dp, tp)
//   nn::LanguageModel<float, L, nn::TransformerBlock> gpt(stage, config, layers, keys);
//   nn::PipelineTrainer<decltype(gpt), Fsdp<"dp">> trainer(mesh.group<"pp">(), stage, std::move(gpt),
//       {.schedule = Schedule::interleaved_one_f_one_b, .chunks = 2});
//   nn::StepResult r = trainer.step(std::span(micro_batches), opt);   // m (ids, targets) pairs
//   double val = trainer.loss(ids, targets);                          // forward only, every rank
//
// The model is split into p v model stages (p the pp group's size, v = chunks; pipeline_layers: the first
// `layers % (p v)` stages get one block more); pp rank s holds the chunks of model stages c p + s, the
// embedding with stage 0 and the final norm and head with the last. The constructor keeps this rank's
// layers, one FlatParamGroup per block, one for the embedding, one for the norm and the head (as
// nn::FsdpTrainer groups them), sharded by Policy over the stage's mesh; the other layers' parameters are
// released. A step runs the m micro-batches in the schedule's order (run_pipeline, parallel/pipeline_run.hpp)
// with the activations as act_t<L, C> DTensors crossing each boundary:
//   - FSDP inside a stage: every group's all_gather is started at the beginning of the step (all of this
//     rank's groups, one pipeline stage's worth of parameters) and waited for at first use; the groups stay
//     gathered for all m micro-batches; the first m - 1 backwards of a chunk accumulate their gradients
//     unsharded and its last reduce_scatters the sum (once per step, not per micro-batch: see
//     pipeline_run.hpp for why).
//   - With options.recompute each block keeps only its input and runs its forward again in its backward.
//   - The loss of micro-batch k is scaled by 1 / m, so the step equals one on the m micro-batches together
//     (nn::DdpTrainer's and nn::FsdpTrainer's step on the same span).
//   - The clip is by the global norm over every stage: each stage's sum of squares (total_norm over its
//     mesh) and the last stage's loss are added over pp in one all_reduce of two doubles, so every rank
//     reports the same loss and norm.
//   - The optimizer's parameter indices are nn::FsdpTrainer's: 0 the embedding's group, 1 + b block b's,
//     layers + 1 the head's.
// Every rank passes the same micro-batches (stage 0 reads the ids, the last stage the targets). A trainer
// holds references into its own members: it is neither copied nor moved.
#include <cmath>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/parallel/clip.hpp"
#include "dtensor/parallel/fsdp.hpp"
#include "dtensor/parallel/layers/layout.hpp"
#include "dtensor/parallel/layers/model.hpp"
#include "dtensor/parallel/layers/module.hpp"
#include "dtensor/parallel/layers/trainer.hpp"
#include "dtensor/parallel/pipeline_run.hpp"
#include "dtensor/parallel/pipeline_schedule.hpp"

namespace dtensor::nn {

/// How nn::PipelineTrainer runs a step.
struct PipelineTrainerOptions {
  Schedule schedule = Schedule::one_f_one_b;
  int chunks = 1;        ///< model stages per pp rank (v; more than 1 under interleaved 1F1B only)
  double max_norm = 1.0; ///< clip_grad_norm's bound over every stage (infinity: no clipping)
  /// Activation recomputation (Megatron's --recompute-activations, torch's activation checkpointing): a
  /// block keeps only its input from its forward and runs the forward again in its backward. A stage then
  /// holds one activation per block and micro-batch in flight instead of every intermediate, for one more
  /// forward of the blocks a step.
  bool recompute = false;
};

/// PP x FSDP x TP training of an nn::LanguageModel (see the top of the file). C is the compute type: the
/// gathered parameters and the activations that cross the stages.
template <class Model, class Policy, class C = typename Model::value_type,
          class ReduceT = typename Model::value_type>
class PipelineTrainer {
  using T = typename Model::value_type;
  using L = typename Model::layout_type;
  using Mesh = typename L::mesh_shape;
  using Act = act_t<L, C>;
  using Groups = detail::ModelGroups<Model, Policy, ReduceT, C>;
  using EmbGroup = typename Groups::embedding;
  using BlockGroup = typename Groups::block;
  using HeadGroup = typename Groups::head;
  static constexpr int kEmbParams = 1; // the embedding's weight
  static constexpr int kBlockParams = int(std::tuple_size_v<typename Model::block_type::parameter_types>);

  /// One model stage of this rank: its blocks [first, last), and the embedding or the head with the ends.
  struct Chunk {
    int stage = 0, first = 0, last = 0;
    std::vector<BlockGroup> blocks;
    std::optional<EmbGroup> embedding;
    std::optional<HeadGroup> head;
    int backwards = 0; ///< this step's backwards so far
  };

public:
  using model_type = Model;
  using ids_type = typename Model::ids_type;

  PipelineTrainer(const ProcessGroup& pp, const DeviceMesh<Mesh>& stage_mesh, Model model,
                  PipelineTrainerOptions options = {})
      : pp_(pp), mesh_(stage_mesh), options_(options), model_(std::move(model)),
        hidden_(model_.embedding.weight.global_shape()[1]) {
    DTENSOR_CHECK(options.chunks >= 1 &&
                      (options.chunks == 1 || options.schedule == Schedule::interleaved_one_f_one_b),
                  "nn::PipelineTrainer: " + std::to_string(options.chunks) + " chunks per pp rank under " +
                      schedule_name(options.schedule) + "; several chunks need interleaved 1F1B");
    const int p = pp.size(), s = pp.rank(), stages = p * options.chunks;
    const int layers = int(model_.blocks.size());
    chunks_.resize(std::size_t(options.chunks));
    for (int c = 0; c < options.chunks; ++c) {
      Chunk& k = chunks_[std::size_t(c)];
      k.stage = c * p + s;
      std::tie(k.first, k.last) = pipeline_layers(layers, stages, k.stage); // says how they split
      for (int b = k.first; b < k.last; ++b) {
        k.blocks.push_back(detail::group_of<BlockGroup>(model_.blocks[std::size_t(b)].parameters()));
      }
      if (k.stage == 0) {
        k.embedding.emplace(detail::group_of<EmbGroup>(model_.embedding.parameters()));
      }
      if (k.stage == stages - 1) {
        k.head.emplace(
            detail::group_of<HeadGroup>(std::tuple_cat(model_.norm.parameters(), model_.head.parameters())));
      }
    }
    release_parameters(model_.embedding); // the groups hold this rank's; the others are not needed
    for (auto& b : model_.blocks) {
      release_parameters(b);
    }
    release_parameters(model_.norm);
    release_parameters(model_.head);
  }
  PipelineTrainer(const PipelineTrainer&) = delete;
  PipelineTrainer& operator=(const PipelineTrainer&) = delete;

  const DeviceMesh<Mesh>& mesh() const noexcept { return mesh_; }
  const ProcessGroup& pp_group() const noexcept { return pp_; }
  /// The options; changes apply from the next step (the chunks stay those the constructor split by).
  PipelineTrainerOptions& options() noexcept { return options_; }
  /// The last step's pipeline run on this rank: its order, its time and the time in the chunks.
  const PipelineRunStats& last_run() const noexcept { return last_run_; }
  /// This rank's model stages and their blocks [first, last).
  std::vector<std::tuple<int, int, int>> stages() const {
    std::vector<std::tuple<int, int, int>> out;
    for (const Chunk& k : chunks_) {
      out.emplace_back(k.stage, k.first, k.last);
    }
    return out;
  }

  /// One training step on the micro-batches (see the top of the file). blocked_seconds is the time this
  /// rank spent inside the pipeline outside its chunks: waiting for its neighbours and the exchanges (the
  /// bubble); the FSDP all_gathers' waits are inside the chunks' first forwards.
  template <class Optimizer>
  StepResult step(std::span<const std::pair<ids_type, ids_type>> micro, Optimizer& opt) {
    DTENSOR_CHECK(!micro.empty(), "nn::PipelineTrainer::step: no micro-batch to train on");
    const MemoryCategoryScope category(MemoryCategory::activations); // the groups' own say what else is what
    for_each_group([](auto& g) { (void)g.unshard(async_op); });      // waited for at first use
    const int m = int(micro.size());
    double loss = 0;
    std::map<std::pair<int, int>, std::function<std::optional<Act>(std::optional<Act>)>> pending;
    PipelineChunks<Act> fns;
    fns.forward = [&](int c, int mb, std::optional<Act> in) {
      return forward(chunks_[std::size_t(c)], micro[std::size_t(mb)], std::move(in), m, loss,
                     &pending[{c, mb}]);
    };
    fns.backward = [&](int c, int mb, std::optional<Act> dout) {
      const auto it = pending.find({c, mb});
      auto din = it->second(std::move(dout));
      pending.erase(it);
      ++chunks_[std::size_t(c)].backwards;
      return din;
    };
    last_run_ = run_pipeline(
        pp_, mesh_, fns,
        {.schedule = options_.schedule,
         .shape = {.stages = pp_.size(), .microbatches = m, .chunks = options_.chunks},
         .device = device(),
         .boundary_shape = [&](int mb) { return boundary_shape(micro[std::size_t(mb)].first); }});
    for (Chunk& k : chunks_) {
      DTENSOR_CHECK(k.backwards == m, "nn::PipelineTrainer::step: model stage " + std::to_string(k.stage) +
                                          " ran " + std::to_string(k.backwards) + " backwards of " +
                                          std::to_string(m) + " micro-batches");
      k.backwards = 0;
    }
    // The global norm: each stage's sum of squares (total_norm over the stage's mesh) and the last stage's
    // loss added over pp in one all_reduce.
    std::vector<EmbGroup> embeddings;
    std::vector<BlockGroup> blocks;
    std::vector<HeadGroup> heads;
    for (const Chunk& k : chunks_) { // handles: copies share the groups' state
      blocks.insert(blocks.end(), k.blocks.begin(), k.blocks.end());
      if (k.embedding) {
        embeddings.push_back(*k.embedding);
      }
      if (k.head) {
        heads.push_back(*k.head);
      }
    }
    const double stage_norm = total_norm(l2_norm, embeddings, blocks, heads);
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
    clip_grads_with_norm(options_.max_norm, result.grad_norm, embeddings, blocks, heads);
    for (Chunk& k : chunks_) { // the optimizer's indices: nn::FsdpTrainer's
      const auto update = [&](auto& g, int index) {
        g.reshard();
        opt.step(index, g);
        g.zero_grad();
      };
      if (k.embedding) {
        update(*k.embedding, 0);
      }
      for (std::size_t b = 0; b < k.blocks.size(); ++b) {
        update(k.blocks[b], 1 + k.first + int(b));
      }
      if (k.head) {
        update(*k.head, int(model_.blocks.size()) + 1);
      }
    }
    return result;
  }
  /// One step on one micro-batch (no pipelining: the stages run one after the other).
  template <class Optimizer>
  StepResult step(const ids_type& ids, const ids_type& targets, Optimizer& opt) {
    const std::pair<ids_type, ids_type> one{ids, targets};
    return step(std::span(&one, 1), opt);
  }

  /// The mean loss of one batch, no backward: a forward-only pass through the stages; every rank returns
  /// it. The groups are gathered for it and resharded after.
  double loss(const ids_type& ids, const ids_type& targets) {
    for_each_group([](auto& g) { (void)g.unshard(async_op); });
    const std::pair<ids_type, ids_type> one{ids, targets};
    double loss = 0;
    PipelineChunks<Act> fns;
    fns.forward = [&](int c, int, std::optional<Act> in) {
      return forward(chunks_[std::size_t(c)], one, std::move(in), 1, loss, nullptr);
    };
    (void)run_pipeline(pp_, mesh_, fns,
                       {.shape = {.stages = pp_.size(), .microbatches = 1, .chunks = options_.chunks},
                        .device = device(),
                        .forward_only = true,
                        .boundary_shape = [&](int) { return boundary_shape(ids); }});
    for_each_group([](auto& g) { g.reshard(); });
    Tensor<double, 1> sum = Tensor<double, 1>::full({1}, loss, device().is_cuda() ? device() : Device::cpu());
    all_reduce(sum, ReduceOp::sum, pp_);
    return sum.item();
  }

  /// f(index, w) for every parameter of this rank's layers, gathered (w a DTensor of its declared
  /// placements on the stage mesh, in the compute type): index is its place in Model::parameters()'s
  /// order (the embedding's, each block's, the final norm's and the head's). The groups are resharded
  /// after.
  template <class F>
  void for_each_parameter(F&& f) {
    const int head_first = kEmbParams + kBlockParams * int(model_.blocks.size());
    for (Chunk& k : chunks_) {
      const auto each = [&](auto& g, int first) {
        g.unshard();
        int i = first;
        std::apply([&](const auto&... w) { (f(i++, w), ...); }, g.params());
        g.reshard();
      };
      if (k.embedding) {
        each(*k.embedding, 0);
      }
      for (std::size_t b = 0; b < k.blocks.size(); ++b) {
        each(k.blocks[b], kEmbParams + kBlockParams * (k.first + int(b)));
      }
      if (k.head) {
        each(*k.head, head_first);
      }
    }
  }

private:
  /// What crosses a stage boundary for a micro-batch of `ids` (batch, sequence): (batch, sequence, hidden).
  std::vector<std::int64_t> boundary_shape(const ids_type& ids) const {
    return {ids.global_shape()[0], ids.global_shape()[1], hidden_};
  }

  /// The parameters' device (every model stage holds a block: pipeline_layers gives each at least one).
  Device device() const { return chunks_.front().blocks.front().local_param().device(); }

  template <class F>
  void for_each_group(F&& f) {
    for (Chunk& k : chunks_) {
      if (k.embedding) {
        f(*k.embedding);
      }
      for (auto& b : k.blocks) {
        f(b);
      }
      if (k.head) {
        f(*k.head);
      }
    }
  }

  /// A layer's gradients into its group: accumulated unsharded, reduce_scattered with the chunk's last
  /// backward of the step.
  template <class Group, class Grads>
  static void deliver(Group& group, bool last, const Grads& g) {
    std::apply(
        [&](const auto&... d) { last ? group.reduce_gradients(d...) : group.accumulate_gradients(d...); }, g);
  }

  /// The forward of chunk k on one micro-batch (`in`: the previous stage's output; none on stage 0), its
  /// loss scaled by 1 / m added to `loss` on the last stage. With `backward` set, the chunk's backward
  /// is left there: it takes the next stage's input gradient (none on the last) and returns this one's
  /// (none on stage 0), delivering the layers' gradients to their groups.
  Act forward(Chunk& k, const std::pair<ids_type, ids_type>& batch, std::optional<Act> in, int m,
              double& loss, std::function<std::optional<Act>(std::optional<Act>)>* backward) {
    const bool grads = backward != nullptr;
    const double scale = 1.0 / m;
    const auto last = [&k, m] { return k.backwards + 1 == m; };
    std::function<void(const Act&)> embedding_back;
    Act h = in ? std::move(*in) : [&] {
      auto [w] = k.embedding->params();
      auto [x, back] = model_.embedding.with_parameters(w).forward(batch.first, with_backward);
      if (grads) {
        embedding_back = [back = std::move(back), &group = *k.embedding, last](const Act& dh) {
          deliver(group, last(), back(dh).params);
        };
      }
      return x;
    }();
    std::vector<std::function<Act(const Act&)>> block_backs;
    for (std::size_t b = 0; b < k.blocks.size(); ++b) {
      auto& group = k.blocks[b];
      const auto layer = std::apply(
          [&](const auto&... w) { return model_.blocks[std::size_t(k.first) + b].with_parameters(w...); },
          group.params());
      if (!grads) {
        h = layer.forward(h);
        continue;
      }
      if (options_.recompute) {
        Act input = h;
        h = layer.forward(input);
        block_backs.push_back([this, &group, block = std::size_t(k.first) + b, input = std::move(input),
                               last](const Act& dy) {
          const auto again = std::apply(
              [&](const auto&... w) { return model_.blocks[block].with_parameters(w...); }, group.params());
          auto [dx, g] = again.forward(input, with_backward).backward(dy);
          deliver(group, last(), g);
          return dx;
        });
        continue;
      }
      auto [y, back] = layer.forward(h, with_backward);
      block_backs.push_back([back = std::move(back), &group, last](const Act& dy) {
        auto [dx, g] = back(dy);
        deliver(group, last(), g);
        return dx;
      });
      h = std::move(y);
    }
    std::function<Act()> head_back;
    if (k.head) {
      auto& group = *k.head;
      const auto norm = model_.norm.with_parameters(group.template param<0>());
      const auto head = model_.head.with_parameters(group.template param<1>());
      if (!grads) {
        loss += scale * scalar_value(head.forward(norm.forward(h), batch.second));
        return h;
      }
      auto [n, norm_back] = norm.forward(h, with_backward);
      auto [l, loss_back] = head.forward(n, batch.second, with_backward);
      loss += scale * scalar_value(l);
      {
        head_back = [norm_back = std::move(norm_back), loss_back = std::move(loss_back), &group, last,
                     scale]() {
          auto [dn, hg] = loss_back(scale);
          auto [dh, ng] = norm_back(dn);
          deliver(group, last(), std::tuple_cat(std::move(ng), std::move(hg)));
          return dh;
        };
      }
    }
    if (grads) {
      *backward = [block_backs = std::move(block_backs), head_back = std::move(head_back),
                   embedding_back =
                       std::move(embedding_back)](std::optional<Act> dout) -> std::optional<Act> {
        Act d = head_back ? head_back() : std::move(*dout);
        for (auto it = block_backs.rbegin(); it != block_backs.rend(); ++it) {
          d = (*it)(d);
        }
        if (embedding_back) {
          embedding_back(d);
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
  std::int64_t hidden_; ///< the model's hidden size: the last dim of what crosses a stage boundary
  std::vector<Chunk> chunks_;
  PipelineRunStats last_run_;
};

} // namespace dtensor::nn
