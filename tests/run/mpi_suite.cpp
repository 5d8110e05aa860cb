// The collective suite over MPI as real processes: `mpirun -np N mpi_suite`. init_process_group() reads
// OpenMPI's variables and meets through MPI (no MASTER_ADDR, no TCP store). Then what only the MPI backend
// promises: asynchronous ops progress while the caller makes no MPI call.
#include "collective_suite.hpp"

#include "dtensor/backends/mpi/backend.hpp"
#include "dtensor/backends/mpi/work.hpp"
#include "dtensor/comm/init.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

int main() {
  try {
    dtensor::InitOptions options;
    options.backend = "mpi";
    auto world = dtensor::init_process_group(options);
    suite::Ctx c{world, dtensor::Device::cpu(), world.rank(), world.size()};
    if (c.rank == 0) {
      std::printf("mpi suite: %d processes\n", c.size);
    }
    if (suite::run_suite(c) != 0) {
      return 1;
    }
    // Asynchronous ops move while the caller makes no MPI call (the progress thread): a multi-round
    // all_reduce, then two seconds without MPI, and the op is done before anyone waits for it. (Not with
    // MPI calls cut to a few elements, DTENSOR_MPI_MAX_COUNT: then it would be half a million calls.)
    if (dtensor::detail::mpi_max_count() < (1 << 20)) {
      return 0;
    }
    auto t = suite::make<float>(c, 1 << 20, [&](std::int64_t i) { return double(i % 5 + c.rank); });
    dtensor::Work w = dtensor::all_reduce(t, dtensor::ReduceOp::sum, world, dtensor::async_op);
    std::this_thread::sleep_for(std::chrono::seconds(2));
    const auto* impl = dynamic_cast<const dtensor::detail::MpiWork*>(w.impl().get());
    suite::check(impl != nullptr, c, "the MPI backend's work is not an MpiWork");
    suite::check(impl->done(), c, "an async all_reduce did not progress without a wait (progress thread)");
    w.wait();
    suite::expect(
        c, t, [&](std::int64_t i) { return double((i % 5) * c.size) + c.size * (c.size - 1) / 2.0; },
        "async all_reduce done in the background");
    if (c.rank == 0) {
      std::printf("PASS async ops progress without a wait\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_suite error: %s\n", e.what());
    return 1;
  }
}
