#pragma once
// Deprecated: moved to <dtensor/backward/redistribute.hpp>; this forwarding header goes in the next release.
#include "dtensor/backward/redistribute.hpp"
