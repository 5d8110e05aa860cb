#pragma once
// init_process_group: the world group of a multi-process job, from the environment (torch's env://).
//
//   auto world = dtensor::init_process_group();   // under dtensor-run, torchrun, mpirun or srun
//   std::printf("rank %d of %d on %s\n", world.rank(), world.size(),
//   std::string(world.backend_name()).c_str());
//
// Where a process sits in the job (read_dist_env), first match wins:
//   torchrun / dtensor-run   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   OpenMPI (mpirun)         OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   MPICH / Intel MPI        PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   Slurm (srun)             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//   none of them             one process: rank 0 of 1, with a private store
// The store's address comes from MASTER_ADDR / MASTER_PORT (default port 29500). MASTER_ADDR may be left
// out when every rank runs on this machine (then 127.0.0.1); under Slurm it defaults to the first host of
// SLURM_STEP_NODELIST / SLURM_JOB_NODELIST. Under an MPI launcher (OpenMPI or MPICH variables) without
// MASTER_ADDR, in a program built with the MPI backend (dtensor::mpi), the ranks meet through MPI instead:
// the job's store is an MpiStore (rendezvous/mpi_store.hpp), for every backend, on any number of
// machines, with no port to choose.
//
// Rendezvous: rank 0 hosts a TcpStore on MASTER_PORT unless DTENSOR_USE_AGENT_STORE=1 says the launcher
// (dtensor-run on node 0) hosts it; every rank connects to MASTER_ADDR:MASTER_PORT, retrying until the
// timeout, so ranks may start in any order. Rank 0's store listens on DTENSOR_STORE_BIND_ADDR, else on
// MASTER_ADDR when that is a loopback address (one machine: nothing outside it can connect), else on every
// interface; with DTENSOR_STORE_TOKEN set (dtensor-run sets it), the store serves only clients presenting
// the same token. The backend then rendezvouses through the
// store (gloo: its pair addresses; NCCL: the unique id), and all ranks meet at a store barrier before
// init_process_group returns. After a restart (dtensor-run --max-restarts) the ranks use the part of the
// launcher's store DTENSOR_STORE_PREFIX names, so nothing of the failed start is read again.
//
// A dry run: DTENSOR_BACKEND=fake (or InitOptions::backend "fake") makes the process play rank RANK of
// WORLD_SIZE alone (backends/fake/backend.hpp): a backend registered as meeting no peers
// (BackendTraits::meets_peers) gets no store, no rendezvous and needs no launcher.
//
// Backend: InitOptions::backend, else DTENSOR_BACKEND, else "auto": a name in the backend registry
// (backends/registry.hpp: "gloo", "nccl" and "mpi" when this program includes them, as this header does
// when dtensor was built with them), made with make_backend; "auto" picks NCCL when a CUDA device is
// visible, else MPI under an MPI launcher, else gloo. Each backend reads its own settings (gloo:
// GLOO_SOCKET_IFNAME, else the local address that routes to MASTER_ADDR; NCCL: the device LOCAL_RANK unless
// InitOptions::device is set). Timeout (store, rendezvous and the group's default op timeout):
// InitOptions::timeout, else DTENSOR_TIMEOUT (seconds), else kDefaultOpTimeout (10 minutes: the policy in
// core/timeout.hpp).

#include "dtensor/backends/fake/backend.hpp"
#include "dtensor/backends/registry.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/env.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/prefix_store.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"

// The backends of this build register themselves by being included (backends/registry.hpp).
#if DTENSOR_HAS_GLOO
#include "dtensor/backends/gloo/backend.hpp"
#endif
#if DTENSOR_HAS_NCCL
#include "dtensor/backends/nccl/backend.hpp"
#endif
#if DTENSOR_HAS_MPI
#include "dtensor/backends/mpi/backend.hpp"
#include "dtensor/rendezvous/mpi_store.hpp"
#endif

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtensor {

/// Where this process sits in the job.
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  /// Processes on this machine (-1: the launcher did not say).
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// MASTER_ADDR was set (or, under Slurm, taken from the node list); false: 127.0.0.1 for a job on this
  /// machine, or empty for an MPI launch over several machines (the ranks then meet through MPI).
  bool master_addr_given = false;
  /// Which variables it came from: "torchrun", "openmpi", "mpich", "slurm" or "default".
  std::string source = "default";
  /// The launcher hosts the store (DTENSOR_USE_AGENT_STORE=1); rank 0 then is a client like the others.
  bool agent_store = false;
  /// The job's token (DTENSOR_STORE_TOKEN), presented to the store and required by one rank 0 hosts.
  std::string store_token;
  /// Where rank 0's store listens (DTENSOR_STORE_BIND_ADDR); empty: see connect_store.
  std::string store_bind_addr;
  /// The part of the launcher's store this start of the job uses (DTENSOR_STORE_PREFIX: dtensor-run
  /// --max-restarts gives each restart its own, so no start reads an earlier one's keys); empty: all of it.
  std::string store_prefix;
  /// Which start of the job this is (DTENSOR_RESTART_COUNT, else torchrun's TORCHELASTIC_RESTART_COUNT):
  /// 0, then 1, 2, ... after each restart.
  int restart_count = 0;
};

/// Reads one environment variable; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const char*)>;

namespace detail {

inline std::optional<std::string> system_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    return std::nullopt;
  }
  return std::string(v);
}

inline int env_int(const EnvLookup& env, const char* name, int fallback, int min_value) {
  auto v = env(name);
  if (!v) {
    return fallback;
  }
  try {
    return static_cast<int>(parse_decimal_int(name, *v, min_value, 1 << 30));
  } catch (const Error& e) {
    throw Error(std::string("init_process_group: environment variable ") + e.what());
  }
}

/// A flag read through `env` (core/env.hpp's truth table); false when unset.
inline bool env_flag(const EnvLookup& env, const char* name) {
  return parse_flag(name, env(name).value_or(""), false);
}

/// The first host of a Slurm hostlist: "node[03-05,7],gpu1" -> "node03", "a,b" -> "a".
inline std::string first_slurm_host(std::string_view list) {
  std::string out;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (c == ',') {
      break;
    }
    if (c == '[') {
      std::size_t j = i + 1;
      while (j < list.size() && list[j] != ',' && list[j] != '-' && list[j] != ']') {
        out += list[j++];
      }
      break;
    }
    out += c;
  }
  return out;
}

} // namespace detail

/// Reads the job layout from the environment (see the top of this file). Throws Error naming the variable
/// when one is malformed or out of range, and when MASTER_ADDR is needed but unset. `meets_peers` false
/// (a backend whose process plays its rank alone, BackendTraits::meets_peers): no address is needed.
inline DistEnv read_dist_env(const EnvLookup& env = detail::system_env, bool meets_peers = true) {
  DistEnv e;
  // A launcher sets a rank and a world size together: the first family (in the order below) with either
  // set must have both; one without the other is a broken launch, not a job of one process. (Slurm's
  // allocation shells set SLURM_NTASKS alone, so a lone size is no launch there.)
  const char* families[][4] = {{"RANK", "WORLD_SIZE", "torchrun", ""},
                               {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "openmpi", ""},
                               {"PMI_RANK", "PMI_SIZE", "mpich", ""},
                               {"SLURM_PROCID", "SLURM_NTASKS", "slurm", "size alone ok"}};
  for (const auto& f : families) {
    const bool has_rank = env(f[0]).has_value();
    const bool has_size = env(f[1]).has_value() && (has_rank || *f[3] == '\0');
    if (has_rank && has_size) {
      break;
    }
    if (has_rank || has_size) {
      throw Error(std::string("init_process_group: ") + (has_rank ? f[0] : f[1]) + " is set but " +
                  (has_rank ? f[1] : f[0]) + " is not (the " + f[2] +
                  " launch variables come together): set both, or neither to run as one process");
    }
  }
  auto from = [&](const char* rank, const char* size, const char* local_rank, const char* local_size,
                  const char* source) {
    if (!env(rank) || !env(size)) {
      return false;
    }
    e.world_size = detail::env_int(env, size, 1, 1);
    e.rank = detail::env_int(env, rank, 0, 0);
    e.local_rank = detail::env_int(env, local_rank, e.world_size == 1 ? 0 : -1, 0);
    e.local_world_size = detail::env_int(env, local_size, -1, 1);
    e.source = source;
    return true;
  };
  [[maybe_unused]] const bool found =
      from("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun") ||
      from("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi") ||
      from("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpich") ||
      from("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm");
  DTENSOR_CHECK(e.rank < e.world_size, "init_process_group: rank " + std::to_string(e.rank) +
                                           " is out of range for world size " + std::to_string(e.world_size) +
                                           " (from the " + e.source + " environment variables)");
  if (e.local_rank < 0) {
    // Not given: the rank modulo the local world size when known, else the rank itself (one machine).
    e.local_rank = e.local_world_size > 0 ? e.rank % e.local_world_size : e.rank;
  }
  e.master_port = detail::env_int(env, "MASTER_PORT", 29500, 0);
  DTENSOR_CHECK(e.master_port <= 65535,
                "init_process_group: MASTER_PORT=" + std::to_string(e.master_port) + " is not a TCP port");
  if (auto addr = env("MASTER_ADDR"); addr && !addr->empty()) {
    e.master_addr = *addr;
    e.master_addr_given = true;
  } else if (e.source == "slurm" && (env("SLURM_STEP_NODELIST") || env("SLURM_JOB_NODELIST"))) {
    e.master_addr = detail::first_slurm_host(
        *(env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST")));
    e.master_addr_given = true;
  } else if ((e.source == "openmpi" || e.source == "mpich") && e.world_size > 1 &&
             e.local_world_size != e.world_size) {
    e.master_addr.clear(); // several machines: they meet through MPI (init_process_group), or need it set
  } else {
    DTENSOR_CHECK(!meets_peers || e.world_size == 1 || e.local_world_size == e.world_size,
                  "init_process_group: MASTER_ADDR is not set (rank " + std::to_string(e.rank) + " of " +
                      std::to_string(e.world_size) + ", from the " + e.source +
                      " environment variables); set it to the address of the machine running rank 0, "
                      "e.g. MASTER_ADDR=$(hostname) on that machine, and MASTER_PORT to a free port");
    e.master_addr = "127.0.0.1";
  }
  e.agent_store = detail::env_flag(env, "DTENSOR_USE_AGENT_STORE");
  e.store_token = env("DTENSOR_STORE_TOKEN").value_or("");
  e.store_bind_addr = env("DTENSOR_STORE_BIND_ADDR").value_or("");
  e.store_prefix = env("DTENSOR_STORE_PREFIX").value_or("");
  e.restart_count = detail::env_int(env, "DTENSOR_RESTART_COUNT",
                                    detail::env_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0), 0);
  return e;
}

/// Options of init_process_group; every field has an environment default (see the top of this file).
struct InitOptions {
  /// A registered backend ("gloo", "nccl", see registered_backends()) or "auto"; empty: DTENSOR_BACKEND,
  /// else "auto".
  std::string backend;
  /// Store connection, rendezvous and default op timeout; zero: DTENSOR_TIMEOUT seconds, else
  /// kDefaultOpTimeout (10 minutes, core/timeout.hpp).
  std::chrono::milliseconds timeout{0};
  /// The job layout; nullopt: read_dist_env().
  std::optional<DistEnv> env;
  /// An existing store (any dtensor::Store) to rendezvous through instead of connecting to
  /// MASTER_ADDR:MASTER_PORT.
  std::shared_ptr<Store> store;
  /// Device backends (NCCL): the device of this rank; -1: LOCAL_RANK (NCCL takes it modulo the number of
  /// visible devices).
  int device = -1;
};

namespace detail {

inline std::chrono::milliseconds init_timeout(std::chrono::milliseconds given = {}) {
  if (given.count() > 0) {
    check_timeout(given, "init_process_group");
    return given;
  }
  if (auto v = system_env("DTENSOR_TIMEOUT"); v && !v->empty()) {
    try {
      return parse_timeout_seconds("DTENSOR_TIMEOUT", *v);
    } catch (const Error& e) {
      throw Error(std::string("init_process_group: ") + e.what());
    }
  }
  return kDefaultOpTimeout;
}

/// The registered backend `name` (empty: DTENSOR_BACKEND, else "auto") stands for.
inline std::string resolve_backend(const std::string& name) {
  try {
    return resolve_backend_name(name.empty() ? system_env("DTENSOR_BACKEND").value_or("auto") : name);
  } catch (const Error& e) {
    throw Error(std::string("init_process_group: ") + e.what());
  }
}

} // namespace detail

namespace detail {

/// Whether init_process_group meets through MPI (an MpiStore) rather than a TcpStore: under an MPI
/// launcher (OpenMPI or MPICH variables) with no MASTER_ADDR and no launcher-hosted store, in a program
/// built with the MPI backend.
inline bool meets_through_mpi([[maybe_unused]] const DistEnv& env) {
#if DTENSOR_HAS_MPI
  return (env.source == "openmpi" || env.source == "mpich") && !env.master_addr_given && !env.agent_store;
#else
  return false;
#endif
}

} // namespace detail

/// The job's store as init_process_group reaches it: hosted here when this is rank 0 and no launcher
/// hosts it (DistEnv::agent_store), a private one on a free loopback port for a lone process without
/// launcher variables, else a client of MASTER_ADDR:MASTER_PORT (retrying until `timeout`). A store hosted
/// here listens on DistEnv::store_bind_addr, else on MASTER_ADDR when it is a loopback address, else on
/// every interface.
inline std::shared_ptr<TcpStore> connect_store(const DistEnv& env, std::chrono::milliseconds timeout) {
  DTENSOR_CHECK(!env.master_addr.empty(),
                "init_process_group: MASTER_ADDR is not set (rank " + std::to_string(env.rank) + " of " +
                    std::to_string(env.world_size) + " on several machines, from the " + env.source +
                    " environment variables); set it to the address of the machine running rank 0 and "
                    "MASTER_PORT to a free port, or build with the MPI backend (link dtensor::mpi) to meet "
                    "through MPI");
  TcpStoreOptions so;
  so.timeout = timeout;
  so.token = env.store_token;
  if (env.world_size == 1 && env.source == "default") {
    so.is_server = true;
    so.bind_host = "127.0.0.1";
    return std::make_shared<TcpStore>("127.0.0.1", 0, so);
  }
  so.is_server = env.rank == 0 && !env.agent_store;
  so.bind_host = !env.store_bind_addr.empty()                ? env.store_bind_addr
                 : detail::tcp::is_loopback(env.master_addr) ? env.master_addr
                                                             : "";
  so.server_owner = env.agent_store ? "dtensor-run on node 0" : "rank 0";
  return std::make_shared<TcpStore>(env.master_addr, env.master_port, so);
}

/// Rank `rank` of a world of `size` on the fake backend (backends/fake/backend.hpp): this process alone
/// plays that rank, every op completes at once, nothing is exchanged. For dry runs.
inline ProcessGroup fake_world(int rank, int size, std::chrono::milliseconds timeout = kDefaultOpTimeout) {
  return ProcessGroup(detail::make_fake_backend(rank, size, timeout));
}

/// The world group of this job (see the top of this file). Collective over every rank of the job.
/// Throws TimeoutError when the store or a rank does not answer within the timeout, Error otherwise.
inline ProcessGroup init_process_group(InitOptions options = {}) {
  const std::chrono::milliseconds timeout = detail::init_timeout(options.timeout);
  const std::string backend = detail::resolve_backend(options.backend);
  const bool meets_peers = backend_traits(backend).meets_peers;
  const DistEnv env = options.env ? *options.env : read_dist_env(detail::system_env, meets_peers);
  BackendOptions bo;
  bo.timeout = timeout;
  bo.device = options.device >= 0 ? options.device : env.local_rank;
  bo.master_addr = env.master_addr;
  bo.master_port = env.master_port;
  if (!meets_peers) { // e.g. a dry run: this process plays rank RANK of WORLD_SIZE alone
    return ProcessGroup(make_backend(backend, nullptr, env.rank, env.world_size, bo));
  }

  std::shared_ptr<Store> store = options.store;
  std::shared_ptr<TcpStore> own_store;
#if DTENSOR_HAS_MPI
  if (store == nullptr && detail::meets_through_mpi(env)) {
    store = std::make_shared<MpiStore>(timeout);
  }
#endif
  if (store == nullptr) {
    own_store = connect_store(env, timeout);
    store = own_store;
    if (!env.store_prefix.empty()) { // this start's part of the launcher's store
      store = std::make_shared<PrefixStore>(env.store_prefix, own_store);
    }
  }
  // Successive init_process_group calls of one job use fresh keys.
  const std::int64_t generation = store->add("dtensor/init_count/" + std::to_string(env.rank), 1);
  const std::string prefix = "dtensor/init" + std::to_string(generation);

  bo.prefix = prefix + "/" + backend;
  std::shared_ptr<Backend> impl = make_backend(backend, store, env.rank, env.world_size, bo);
  // Nobody leaves (and a store-hosting rank 0 cannot exit) before every rank finished its rendezvous. A
  // store passed in may be hosted by any rank: then every rank waits until all were released.
  store_barrier(*store, prefix + "/ready", env.world_size, timeout,
                own_store != nullptr ? own_store->is_server() : true);
  return ProcessGroup(std::move(impl));
}

} // namespace dtensor
