#pragma once
// dtensor: distributed tensors for C++20. The umbrella header: includes every public header.
// Each header also compiles on its own; include the ones you use to keep compile times down.

#include "dtensor/core/config.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/layout.hpp"
#include "dtensor/core/placement.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/static_vector.hpp"
#include "dtensor/mesh/mesh_shape.hpp"
#include "dtensor/mesh/placement_check.hpp"
