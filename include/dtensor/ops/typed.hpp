#pragma once
// Deprecated: moved to <dtensor/ops/typed_rules.hpp>; this forwarding header goes in the next release.
#include "dtensor/ops/typed_rules.hpp"
