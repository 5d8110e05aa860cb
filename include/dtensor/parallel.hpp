#pragma once
// The layers and their training on DTensors: <dtensor/nn.hpp> (layers and models: tensor-parallel linear
// layers, the transformer's layers, mixture of experts, the model contract) and <dtensor/train.hpp> (the
// trainers, FSDP / HSDP, DDP, optimizers, clipping, pipelines). Kept out of <dtensor/dtensor.hpp> like
// <dtensor/ops.hpp>; init, the layers' weights and the MoE need Random123's headers (the dtensor::random
// target), the products a BLAS (dtensor::blas).

#include "dtensor/dtensor.hpp"

#include "dtensor/nn.hpp"
#include "dtensor/train.hpp"
