#pragma once
// Deprecated: moved to <dtensor/rendezvous/detail/mpi.hpp>; this forwarding header goes in the next release.
#include "dtensor/rendezvous/detail/mpi.hpp"
