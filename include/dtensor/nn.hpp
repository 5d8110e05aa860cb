#pragma once
// dtensor::nn: layers and models as objects whose parameters are DTensors with their placements in the
// type, in a parallel layout that is a type (nn::Layout: which mesh axes are tensor, sequence and context
// parallel; the rest data parallel). Each layer's forward returns its backward's context, as the ops do.
// Training them is <dtensor/train.hpp>.
//
//   using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
//   nn::Embedding<float, L> emb(mesh, vocab, hidden, keys.next());
//   nn::TransformerBlock<float, L> block(mesh, config, keys);
//   nn::RmsNorm<float, L> norm(mesh, hidden);
//   nn::LmHead<float, L> head(mesh, vocab, hidden, keys.next());
//
// The files (nn/): contract.hpp (what a model is to the trainers: nn::Model, nn::Unit), layout.hpp (the
// layout and the placements it gives each tensor), module.hpp (what every layer shares: Gradients,
// TransformerConfig, checkpointed), init.hpp (init::normal_ and the others on the sharding-invariant random
// numbers), linear.hpp (nn::ColumnParallelLinear, nn::RowParallelLinear: linear layers with a bias on any
// mesh), embedding.hpp, norm.hpp, mlp.hpp, moe.hpp (nn::Moe: a mixture of experts over an expert-parallel
// axis; its routing in moe_routing.hpp), attention.hpp, block.hpp (nn::TransformerBlock), mlp_block.hpp
// (nn::MlpBlock: a block without attention), head.hpp, chain.hpp (nn::Chain: layers run as one unit),
// losses.hpp (nn::CrossEntropyLoss, nn::MseLoss); the models: model.hpp (nn::LanguageModel) and vision.hpp
// (nn::VisionEncoder, with nn::PatchEmbedding and nn::ClassifierHead).

#include "dtensor/nn/attention.hpp"
#include "dtensor/nn/block.hpp"
#include "dtensor/nn/chain.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/nn/embedding.hpp"
#include "dtensor/nn/head.hpp"
#include "dtensor/nn/init.hpp"
#include "dtensor/nn/layout.hpp"
#include "dtensor/nn/linear.hpp"
#include "dtensor/nn/losses.hpp"
#include "dtensor/nn/mlp.hpp"
#include "dtensor/nn/mlp_block.hpp"
#include "dtensor/nn/model.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/moe.hpp"
#include "dtensor/nn/moe_routing.hpp"
#include "dtensor/nn/norm.hpp"
#include "dtensor/nn/vision.hpp"
