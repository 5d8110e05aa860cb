#pragma once
// Deprecated: moved to <dtensor/layout/exchange.hpp> and <dtensor/plan/cost.hpp>; this forwarding header goes
// in the next release.
#include "dtensor/layout/exchange.hpp"
#include "dtensor/plan/cost.hpp"
