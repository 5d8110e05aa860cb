#pragma once
// The MPI library as one process sees it, shared by MpiStore (rendezvous/mpi_store.hpp) and the MPI
// backend (backends/mpi/): initialisation and finalisation, its thread level, whether it is CUDA-aware,
// error checking for MPI calls, and the one way dtensor waits for MPI requests (with a deadline, so nothing
// waits forever). Not a public interface.
//
//   auto& mpi = detail::MpiRuntime::instance();
//   mpi.ensure_initialized();                                   // MPI_Init_thread(MULTIPLE) unless done
//   MPI_Request r;
//   { auto lock = mpi.lock(); MPI_Ibarrier(comm, &r); }
//   if (!detail::mpi_wait_all({&r, 1}, deadline, "barrier")) { ... timed out ... }
//
// Contract:
//  - ensure_initialized() initialises MPI when nobody did (asking for MPI_THREAD_MULTIPLE) and then
//    finalises it at exit (std::atexit), after the finalize hooks ran (the MPI stores meet and stop
//    serving there) and the releases ran (the MPI backend's user ops are freed there). When the program
//    initialised MPI itself, it finalises it too, after the last dtensor group is gone and after calling
//    dtensor::mpi_shutdown() (run_finalize_hooks).
//  - Every MPI call dtensor makes runs on the calling thread, under lock(), which serialises the calls
//    when the library gives less than MPI_THREAD_MULTIPLE (Debian's OpenMPI gives MULTIPLE; then lock()
//    takes no mutex). A program that initialised MPI with MPI_THREAD_FUNNELED or SINGLE must then call
//    dtensor from its main thread only.
//  - mpi_wait_all() tests the requests until all completed (true) or the deadline passed (false); MPI
//    errors throw dtensor::Error with MPI's text. It spins on MPI_Testall, yielding the core between
//    tests after the first few (ranks may outnumber cores). MPI makes progress only inside MPI calls:
//    an asynchronous op progresses while some thread of the process tests or waits.

#include "dtensor/core/error.hpp"

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtensor::detail {

using MpiClock = std::chrono::steady_clock;

/// MPI's text for an error code ("MPI_ERR_TRUNCATE: message truncated").
inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) {
    return "MPI error code " + std::to_string(code);
  }
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws Error("<context>: <call> failed: <MPI's text>") unless rc is MPI_SUCCESS. `context` is a string
/// or a callable returning one, called only on failure.
template <class Context>
void check_mpi(int rc, const char* call, Context&& context) {
  if (rc != MPI_SUCCESS) [[unlikely]] {
    std::string where;
    if constexpr (std::is_invocable_v<Context>) {
      where = context();
    } else {
      where = context;
    }
    throw Error(where + ": " + call + " failed: " + mpi_error_text(rc));
  }
}

/// One process's view of the MPI library (see the top of this file).
class MpiRuntime {
public:
  static MpiRuntime& instance() {
    static MpiRuntime r;
    return r;
  }

  /// Initialises MPI unless it is (MPI_Init_thread asking for MPI_THREAD_MULTIPLE; finalised at exit).
  /// Throws Error when MPI was finalised already.
  void ensure_initialized() {
    std::lock_guard guard(m_);
    if (ready_) {
      return;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    DTENSOR_CHECK(!finalized, "MPI backend: MPI was finalized already; dtensor cannot use it again");
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      tune_open_mpi();
      int provided = MPI_THREAD_SINGLE;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread",
                "MPI backend");
      owned_ = true;
      std::atexit(&MpiRuntime::finalize_at_exit);
    }
    MPI_Query_thread(&level_);
    void* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    tag_ub_ = flag != 0 ? *static_cast<int*>(ub) : 32767;
    ready_ = true;
  }

  /// Whether this process initialised MPI (then it finalises it at exit).
  bool owns_mpi() const {
    std::lock_guard guard(m_);
    return owned_;
  }

  /// MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE, as the library provides it.
  int thread_level() const {
    std::lock_guard guard(m_);
    return level_;
  }

  /// The largest tag MPI accepts (MPI_TAG_UB, at least 32767).
  int tag_ub() const {
    std::lock_guard guard(m_);
    return tag_ub_;
  }

  /// Held around every MPI call: a real lock below MPI_THREAD_MULTIPLE, none at it.
  std::unique_lock<std::mutex> lock() {
    if (level_ >= MPI_THREAD_MULTIPLE) {
      return std::unique_lock<std::mutex>(call_m_, std::defer_lock);
    }
    return std::unique_lock<std::mutex>(call_m_);
  }

  /// True when MPI is finalised (dtensor's groups then free nothing: MPI already did).
  static bool finalized() {
    int f = 0;
    MPI_Finalized(&f);
    return f != 0;
  }

  /// Whether the library moves CUDA device memory itself (OpenMPI's MPIX_Query_cuda_support; false for
  /// a library that cannot say).
  static bool cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
  }

  /// Registers `hook` to run before dtensor finalises MPI (e.g. stop a thread that calls MPI); returns
  /// its id for remove_finalize_hook.
  int add_finalize_hook(std::function<void()> hook) {
    std::lock_guard guard(m_);
    hooks_.emplace(next_hook_, std::move(hook));
    return next_hook_++;
  }

  void remove_finalize_hook(int id) {
    std::lock_guard guard(m_);
    hooks_.erase(id);
  }

  /// Registers `release` to run after the finalize hooks, each time they run while MPI is not finalised:
  /// what is made once per process and must be freed before MPI_Finalize (the MPI backend's user ops,
  /// backends/mpi/types.hpp). Kept for the life of the process.
  void add_release(std::function<void()> release) {
    std::lock_guard guard(m_);
    releases_.push_back(std::move(release));
  }

  /// Runs (and forgets) every finalize hook, in the order they were added, then the releases.
  void run_finalize_hooks() {
    std::map<int, std::function<void()>> hooks;
    std::vector<std::function<void()>> releases;
    {
      std::lock_guard guard(m_);
      hooks.swap(hooks_);
      releases = releases_;
    }
    for (auto& [id, hook] : hooks) {
      hook();
    }
    if (!finalized()) {
      for (auto& release : releases) {
        release();
      }
    }
  }

private:
  MpiRuntime() = default;

  /// OpenMPI 4's non-blocking collectives (coll/libnbc) pick, by default, a binomial all_reduce and a
  /// chain-pipelined reduce for few processes: 1.3-2x (all_reduce, 2 processes) and 1.3-4x (reduce, 4
  /// processes) slower from 64 KiB than its Rabenseifner all_reduce and binomial reduce, which are at or
  /// below the blocking calls on one machine (BENCHMARKS.md, "MPI"). dtensor asks for those unless
  /// OMPI_MCA_coll_libnbc_iallreduce_algorithm / _ireduce_algorithm say otherwise; only when dtensor
  /// initialises MPI, and only for Open MPI 4 (MPI_Get_library_version may be called before MPI_Init).
  static void tune_open_mpi() {
    char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int len = 0;
    if (MPI_Get_library_version(version, &len) == MPI_SUCCESS &&
        std::string_view(version, static_cast<std::size_t>(len)).find("Open MPI v4.") !=
            std::string_view::npos) {
      ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3",
               /*overwrite=*/0);                                                // reduce_scatter + all_gather
      ::setenv("OMPI_MCA_coll_libnbc_ireduce_algorithm", "2", /*overwrite=*/0); // binomial
    }
  }

  static void finalize_at_exit() {
    instance().run_finalize_hooks();
    if (!finalized()) {
      MPI_Finalize();
    }
  }

  mutable std::mutex m_;
  std::mutex call_m_;
  bool ready_ = false;
  bool owned_ = false;
  int level_ = MPI_THREAD_SINGLE;
  int tag_ub_ = 32767;
  int next_hook_ = 0;
  std::map<int, std::function<void()>> hooks_;
  std::vector<std::function<void()>> releases_;
};

/// Tests `requests` once (a step of MPI's progress): true when all completed. Completed requests become
/// MPI_REQUEST_NULL. MPI errors throw Error(context + ": " + MPI's text). `statuses` holds one status per
/// request.
template <class Context>
bool mpi_test_all(std::span<MPI_Request> requests, std::span<MPI_Status> statuses, Context&& context) {
  int done = 0;
  int rc = MPI_SUCCESS;
  {
    auto lock = MpiRuntime::instance().lock();
    rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, statuses.data());
  }
  if (rc == MPI_ERR_IN_STATUS) {
    for (const MPI_Status& s : statuses) {
      if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) {
        rc = s.MPI_ERROR;
        break;
      }
    }
  }
  check_mpi(rc, "MPI_Testall", std::forward<Context>(context));
  return done != 0;
}

/// Tests `requests` until all completed (true) or `deadline` passed (false); see the top of this file.
template <class Context>
bool mpi_wait_all(std::span<MPI_Request> requests, MpiClock::time_point deadline, Context&& context) {
  std::vector<MPI_Status> statuses(requests.size());
  for (int spins = 0;; ++spins) {
    if (mpi_test_all(requests, statuses, context)) {
      return true;
    }
    if ((spins & 63) == 63 && MpiClock::now() >= deadline) {
      return false;
    }
    if (spins >= 16) {
      std::this_thread::yield();
    }
  }
}

/// Cancels every pending point-to-point request of `requests` and waits for each to end (MPI guarantees
/// the wait returns: the transfer was cancelled or completed), so nothing uses their buffers afterwards.
/// Never pass collective requests: MPI cannot cancel those.
inline void mpi_cancel_p2p(std::span<MPI_Request> requests) {
  auto lock = MpiRuntime::instance().lock();
  for (MPI_Request& r : requests) {
    if (r != MPI_REQUEST_NULL && MPI_Cancel(&r) == MPI_SUCCESS) {
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
  }
}

} // namespace dtensor::detail
