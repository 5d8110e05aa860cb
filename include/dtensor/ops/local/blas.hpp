#pragma once
// Deprecated: moved to <dtensor/local/blas.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/blas.hpp"
