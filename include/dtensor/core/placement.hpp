#pragma once
// Deprecated: moved to <dtensor/layout/placement.hpp>; this forwarding header goes in the next release.
#include "dtensor/layout/placement.hpp"
