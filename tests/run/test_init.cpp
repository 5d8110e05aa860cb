// init_process_group's pieces that need no backend: read_dist_env's parsing of the torchrun / OpenMPI /
// MPICH / Slurm variables and of flags, backend names (none is registered in this program), and
// connect_store. (The Store contract is tested in tests/rendezvous/test_store.cpp.)
#include "dtensor/backends/registry.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>

using namespace std::chrono_literals;

// ---- environment parsing --------------------------------------------------------------------------------

namespace {
dtensor::EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) {
      return std::nullopt;
    }
    return it->second;
  };
}
} // namespace

TEST_CASE("env: torchrun variables", "[env]") {
  auto e = dtensor::read_dist_env(env_of({{"RANK", "5"},
                                          {"WORLD_SIZE", "8"},
                                          {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "4"},
                                          {"MASTER_ADDR", "node0"},
                                          {"MASTER_PORT", "1234"},
                                          {"DTENSOR_USE_AGENT_STORE", "1"},
                                          {"OMPI_COMM_WORLD_RANK", "7"}}));
  CHECK(e.source == "torchrun");
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 1234);
  CHECK(e.agent_store);
}

TEST_CASE("env: OpenMPI, MPICH and Slurm fallbacks", "[env]") {
  auto o = dtensor::read_dist_env(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                          {"OMPI_COMM_WORLD_SIZE", "4"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  CHECK(o.source == "openmpi");
  CHECK(o.rank == 3);
  CHECK(o.world_size == 4);
  CHECK(o.local_rank == 3);
  CHECK(o.master_addr == "127.0.0.1"); // all ranks on this machine
  CHECK_FALSE(o.master_addr_given);
  CHECK(o.master_port == 29500);
  CHECK_FALSE(o.agent_store);

  // OpenMPI over several machines without MASTER_ADDR: no address; the ranks meet through MPI where the
  // program links dtensor::mpi (this test does not: connecting a TCP store then says what to do).
  auto multi = dtensor::read_dist_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"},
                                              {"OMPI_COMM_WORLD_SIZE", "4"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  CHECK(multi.master_addr.empty());
  CHECK_FALSE(multi.master_addr_given);
  CHECK_FALSE(dtensor::detail::meets_through_mpi(multi));
  try {
    dtensor::connect_store(multi, std::chrono::milliseconds(100));
    FAIL("connect_store without an address did not fail");
  } catch (const dtensor::Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("MASTER_ADDR is not set"));
    CHECK_THAT(e.what(), Catch::Contains("dtensor::mpi"));
  }

  auto m = dtensor::read_dist_env(
      env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}}));
  CHECK(m.source == "mpich");
  CHECK(m.rank == 1);
  CHECK(m.local_rank == 1);
  CHECK(m.master_addr_given);

  auto s = dtensor::read_dist_env(env_of({{"SLURM_PROCID", "6"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "2"},
                                          {"SLURM_JOB_NODELIST", "gpu[07-08],cpu1"},
                                          {"MASTER_PORT", "4000"}}));
  CHECK(s.source == "slurm");
  CHECK(s.rank == 6);
  CHECK(s.world_size == 8);
  CHECK(s.local_rank == 2);
  CHECK(s.master_addr == "gpu07");
  CHECK(s.master_port == 4000);
  CHECK(dtensor::detail::first_slurm_host("a,b") == "a");
  CHECK(dtensor::detail::first_slurm_host("n[1,3-4]") == "n1");
}

TEST_CASE("env: no launcher means one process, bad values are named", "[env]") {
  auto e = dtensor::read_dist_env(env_of({}));
  CHECK(e.source == "default");
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);

  auto message = [](std::map<std::string, std::string> vars) {
    try {
      dtensor::read_dist_env(env_of(std::move(vars)));
    } catch (const dtensor::Error& err) {
      return std::string(err.what());
    }
    return std::string("no error");
  };
  CHECK(message({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'") != std::string::npos);
  CHECK(message({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}).find("out of range") !=
        std::string::npos);
  CHECK(message({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "1"}})
            .find("MASTER_ADDR is not set") != std::string::npos);
  CHECK(message({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT") !=
        std::string::npos);
}

TEST_CASE("env: a partial launch environment is an error, not a job of one process", "[env]") {
  auto message = [](std::map<std::string, std::string> vars) {
    try {
      dtensor::read_dist_env(env_of(std::move(vars)));
    } catch (const dtensor::Error& err) {
      return std::string(err.what());
    }
    return std::string("no error");
  };
  using Catch::Matchers::Contains;
  CHECK_THAT(message({{"RANK", "1"}}), Contains("RANK is set but WORLD_SIZE is not"));
  CHECK_THAT(message({{"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}}),
             Contains("WORLD_SIZE is set but RANK is not"));
  CHECK_THAT(message({{"OMPI_COMM_WORLD_RANK", "0"}}), Contains("OMPI_COMM_WORLD_SIZE is not"));
  CHECK_THAT(message({{"PMI_SIZE", "2"}}), Contains("PMI_SIZE is set but PMI_RANK is not"));
  CHECK_THAT(message({{"SLURM_PROCID", "3"}}), Contains("SLURM_NTASKS is not"));
  // An allocation shell (salloc) sets SLURM_NTASKS alone: one process, as before.
  CHECK(dtensor::read_dist_env(env_of({{"SLURM_NTASKS", "4"}})).world_size == 1);
  // A partial family that a complete one would have hidden is still reported.
  CHECK_THAT(message({{"RANK", "0"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}),
             Contains("WORLD_SIZE is not"));
}

TEST_CASE("env: timeouts below a millisecond, huge or not finite are rejected with the range", "[env]") {
  using dtensor::detail::parse_timeout_seconds;
  CHECK(parse_timeout_seconds("DTENSOR_TIMEOUT", "2.5") == 2500ms);
  CHECK(parse_timeout_seconds("DTENSOR_TIMEOUT", "0.001") == 1ms);
  CHECK(parse_timeout_seconds("DTENSOR_TIMEOUT", "2592000") == dtensor::kMaxTimeout);
  for (const char* bad : {"1e300", "0.0004", "0", "-5", "inf", "nan", "5s", "", "2592001", "0x10", " 5", "5 ",
                          "+5", "1e400", "0x1p3"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse_timeout_seconds("DTENSOR_TIMEOUT", bad),
                      Catch::Matchers::Contains("DTENSOR_TIMEOUT='" + std::string(bad) + "'") &&
                          Catch::Matchers::Contains("0.001 to 2592000"));
  }
  ::setenv("DTENSOR_TIMEOUT", "1e300", 1);
  CHECK_THROWS_WITH(dtensor::detail::init_timeout(),
                    Catch::Matchers::Contains("init_process_group: DTENSOR_TIMEOUT='1e300' is out of range"));
  ::unsetenv("DTENSOR_TIMEOUT");
  // The default policy (core/timeout.hpp): 10 minutes for ops and init on every backend, 300 s for stores.
  CHECK(dtensor::detail::init_timeout() == dtensor::kDefaultOpTimeout);
  CHECK(dtensor::kDefaultOpTimeout == 10min);
  CHECK(dtensor::BackendOptions{}.timeout == dtensor::kDefaultOpTimeout);
  CHECK(dtensor::Store::kDefaultTimeout == dtensor::kDefaultStoreTimeout);
  CHECK(dtensor::kDefaultStoreTimeout == 300s);
  CHECK_THROWS_WITH(
      dtensor::detail::init_timeout(std::chrono::milliseconds(dtensor::kMaxTimeout.count() + 1)),
      Catch::Matchers::Contains("at most 30 days"));
}

TEST_CASE("env: numbers are decimal, as written", "[env]") {
  using dtensor::detail::is_decimal_number;
  using dtensor::detail::parse_decimal_int;
  for (const char* ok : {"2", "2.5", ".5", "5.", "1e3", "1E-3", "007"}) {
    INFO(ok);
    CHECK(is_decimal_number(ok));
  }
  for (const char* bad : {"", ".", "0x10", " 5", "5 ", "+5", "-5", "inf", "nan", "1e", "1e+", "5s", "1,5"}) {
    INFO(bad);
    CHECK_FALSE(is_decimal_number(bad));
  }
  CHECK(parse_decimal_int("X", "42", 0, 100) == 42);
  CHECK(parse_decimal_int("X", "-3", -5, 5) == -3);
  for (const char* bad : {"0x10", " 5", "5 ", "+5", "-1", "", "1e2", "101", "99999999999999999999"}) {
    INFO(bad);
    CHECK_THROWS_WITH(
        parse_decimal_int("X", bad, 0, 100),
        Catch::Matchers::Contains("X='" + std::string(bad) + "' is not an integer in [0, 100]"));
  }
  // init_process_group's variables: RANK=" 1" or "0x1" is refused, naming it.
  for (const char* bad : {" 1", "0x1", "+1"}) {
    INFO(bad);
    CHECK_THROWS_WITH(dtensor::read_dist_env(env_of({{"RANK", bad}, {"WORLD_SIZE", "2"}})),
                      Catch::Matchers::Contains("RANK='" + std::string(bad) + "'"));
  }
}

TEST_CASE("env: one truth table for every flag", "[env]") {
  using dtensor::detail::parse_flag;
  for (const char* v : {"1", "true", "TRUE", "yes", "On"}) {
    CHECK(parse_flag("X", v, false));
  }
  for (const char* v : {"0", "false", "No", "off"}) {
    CHECK_FALSE(parse_flag("X", v, true));
  }
  CHECK(parse_flag("X", "", true));
  CHECK_FALSE(parse_flag("X", "", false));
  CHECK_THROWS_WITH(parse_flag("DTENSOR_X", "maybe", false), Catch::Matchers::Contains("DTENSOR_X='maybe'"));
  CHECK(dtensor::read_dist_env(env_of({{"DTENSOR_USE_AGENT_STORE", "yes"}})).agent_store);
  CHECK_THROWS_WITH(dtensor::read_dist_env(env_of({{"DTENSOR_USE_AGENT_STORE", "2"}})),
                    Catch::Matchers::Contains("DTENSOR_USE_AGENT_STORE='2'"));
}

TEST_CASE("init: a backend missing from this build is named, unknown names are rejected", "[env]") {
  // This test binary links neither dtensor::gloo, dtensor::nccl nor dtensor::mpi.
  auto message = [](std::string backend) {
    dtensor::InitOptions o;
    o.backend = std::move(backend);
    o.env = dtensor::DistEnv{};
    try {
      dtensor::init_process_group(o);
    } catch (const dtensor::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message("gloo").find("gloo backend is not part of this build") != std::string::npos);
  CHECK(message("NCCL").find("NCCL backend is not part of this build") != std::string::npos);
  CHECK(message("mpi").find("MPI backend is not part of this build (link the CMake target dtensor::mpi") !=
        std::string::npos);
  CHECK(message("ucc").find("unknown backend 'ucc'") != std::string::npos);
}

TEST_CASE("init: connect_store hosts a private store for a lone process", "[env]") {
  auto store = dtensor::connect_store(dtensor::DistEnv{}, 5s);
  CHECK(store->is_server());
  CHECK(store->port() > 0);
  store->barrier("alone", 1, 1s);
}
