#pragma once
// Deprecated: moved to <dtensor/layout/algebra.hpp>; this forwarding header goes in the next release.
#include "dtensor/layout/algebra.hpp"
