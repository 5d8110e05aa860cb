#pragma once
// Deprecated: moved to <dtensor/backward/duality.hpp>; this forwarding header goes in the next release.
#include "dtensor/backward/duality.hpp"
