#pragma once
// Deprecated: moved to <dtensor/local/math.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/math.hpp"
