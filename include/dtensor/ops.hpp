#pragma once
// dtensor/ops.hpp: compute on DTensors (ops/): the sharding rules, pointwise ops, reductions, shapes,
// matmul / linear, softmax, norms, embedding, loss, attention (Ulysses and ring context parallelism, the
// zigzag layout), rotary embeddings, users' ops, local_map, rand / randn / dropout, and the local kernels
// under them. Kept out of <dtensor/dtensor.hpp>: with them there, every new (element type, rank, mesh)
// combination of a TU that only moves data cost ~0.5 s more to compile (bench/compile/combination_*.cpp);
// include this where you compute. matmul, linear and attention need the dtensor::blas target (OpenBLAS)
// on the host; rand, randn and dropout need Random123's headers (the dtensor::random target).

#include "dtensor/dtensor.hpp"

#include "dtensor/local/gemm.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/random.hpp"
#include "dtensor/ops/attention.hpp"
#include "dtensor/ops/collective_matmul.hpp"
#include "dtensor/ops/custom.hpp"
#include "dtensor/ops/embedding.hpp"
#include "dtensor/ops/fewest_bytes.hpp"
#include "dtensor/ops/local_map.hpp"
#include "dtensor/ops/loss.hpp"
#include "dtensor/ops/matmul.hpp"
#include "dtensor/ops/norm.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/random.hpp"
#include "dtensor/ops/reduce.hpp"
#include "dtensor/ops/rotary.hpp"
#include "dtensor/ops/rules.hpp"
#include "dtensor/ops/shape.hpp"
#include "dtensor/ops/softmax.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/ops/zigzag.hpp"
