#pragma once
// Deprecated: moved to <dtensor/backends/stuck_op_board.hpp>; this forwarding header goes in the next
// release.
#include "dtensor/backends/stuck_op_board.hpp"
