#pragma once
// Deprecated: moved to <dtensor/local/cublas.hpp>; this forwarding header goes in the next release.
#include "dtensor/local/cublas.hpp"
