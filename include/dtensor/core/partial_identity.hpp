#pragma once
// Deprecated: moved to <dtensor/layout/partial_identity.hpp>; this forwarding header goes in the next
// release.
#include "dtensor/layout/partial_identity.hpp"
