#pragma once
// Deprecated: moved to <dtensor/local/random.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/random.hpp"
