#pragma once
// Deprecated: moved to <dtensor/backends/gloo/types.hpp>; this forwarding header goes in the next release.
#include "dtensor/backends/gloo/types.hpp"
