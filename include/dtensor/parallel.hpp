#pragma once
// The layers and training on DTensors: tensor-parallel linear layers, FSDP / HSDP, DDP's bucketed
// asynchronous gradient reduction, optimizers on sharded parameters (SGD, AdamW), gradient clipping by the
// global norm, parameter init from the sharding-invariant random numbers, mixture of experts and pipeline
// schedules. Kept out of <dtensor/dtensor.hpp> like <dtensor/ops.hpp>; init, the layers' weights and the MoE
// need Random123's headers (the dtensor::random target), the products a BLAS (dtensor::blas).

#include "dtensor/dtensor.hpp"

#include "dtensor/parallel/clip.hpp"
#include "dtensor/parallel/ddp.hpp"
#include "dtensor/parallel/flat_layout.hpp"
#include "dtensor/parallel/fsdp.hpp"
#include "dtensor/parallel/layers.hpp"
#include "dtensor/parallel/optim.hpp"
#include "dtensor/parallel/param_init.hpp"
#include "dtensor/parallel/pipeline_run.hpp"
#include "dtensor/parallel/pipeline_schedule.hpp"
#include "dtensor/parallel/schedule.hpp"
#include "dtensor/parallel/tp.hpp"
