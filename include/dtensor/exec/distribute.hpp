#pragma once
// Deprecated: moved to <dtensor/exec/blocks.hpp>; this forwarding header goes in the next release.
#include "dtensor/exec/blocks.hpp"
