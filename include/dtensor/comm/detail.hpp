#pragma once
// Deprecated: moved to <dtensor/comm/backend_call.hpp>; this forwarding header goes in the next release.
#include "dtensor/comm/backend_call.hpp"
