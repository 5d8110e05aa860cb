#pragma once
// Deprecated: moved to <dtensor/layout/shard_spec.hpp>; this forwarding header goes in the next release.
#include "dtensor/layout/shard_spec.hpp"
