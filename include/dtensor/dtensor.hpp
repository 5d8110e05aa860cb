#pragma once
// dtensor: distributed tensors for C++20. The umbrella header: includes every public header except the
// backends' own (pulled in by comm/init.hpp when their targets are linked), testing/ and the store it uses
// (rendezvous/in_process_store.hpp), the planning tools (plan/torch_reference.hpp: a model of PyTorch's
// planner; plan/search.hpp: the exhaustive yardstick; plan/time_model.hpp: seconds on a cluster), and ops/
// (compute on DTensors: <dtensor/ops.hpp> includes it with this header).
// Each header also compiles on its own; include the ones you use to keep compile times down.

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/config.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/static_vector.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"

#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/exchange.hpp"
#include "dtensor/layout/partial_identity.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/placement_check.hpp"
#include "dtensor/layout/shard_spec.hpp"

#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/mesh/mesh_shape.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"
#include "dtensor/rendezvous/tcp_store_server.hpp"

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/comm_debug.hpp"
#include "dtensor/comm/functional.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/object.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/comm/wait_timer.hpp"
#include "dtensor/comm/work.hpp"

#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/planner.hpp"

#include "dtensor/exec/blocks.hpp"
#include "dtensor/exec/execute.hpp"

#include "dtensor/tensor/distribute.hpp"
#include "dtensor/tensor/dtensor.hpp"
#include "dtensor/tensor/visualize.hpp"

#include "dtensor/backward/activation_checkpoint.hpp"
#include "dtensor/backward/collectives.hpp"
#include "dtensor/backward/duality.hpp"
#include "dtensor/backward/redistribute.hpp"
#include "dtensor/backward/with_backward.hpp"
