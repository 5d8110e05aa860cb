// Compile-fail cases for the transformer layers (parallel/layers/; format: see vocabulary.cpp): a layout
// that cannot exist, and layers fed tensors of another layout's placements.
// Syntax only, never linked: the layers' products may use the BLAS (<cblas.h> is on the default path).
#define DTENSOR_HAS_BLAS 1
#include <dtensor/parallel/layers.hpp>

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
