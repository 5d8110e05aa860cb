// bench_train's gpt model (the GPT of examples/09_gpt.cpp: blocks of attention (GQA, RoPE, causal) and a
// SwiGLU MLP), every layout's trainer instantiated here.
#include "train_bench.hpp"

#include <dtensor/nn/block.hpp>

namespace bench::train {

Measured train_gpt(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o) {
  return train_layout<nn::TransformerBlock, false, true>(mesh, layout, o);
}

} // namespace bench::train
