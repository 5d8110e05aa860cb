// Compile-fail cases for the training utilities (train/optim.hpp, clip.hpp, nn/init.hpp, ddp.hpp,
// plan_layouts.hpp; format: see vocabulary.cpp): Partial gradients reach neither an optimizer nor clipping,
// DDP takes only gradients pending over its axis, the planner names what a model family lacks.
#include <dtensor/nn/init.hpp>
#include <dtensor/nn/mlp_block.hpp>
#include <dtensor/nn/model.hpp>
#include <dtensor/train/clip.hpp>
#include <dtensor/train/ddp.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/plan_layouts.hpp>

#include <cstdint>
#include <utility>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
using W = DTensor<float, 2, Mesh, Replicate, Shard<1>>;
using PW = DTensor<float, 2, Mesh, Partial<>, Shard<1>>;

// The control: a gradient with the parameter's placements steps it, DDP turns [P,S(1)] into [R,S(1)].
void control(W& w, const PW& dw) {
  optim::AdamW opt({});
  DDPReducer<"dp", float, Mesh> reducer(w.mesh(), {w.local().numel()});
  const W g = reducer.ready(0, dw);
  reducer.finish();
  opt.step(0, w, g);
  (void)clip_grad_norm(1.0, g);
  init::normal_(w, 0, 0.02, {1, 0});
}

//! CASE optim_partial_grad optimizer step: the gradient is Partial on a mesh axis .a sum still pending over
#ifdef CASE_optim_partial_grad
void f(W& w, const PW& dw) {
  optim::SGD({}).step(0, w, dw);
}
#endif

//! CASE optim_placements optimizer step: the gradient.s placements differ from the parameter.s: redistribute
#ifdef CASE_optim_placements
void f(W& w, const DTensor<float, 2, Mesh, Replicate, Shard<0>>& dw) {
  optim::AdamW({}).step(0, w, dw);
}
#endif

//! CASE clip_partial clip_grad_norm: a gradient is Partial on a mesh axis
#ifdef CASE_clip_partial
double f(const W& g, const PW& dw) {
  return clip_grad_norm(1.0, g, dw);
}
#endif

//! CASE ddp_not_partial DDPReducer::ready: the gradient must be Partial<sum> .or Partial<avg>. over the
#ifdef CASE_ddp_not_partial
void f(DDPReducer<"dp", float, Mesh>& reducer, const W& g) {
  (void)reducer.ready(0, g);
}
#endif

//! CASE ddp_sharded_param ddp_reducer: DDP.s parameters are replicated over its axis .shard them with FSDP
#ifdef CASE_ddp_sharded_param
void f(const DTensor<float, 2, Mesh, Shard<0>, Replicate>& w) {
  (void)ddp_reducer<"dp">({}, w);
}
#endif

//! CASE init_partial init: a Partial parameter
#ifdef CASE_init_partial
void f(PW& w) {
  init::zeros_(w);
}
#endif

//! CASE plan_no_blocks nn::plan_layouts: the family counts the blocks the pipeline cuts
#ifdef CASE_plan_no_blocks
struct NoBlocks {
  using model_type = nn::LanguageModel<float, nn::Layout<nn::PlanStageMesh>, nn::MlpBlock>;
  model_type make(const DeviceMesh<nn::PlanStageMesh>&, Device) const;
  std::pair<int, int> micro_batch(const DeviceMesh<nn::PlanStageMesh>&, std::int64_t, Device) const;
  bool admits(int, int, int) const;
};
auto f(const nn::PlanOptions& o) {
  return nn::plan_layouts(NoBlocks{}, o);
}
#endif
