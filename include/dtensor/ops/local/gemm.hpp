#pragma once
// Deprecated: moved to <dtensor/local/gemm.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/gemm.hpp"
