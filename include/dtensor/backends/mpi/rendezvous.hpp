#pragma once
// Deprecated: moved to <dtensor/rendezvous/mpi_store.hpp>; this forwarding header goes in the next release.
#include "dtensor/rendezvous/mpi_store.hpp"
