// Compile-fail cases for the transformer layers (nn/; format: see vocabulary.cpp): a layout
// that cannot exist, layers fed tensors of another layout's placements, and models that miss a piece of the
// trainers' contract.
// Syntax only, never linked: the layers' products may use the BLAS (<cblas.h> is on the default path).
#define DTENSOR_HAS_BLAS 1
#include <dtensor/nn.hpp>
#include <dtensor/train.hpp>

#include <cstddef>
#include <tuple>
#include <vector>

using namespace dtensor;
using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
using TpSp = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
using Tp = nn::Layout<Mesh, nn::TensorParallel<"tp">>;

// The control: a block fed its layout's activations, the head its ids.
void control(const nn::TransformerBlock<float, TpSp>& block, const nn::LmHead<float, TpSp>& head,
             const nn::act_t<TpSp, float>& h, const nn::ids_t<TpSp>& targets) {
  (void)head.forward(block.forward(h), targets);
}

//! CASE sp_without_tp nn::Layout: nn::SequenceParallel shards the sequence over the tensor-parallel axis
#ifdef CASE_sp_without_tp
constexpr int f = nn::Layout<Mesh, nn::SequenceParallel>::tp;
#endif

//! CASE one_tp_axis nn::Layout: at most one nn::TensorParallel axis
#ifdef CASE_one_tp_axis
constexpr int f = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::TensorParallel<"dp">>::tp;
#endif

//! CASE block_other_layout nn::TransformerBlock: the input must be nn::act_t<L, T> of the block.s layout
#ifdef CASE_block_other_layout
void f(const nn::TransformerBlock<float, TpSp>& block, const nn::act_t<Tp, float>& h) {
  (void)block.forward(h);
}
#endif

//! CASE mlp_gathered nn::Mlp: the input must be nn::act_t<L, T>
#ifdef CASE_mlp_gathered
void f(const nn::Mlp<float, TpSp>& mlp, const nn::gathered_t<TpSp, float>& h) {
  (void)mlp.forward(h);
}
#endif

//! CASE embedding_ids nn::Embedding: the ids must be nn::ids_t<L>
#ifdef CASE_embedding_ids
void f(const nn::Embedding<float, TpSp>& emb,
       const DTensor<std::int64_t, 2, Mesh, Shard<0>, Shard<0>, Shard<1>>& ids) {
  (void)emb.forward(ids);
}
#endif

// The model contract (nn/contract.hpp): what a trainer asks of a model, one missing piece at a time.
struct NoUnits {
  auto loss_function() const { return nn::MseLoss{}; }
};
struct NoLoss {
  nn::RmsNorm<float, TpSp> norm;
  auto units() { return std::tie(norm); }
};
struct UnitsByValue {
  nn::RmsNorm<float, TpSp> norm;
  auto units() { return std::tuple{norm}; }
  auto loss_function() const { return nn::MseLoss{}; }
};
struct NotAUnit {
  nn::act_t<TpSp, float> forward(const nn::act_t<TpSp, float>& x) const { return x; }
};
struct WithNotAUnit {
  NotAUnit layer;
  auto units() { return std::tie(layer); }
  auto loss_function() const { return nn::MseLoss{}; }
};

// The control: a model of the contract.
struct Normed {
  nn::RmsNorm<float, TpSp> norm;
  std::vector<nn::RmsNorm<float, TpSp>> more;
  auto units() { return std::tie(norm, more); }
  auto loss_function() const { return nn::MseLoss{}; }
};
static_assert(nn::check_model<Normed>() && nn::Model<Normed> && !nn::Model<NoUnits> && !nn::Model<NoLoss>);

//! CASE model_no_units nn::Model: the model has no units\(\): give it `auto units\(\)
#ifdef CASE_model_no_units
constexpr bool f = nn::check_model<NoUnits>();
#endif

//! CASE model_no_loss nn::Model: the model has no loss_function\(\)
#ifdef CASE_model_no_loss
std::size_t f = sizeof(nn::DdpTrainer<NoLoss, "dp">);
#endif

//! CASE model_units_by_value nn::Model: units\(\) returns std::tie\(...\) of the model.s members
#ifdef CASE_model_units_by_value
constexpr bool f = nn::check_model<UnitsByValue>();
#endif

//! CASE model_not_a_unit nn::Model: a unit gives `auto parameters\(\)`
#ifdef CASE_model_not_a_unit
std::size_t f = sizeof(nn::FsdpTrainer<WithNotAUnit, Fsdp<"dp">>);
#endif
