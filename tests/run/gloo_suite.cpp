// The collective suite over gloo as real processes: `dtensor-run --nproc-per-node N gloo_suite`.
// init_process_group() does the store rendezvous from the launcher's environment.
#include "collective_suite.hpp"

#include "dtensor/comm/init.hpp"

#include <cstdio>

int main() {
  try {
    dtensor::InitOptions options;
    options.backend = "gloo";
    auto world = dtensor::init_process_group(options);
    suite::Ctx c{world, dtensor::Device::cpu(), world.rank(), world.size()};
    if (c.rank == 0) {
      std::printf("gloo suite: %d processes\n", c.size);
    }
    return suite::run_suite(c) == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_suite error: %s\n", e.what());
    return 1;
  }
}
