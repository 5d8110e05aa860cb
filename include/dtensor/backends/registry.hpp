#pragma once
// Backends by name (c10d's Backend.register_backend): a backend's header registers a factory under its
// name, and init_process_group makes the one InitOptions::backend / DTENSOR_BACKEND names. A new backend is
// one folder under backends/ and one registration; nothing else names it.
//
//   // in backends/mpi/backend.hpp, once per program (an inline variable's initialiser):
//   inline const bool mpi_registered = (dtensor::register_backend("mpi", make_mpi_backend_for_job), true);
//
//   auto world = dtensor::make_backend("mpi", store, rank, size, {.timeout = 60s});
//   for (const std::string& name : dtensor::registered_backends()) ...
//
// Names are case-insensitive. "auto" (or an empty name) picks, among the backends registered with a
// usable() test that passes, the one of highest priority: NCCL (when a CUDA device is visible), then MPI
// (under an MPI launcher), then gloo. A name that is not registered gives an Error that says how to get it
// into the build (for the backends dtensor ships with a CMake target) or lists the registered ones.

#include "dtensor/backends/backend.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/timeout.hpp"
#include "dtensor/rendezvous/store.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtensor {

/// What init_process_group tells every backend factory; a backend uses what applies to it.
struct BackendOptions {
  /// Default timeout of every op, and of the rendezvous (core/timeout.hpp).
  std::chrono::milliseconds timeout = kDefaultOpTimeout;
  /// Key prefix of this backend's rendezvous in the store (distinct per backend and per init).
  std::string prefix = "dtensor";
  /// Device backends: this rank's device index on its machine.
  int device = 0;
  /// Where the job's store listens (MASTER_ADDR:MASTER_PORT): a host backend binds to the local address
  /// that routes there.
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

/// Makes rank `rank` of a world of `size` that rendezvouses through `store`.
using BackendFactory = std::function<std::shared_ptr<Backend>(std::shared_ptr<Store> store, int rank,
                                                              int size, const BackendOptions& options)>;

/// How "auto" sees a backend.
struct BackendTraits {
  /// Whether the backend can run here (e.g. a GPU is visible); without one, "auto" never picks it.
  std::function<bool()> usable;
  /// "auto" picks the usable backend of highest priority.
  int priority = 0;
  /// false: each process plays its rank alone and meets no peer (the fake backend): init_process_group
  /// makes no store and needs no MASTER_ADDR, and the factory is given a null store.
  bool meets_peers = true;
};

namespace detail {

/// The backends dtensor ships with a CMake target of their own: what to say when one is not in a build.
inline constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kBackendTargets{{
    {"gloo", "the gloo backend is not part of this build (link the CMake target dtensor::gloo, which needs "
             "Debian's libgloo-dev)"},
    {"nccl",
     "the NCCL backend is not part of this build (link the CMake target dtensor::nccl, which needs the "
     "CUDA toolkit and NCCL)"},
    {"mpi", "the MPI backend is not part of this build (link the CMake target dtensor::mpi, which needs an "
            "MPI library: Debian's libopenmpi-dev, with openmpi-bin for mpirun)"},
}};

struct RegisteredBackend {
  BackendFactory factory;
  BackendTraits traits;
};

class BackendRegistry {
public:
  static BackendRegistry& instance() {
    static BackendRegistry r;
    return r;
  }

  void add(std::string name, BackendFactory factory, BackendTraits traits) {
    std::lock_guard lock(m_);
    entries_[std::move(name)] = RegisteredBackend{std::move(factory), std::move(traits)};
  }

  std::optional<RegisteredBackend> find(const std::string& name) const {
    std::lock_guard lock(m_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      return std::nullopt;
    }
    return it->second;
  }

  /// Every registered name with its traits, sorted by name.
  std::vector<std::pair<std::string, BackendTraits>> list() const {
    std::lock_guard lock(m_);
    std::vector<std::pair<std::string, BackendTraits>> out;
    for (const auto& [name, entry] : entries_) {
      out.emplace_back(name, entry.traits);
    }
    return out;
  }

private:
  mutable std::mutex m_;
  std::map<std::string, RegisteredBackend> entries_;
};

inline std::string lower_name(std::string_view name) {
  std::string s(name);
  for (char& c : s) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return s;
}

inline std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    s += (i ? ", " : "") + names[i];
  }
  return s.empty() ? "none" : s;
}

} // namespace detail

/// Registers `factory` under `name` (case-insensitive; a second registration of a name replaces the
/// first). Thread-safe; may run during static initialisation.
inline void register_backend(std::string_view name, BackendFactory factory, BackendTraits traits = {}) {
  const std::string key = detail::lower_name(name);
  DTENSOR_CHECK(!key.empty() && key != "auto", "register_backend: '" + std::string(name) +
                                                   "' cannot name a backend (empty and 'auto' are reserved)");
  DTENSOR_CHECK(factory != nullptr, "register_backend: the factory of '" + key + "' is empty");
  detail::BackendRegistry::instance().add(key, std::move(factory), std::move(traits));
}

/// The registered names, sorted.
inline std::vector<std::string> registered_backends() {
  std::vector<std::string> names;
  for (auto& [name, traits] : detail::BackendRegistry::instance().list()) {
    names.push_back(name);
  }
  return names;
}

/// The registered backend `name` stands for: itself (lower case) when registered; for "auto" or "" the
/// usable backend of highest priority. Throws Error when there is none (saying how to get a backend
/// dtensor ships into the build, or listing the registered ones).
inline std::string resolve_backend_name(std::string_view name) {
  const std::string key = detail::lower_name(name);
  const auto all = detail::BackendRegistry::instance().list();
  std::vector<std::string> names;
  for (const auto& [n, traits] : all) {
    names.push_back(n);
  }
  if (key.empty() || key == "auto") {
    const std::pair<std::string, BackendTraits>* best = nullptr;
    for (const auto& entry : all) {
      if (entry.second.usable && entry.second.usable() &&
          (best == nullptr || entry.second.priority > best->second.priority)) {
        best = &entry;
      }
    }
    DTENSOR_CHECK(best != nullptr,
                  "no registered backend can run here (registered: " + detail::join_names(names) +
                      "; include dtensor/backends/gloo/backend.hpp and link dtensor::gloo for host "
                      "tensors)");
    return best->first;
  }
  if (std::find(names.begin(), names.end(), key) != names.end()) {
    return key;
  }
  for (const auto& [target, hint] : detail::kBackendTargets) {
    if (target == key) {
      throw Error(std::string(hint));
    }
  }
  throw Error("unknown backend '" + key + "' (registered: " + detail::join_names(names) +
              "; DTENSOR_BACKEND must name a registered backend or auto)");
}

/// The traits the backend `name` stands for (see resolve_backend_name) was registered with.
inline BackendTraits backend_traits(std::string_view name) {
  const std::string key = resolve_backend_name(name);
  auto entry = detail::BackendRegistry::instance().find(key);
  DTENSOR_CHECK(entry.has_value(), "backend_traits: backend '" + key + "' is not registered");
  return entry->traits;
}

/// A backend of the registered kind `name` (see resolve_backend_name): rank `rank` of a world of `size`
/// that rendezvouses through `store`.
inline std::shared_ptr<Backend> make_backend(std::string_view name, std::shared_ptr<Store> store, int rank,
                                             int size, const BackendOptions& options = {}) {
  const std::string key = resolve_backend_name(name);
  auto entry = detail::BackendRegistry::instance().find(key);
  DTENSOR_CHECK(entry.has_value(), "make_backend: backend '" + key + "' is not registered");
  auto backend = entry->factory(std::move(store), rank, size, options);
  DTENSOR_CHECK(backend != nullptr, "make_backend: the factory of backend '" + key + "' returned no backend");
  return backend;
}

} // namespace dtensor
