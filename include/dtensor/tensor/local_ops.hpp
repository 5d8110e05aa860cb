#pragma once
// Deprecated: moved to <dtensor/local/copy.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/copy.hpp"

namespace dtensor {
// Deprecated: dtensor::local_ops is dtensor::local now; this alias goes with this header.
namespace local_ops = local;
} // namespace dtensor
