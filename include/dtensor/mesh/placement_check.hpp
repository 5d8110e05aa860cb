#pragma once
// Deprecated: moved to <dtensor/layout/placement_check.hpp>; this forwarding header goes in the next release.
#include "dtensor/layout/placement_check.hpp"
#include "dtensor/mesh/mesh_shape.hpp" // the old header brought MeshShape in
