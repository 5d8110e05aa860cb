#pragma once
// init_process_group: the world group of a multi-process job, from the environment (torch's env://).
//
//   auto world = dtensor::init_process_group();   // under dtensor-run, torchrun, mpirun or srun
//   std::printf("rank %d of %d on %s\n", world.rank(), world.size(), std::string(world.backend()).c_str());
//
// Where a process sits in the job (read_dist_env), first match wins:
//   torchrun / dtensor-run   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   OpenMPI (mpirun)         OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   MPICH / Intel MPI        PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   Slurm (srun)             SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//   none of them             one process: rank 0 of 1, with a private store
// The store's address always comes from MASTER_ADDR / MASTER_PORT (default port 29500). MASTER_ADDR may be
// left out when every rank runs on this machine (then 127.0.0.1); under Slurm it defaults to the first host
// of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST.
//
// Rendezvous: rank 0 hosts a TcpStore on MASTER_PORT (every interface) unless DTENSOR_USE_AGENT_STORE=1
// says the launcher (dtensor-run on node 0) hosts it; every rank connects to MASTER_ADDR:MASTER_PORT,
// retrying until the timeout, so ranks may start in any order. The backend then rendezvouses through the
// store (gloo: its pair addresses; NCCL: the unique id), and all ranks meet at a store barrier before
// init_process_group returns.
//
// Backend: InitOptions::backend, else DTENSOR_BACKEND ("gloo", "nccl" or "auto"), else auto: NCCL when
// dtensor was built with it (target dtensor::nccl) and a CUDA device is visible, else gloo.
// Timeout (store, rendezvous and the group's default op timeout): InitOptions::timeout, else
// DTENSOR_TIMEOUT (seconds), else 300 s. gloo binds to GLOO_SOCKET_IFNAME when set, else to the local
// address that routes to MASTER_ADDR (127.0.0.1 when the master is local).

#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/barrier.hpp"
#include "dtensor/rendezvous/detail/tcp.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/rendezvous/tcp_store.hpp"

#if DTENSOR_HAS_GLOO
#include "dtensor/backends/gloo/backend.hpp"
#endif
#if DTENSOR_HAS_NCCL
#include "dtensor/backends/nccl/backend.hpp"
#endif

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

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
  /// Which variables it came from: "torchrun", "openmpi", "mpich", "slurm" or "default".
  std::string source = "default";
  /// The launcher hosts the store (DTENSOR_USE_AGENT_STORE=1); rank 0 then is a client like the others.
  bool agent_store = false;
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
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(*v, &used);
  } catch (...) {
    used = 0;
  }
  DTENSOR_CHECK(used == v->size() && !v->empty() && x >= min_value && x <= 1 << 30,
                std::string("init_process_group: environment variable ") + name + "='" + *v +
                    "' is not an integer >= " + std::to_string(min_value));
  return static_cast<int>(x);
}

inline bool env_true(const EnvLookup& env, const char* name) {
  auto v = env(name);
  return v && (*v == "1" || *v == "true" || *v == "True" || *v == "TRUE" || *v == "yes");
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

inline bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

/// The local address the kernel would use to reach host:port (a UDP connect sends nothing), or "" when
/// it cannot tell.
inline std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) {
    return "";
  }
  std::string out;
  for (addrinfo* a = list; a != nullptr && out.empty(); a = a->ai_next) {
    tcp::Fd fd(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd || ::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
      continue;
    }
    char buf[INET6_ADDRSTRLEN] = {};
    const void* addr = ss.ss_family == AF_INET6
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
    if (::inet_ntop(ss.ss_family, addr, buf, sizeof(buf)) != nullptr) {
      out = buf;
    }
  }
  ::freeaddrinfo(list);
  return out;
}

} // namespace detail

/// Reads the job layout from the environment (see the top of this file). Throws Error naming the variable
/// when one is malformed or out of range, and when MASTER_ADDR is needed but unset.
inline DistEnv read_dist_env(const EnvLookup& env = detail::system_env) {
  DistEnv e;
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
  } else if (e.source == "slurm" && (env("SLURM_STEP_NODELIST") || env("SLURM_JOB_NODELIST"))) {
    e.master_addr = detail::first_slurm_host(
        *(env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST")));
  } else {
    DTENSOR_CHECK(e.world_size == 1 || e.local_world_size == e.world_size,
                  "init_process_group: MASTER_ADDR is not set (rank " + std::to_string(e.rank) + " of " +
                      std::to_string(e.world_size) + ", from the " + e.source +
                      " environment variables); set it to the address of the machine running rank 0, "
                      "e.g. MASTER_ADDR=$(hostname) on that machine, and MASTER_PORT to a free port");
    e.master_addr = "127.0.0.1";
  }
  e.agent_store = detail::env_true(env, "DTENSOR_USE_AGENT_STORE");
  return e;
}

/// Options of init_process_group; every field has an environment default (see the top of this file).
struct InitOptions {
  /// "gloo", "nccl", "auto"; empty: DTENSOR_BACKEND, else "auto".
  std::string backend;
  /// Store connection, rendezvous and default op timeout; zero: DTENSOR_TIMEOUT seconds, else 300 s.
  std::chrono::milliseconds timeout{0};
  /// The job layout; nullopt: read_dist_env().
  std::optional<DistEnv> env;
  /// An existing store (any dtensor::Store) to rendezvous through instead of connecting to
  /// MASTER_ADDR:MASTER_PORT.
  std::shared_ptr<Store> store;
  /// NCCL: the CUDA device of this rank; -1: LOCAL_RANK modulo the number of visible devices.
  int device = -1;
};

namespace detail {

inline std::chrono::milliseconds init_timeout(std::chrono::milliseconds given = {}) {
  if (given.count() > 0) {
    return given;
  }
  if (auto v = system_env("DTENSOR_TIMEOUT"); v && !v->empty()) {
    double s = 0;
    std::size_t used = 0;
    try {
      s = std::stod(*v, &used);
    } catch (...) {
      used = 0;
    }
    DTENSOR_CHECK(used == v->size() && s > 0,
                  "init_process_group: DTENSOR_TIMEOUT='" + *v + "' is not a positive number of seconds");
    return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000.0));
  }
  return std::chrono::seconds(300);
}

inline bool cuda_device_visible() {
#if DTENSOR_HAS_NCCL
  return nccl_device_count() > 0;
#else
  return false;
#endif
}

/// "gloo" or "nccl", checked against what this build has.
inline std::string resolve_backend(std::string name) {
  if (name.empty()) {
    name = system_env("DTENSOR_BACKEND").value_or("auto");
  }
  for (char& c : name) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (name.empty() || name == "auto") {
    name = cuda_device_visible() ? "nccl" : "gloo";
  }
  DTENSOR_CHECK(name == "gloo" || name == "nccl", "init_process_group: unknown backend '" + name +
                                                      "' (DTENSOR_BACKEND must be gloo, nccl or auto)");
#if !DTENSOR_HAS_GLOO
  DTENSOR_CHECK(name != "gloo",
                "init_process_group: the gloo backend is not part of this build (link the CMake "
                "target dtensor::gloo, which needs Debian's libgloo-dev)");
#endif
#if !DTENSOR_HAS_NCCL
  DTENSOR_CHECK(name != "nccl",
                "init_process_group: the NCCL backend is not part of this build (link the CMake "
                "target dtensor::nccl, which needs the CUDA toolkit and NCCL)");
#endif
  return name;
}

} // namespace detail

/// The job's store as init_process_group reaches it: hosted here when this is rank 0 and no launcher
/// hosts it (DistEnv::agent_store), a private one on a free port for a lone process without launcher
/// variables, else a client of MASTER_ADDR:MASTER_PORT (retrying until `timeout`).
inline std::shared_ptr<TcpStore> connect_store(const DistEnv& env, std::chrono::milliseconds timeout) {
  TcpStoreOptions so;
  so.timeout = timeout;
  if (env.world_size == 1 && env.source == "default") {
    so.is_server = true;
    return std::make_shared<TcpStore>("127.0.0.1", 0, so);
  }
  so.is_server = env.rank == 0 && !env.agent_store;
  return std::make_shared<TcpStore>(env.master_addr, env.master_port, so);
}

/// The world group of this job (see the top of this file). Collective over every rank of the job.
/// Throws TimeoutError when the store or a rank does not answer within the timeout, Error otherwise.
inline ProcessGroup init_process_group(InitOptions options = {}) {
  const DistEnv env = options.env ? *options.env : read_dist_env();
  const std::chrono::milliseconds timeout = detail::init_timeout(options.timeout);
  const std::string backend = detail::resolve_backend(options.backend);

  std::shared_ptr<TcpStore> own_store = options.store ? nullptr : connect_store(env, timeout);
  std::shared_ptr<Store> store = options.store ? options.store : own_store;
  // Successive init_process_group calls of one job use fresh keys.
  const std::int64_t generation = store->add("dtensor/init_count/" + std::to_string(env.rank), 1);
  const std::string prefix = "dtensor/init" + std::to_string(generation);

  std::shared_ptr<Backend> impl;
  if (backend == "gloo") {
#if DTENSOR_HAS_GLOO
    GlooOptions go;
    go.timeout = timeout;
    go.prefix = prefix + "/gloo";
    if (auto iface = detail::system_env("GLOO_SOCKET_IFNAME"); iface && !iface->empty()) {
      go.iface = iface->substr(0, iface->find(','));
    } else if (!detail::is_loopback(env.master_addr) && env.world_size > 1) {
      const std::string local = detail::local_address_towards(env.master_addr, env.master_port);
      if (!local.empty()) {
        go.hostname = local;
      }
    }
    impl = make_gloo_backend(store, env.rank, env.world_size, go);
#endif
  } else {
#if DTENSOR_HAS_NCCL
    NcclOptions no;
    no.timeout = timeout;
    no.prefix = prefix + "/nccl";
    no.device = options.device >= 0 ? options.device : env.local_rank;
    impl = make_nccl_backend(store, env.rank, env.world_size, no);
#endif
  }
  DTENSOR_CHECK(impl != nullptr, "init_process_group: no backend was created");
  // Nobody leaves (and a store-hosting rank 0 cannot exit) before every rank finished its rendezvous. A
  // store passed in may be hosted by any rank: then every rank waits until all were released.
  store_barrier(*store, prefix + "/ready", env.world_size, timeout,
                own_store != nullptr ? own_store->is_server() : true);
  return ProcessGroup(std::move(impl));
}

} // namespace dtensor
