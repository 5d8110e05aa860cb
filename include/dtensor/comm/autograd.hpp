#pragma once
// Deprecated: moved to <dtensor/backward/collectives.hpp>; this forwarding header goes in the next release.
#include "dtensor/backward/collectives.hpp"
