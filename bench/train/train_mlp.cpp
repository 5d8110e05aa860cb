// bench_train's mlp model (the model of examples/06_train.cpp: blocks of rms_norm + a GELU MLP + residual),
// every layout's trainer instantiated here.
#include "train_bench.hpp"

#include <dtensor/nn/mlp_block.hpp>

namespace bench::train {

Measured train_mlp(const DeviceMesh<Mesh>& mesh, const std::string& layout, const Options& o) {
  return train_layout<nn::MlpBlock, true>(mesh, layout, o);
}

} // namespace bench::train
