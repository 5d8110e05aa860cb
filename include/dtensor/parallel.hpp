#pragma once
// Training on DTensors: optimizers on sharded parameters (SGD, AdamW), gradient clipping by the global norm,
// parameter init from the sharding-invariant random numbers, and DDP's bucketed asynchronous gradient
// reduction. Kept out of <dtensor/dtensor.hpp> like <dtensor/ops.hpp>; the init functions need Random123's
// headers (the dtensor::random target).

#include "dtensor/dtensor.hpp"

#include "dtensor/parallel/clip.hpp"
#include "dtensor/parallel/ddp.hpp"
#include "dtensor/parallel/init.hpp"
#include "dtensor/parallel/optim.hpp"
