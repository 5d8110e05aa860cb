#pragma once
// Deprecated: moved to <dtensor/ops/fewest_bytes.hpp>; this forwarding header goes in the next release.
#include "dtensor/ops/fewest_bytes.hpp"
