// The collective suite over MPI as real processes: `mpirun -np N mpi_suite`. init_process_group() reads
// OpenMPI's variables and meets through MPI (no MASTER_ADDR, no TCP store).
#include "collective_suite.hpp"

#include "dtensor/comm/init.hpp"

#include <cstdio>

int main() {
  try {
    dtensor::InitOptions options;
    options.backend = "mpi";
    auto world = dtensor::init_process_group(options);
    suite::Ctx c{world, dtensor::Device::cpu(), world.rank(), world.size()};
    if (c.rank == 0) {
      std::printf("mpi suite: %d processes\n", c.size);
    }
    return suite::run_suite(c) == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_suite error: %s\n", e.what());
    return 1;
  }
}
