#pragma once
// Deprecated: moved to <dtensor/local/gemm_plan.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/gemm_plan.hpp"
