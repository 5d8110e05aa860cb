#pragma once
// Deprecated: moved to <dtensor/backward/with_backward.hpp>; this forwarding header goes in the next release.
#include "dtensor/backward/with_backward.hpp"
