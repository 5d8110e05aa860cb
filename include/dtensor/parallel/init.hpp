#pragma once
// Deprecated: moved to <dtensor/parallel/param_init.hpp>; this forwarding header goes in the next release.
#include "dtensor/parallel/param_init.hpp"
