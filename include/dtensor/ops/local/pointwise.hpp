#pragma once
// Deprecated: moved to <dtensor/local/pointwise.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/pointwise.hpp"
