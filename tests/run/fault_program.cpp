// Mismatches between real processes (issue 18, defects 1 and 6): `dtensor-run --nproc-per-node 2
// fault_program <case>`. Each rank runs a call its peer disagrees with and must get a dtensor::Error whose
// message says the members disagree (gloo used to abort the process with SIGABRT, EnforceNotMet at
// pair.cc:510, or return stale data); exit 0 then, 1 when the call succeeded or the message is wrong.
// Run with a short DTENSOR_TIMEOUT.
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/comm/p2p.hpp"

#include <cstdio>
#include <string>

using namespace dtensor;

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  InitOptions options;
  options.backend = "gloo";
  ProcessGroup world = init_process_group(options);
  const int r = world.rank();
  std::string expect = "the members disagree: rank 0: ";
  try {
    if (what == "all_reduce_count") {
      auto t = Tensor<float, 1>::full({r == 0 ? 16 : 32}, 1.0f);
      all_reduce(t, ReduceOp::sum, world);
    } else if (what == "all_reduce_dtype") {
      if (r == 0) {
        all_reduce(Tensor<float, 1>::full({16}, 1.0f), ReduceOp::sum, world);
      } else {
        all_reduce(Tensor<double, 1>::full({16}, 1.0), ReduceOp::sum, world);
      }
    } else if (what == "send_recv") { // the sender's message is longer than the receive
      if (r == 0) {
        send(Tensor<float, 1>::full({32}, 1.0f), 1, world);
      } else {
        auto t = Tensor<float, 1>::full({16}, 0.0f);
        recv(t, 0, world);
      }
    } else if (what == "group_order") { // rank 0 makes a new group first, rank 1 splits first
      expect = "different orders";
      if (r == 0) {
        auto a = world.new_group({0, 1});
        auto b = world.split(0, r);
      } else {
        auto b = world.split(0, r);
        auto a = world.new_group({0, 1});
      }
    } else {
      std::fprintf(stderr, "fault_program: unknown case '%s'\n", what.c_str());
      return 2;
    }
  } catch (const Error& e) {
    const std::string msg = e.what();
    std::printf("rank %d: %s\n", r, msg.c_str());
    if (msg.find(expect) == std::string::npos) {
      std::fprintf(stderr, "rank %d: the message lacks '%s'\n", r, expect.c_str());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "rank %d: %s did not fail\n", r, what.c_str());
  return 1;
}
