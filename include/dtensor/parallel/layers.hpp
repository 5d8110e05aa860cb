#pragma once
// dtensor::nn: transformer layers as objects whose parameters are DTensors with their placements in the
// type, in a parallel layout that is a type (nn::Layout: which mesh axes are tensor, sequence and context
// parallel; the rest data parallel). Each layer's forward returns its backward's context, as the ops do.
//
//   using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel>;
//   nn::Embedding<float, L> emb(mesh, vocab, hidden, keys.next());
//   nn::TransformerBlock<float, L> block(mesh, config, keys);
//   nn::RmsNorm<float, L> norm(mesh, hidden);
//   nn::LmHead<float, L> head(mesh, vocab, hidden, keys.next());
//
// The files: layers/layout.hpp (the layout and the placements it gives each tensor), layers/module.hpp
// (what every layer shares: Gradients, TransformerConfig, checkpointed), embedding.hpp, norm.hpp,
// mlp.hpp, moe.hpp (nn::Moe: a mixture of experts over an expert-parallel axis; its routing in
// moe_routing.hpp), attention.hpp, block.hpp (nn::TransformerBlock), mlp_block.hpp (nn::MlpBlock: a block
// without attention), head.hpp, chain.hpp (nn::Chain: layers run as one), losses.hpp (nn::CrossEntropyLoss,
// nn::MseLoss), vision.hpp (nn::VisionEncoder: a vision transformer; nn::PatchEmbedding, nn::ClassifierHead);
// contract.hpp (what a model is to the trainers: nn::Model, nn::Unit), model.hpp
// (nn::LanguageModel: embedding, blocks, final norm and head) and trainer.hpp (nn::DdpTrainer,
// nn::FsdpTrainer: the training step of any model under DDP or FSDP/HSDP),
// pipeline_trainer.hpp (nn::PipelineTrainer: pipelined over a pp group, FSDP x TP inside each stage).

#include "dtensor/parallel/layers/attention.hpp"
#include "dtensor/parallel/layers/block.hpp"
#include "dtensor/parallel/layers/chain.hpp"
#include "dtensor/parallel/layers/contract.hpp"
#include "dtensor/parallel/layers/embedding.hpp"
#include "dtensor/parallel/layers/head.hpp"
#include "dtensor/parallel/layers/layout.hpp"
#include "dtensor/parallel/layers/losses.hpp"
#include "dtensor/parallel/layers/mlp.hpp"
#include "dtensor/parallel/layers/mlp_block.hpp"
#include "dtensor/parallel/layers/model.hpp"
#include "dtensor/parallel/layers/module.hpp"
#include "dtensor/parallel/layers/moe.hpp"
#include "dtensor/parallel/layers/moe_routing.hpp"
#include "dtensor/parallel/layers/norm.hpp"
#include "dtensor/parallel/layers/pipeline_trainer.hpp"
#include "dtensor/parallel/layers/trainer.hpp"
#include "dtensor/parallel/layers/vision.hpp"
