// testing::run_ranks compiled once for every test program (see dtensor/testing/run_ranks.hpp): the test
// TUs declare it (DTENSOR_RUN_RANKS_COMPILED, from the target dtensor_test_run_ranks) and do not make the
// gloo backend themselves.
#define DTENSOR_RUN_RANKS_IMPLEMENTATION
#include <dtensor/testing/run_ranks.hpp>
