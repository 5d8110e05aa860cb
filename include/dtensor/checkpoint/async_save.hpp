#pragma once
// checkpoint::save_async: save() while the caller goes on (torch.distributed.checkpoint's async_save).
//
//   checkpoint::PendingSave pending = checkpoint::save_async("run/step-100", {{"w", w}, {"b", b}});
//   ...                                    // train on: w and b may change at once
//   pending.wait();                        // published (or the save's error, on every rank)
//
// On the calling thread (collective over the tensors' world, one broadcast): the checks, rank 0 makes the
// empty "<dir>.tmp", and this rank's blocks are copied to the host (a snapshot: the values of the call).
// A thread then writes and syncs this rank's file, and the ranks finish through the job's store
// (ProcessGroup::backend().job_store()) rather than collectives, so the caller's ops on the same groups
// go on meanwhile: each rank posts its file's description, rank 0 writes the index and swaps the
// directory in as save() does (atomically: a reader sees the previous checkpoint or this one, whole), and
// posts the outcome, which every rank's PendingSave reads. A save killed at any point leaves the previous
// checkpoint current and "<dir>.tmp" behind (the next save clears it).
//
// A PendingSave's destructor waits; while an exception unwinds it abandons the save instead (the previous
// checkpoint stays). Wait for a save before starting the next one of the same directory. Without a store
// (the fake backend of dry runs) the save runs synchronously and the PendingSave is ready at once.

#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dtensor/checkpoint/save.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/store.hpp"

namespace dtensor::checkpoint {

/// A save running in the background (see the top of this file).
class PendingSave {
public:
  /// Nothing pending: ready, and wait() returns at once.
  PendingSave() = default;
  PendingSave(PendingSave&&) noexcept = default;
  PendingSave& operator=(PendingSave&& other) noexcept {
    if (this != &other) {
      (void)finish(std::uncaught_exceptions() > 0);
      state_ = std::move(other.state_);
    }
    return *this;
  }
  ~PendingSave() { (void)finish(std::uncaught_exceptions() > 0); }

  /// Whether the outcome is known on this rank (wait() would not block).
  bool ready() const { return state_ == nullptr || state_->done.load(); }

  /// Blocks until the save is published (then returns) or failed (then throws its error, on every rank).
  /// Once it returned or threw, the PendingSave is empty.
  void wait() {
    const std::string error = finish(false);
    DTENSOR_CHECK(error.empty(), error);
  }

  /// Runs `work(cancelled)` on a thread: its return is the save's error ("" when published).
  explicit PendingSave(std::function<std::string(const std::atomic<bool>&)> work)
      : state_(std::make_unique<State>()) {
    State* s = state_.get();
    s->thread = std::thread([s, work = std::move(work)] {
      try {
        s->error = work(s->cancel);
      } catch (const std::exception& e) {
        s->error = e.what();
      }
      s->done.store(true);
    });
  }

  /// `save()` run now, on this thread (where there is no store to finish through): a ready PendingSave
  /// with its outcome.
  static PendingSave now(const std::function<void()>& save) {
    PendingSave p;
    p.state_ = std::make_unique<State>();
    try {
      save();
    } catch (const std::exception& e) {
      p.state_->error = e.what();
    }
    p.state_->done.store(true);
    return p;
  }

private:
  struct State {
    std::thread thread;
    std::atomic<bool> cancel{false};
    std::atomic<bool> done{false};
    std::string error;
  };

  /// Waits (abandon: asks the thread to give up its waits on the store first) and takes the outcome: the
  /// save's error, "" when published or nothing was pending.
  std::string finish(bool abandon) noexcept {
    if (state_ == nullptr) {
      return "";
    }
    if (abandon) {
      state_->cancel.store(true);
    }
    if (state_->thread.joinable()) {
      state_->thread.join();
    }
    std::string error = std::move(state_->error);
    state_.reset();
    return error;
  }

  std::unique_ptr<State> state_;
};

namespace detail {

/// Where a rank's part of an asynchronous save goes: part `part` of `parts` (0: not saved in parts), its
/// files in `subdir` of the save's directory (empty: the directory itself); the publisher is rank 0 of
/// part 0.
struct SaveSlot {
  int part = 0;
  int parts = 0;
  std::string subdir;
};

/// What a step of an asynchronous save posts to the store: "ok:<what fn returns>", or "error:<prefix><its
/// exception>".
inline std::string outcome_of(const std::string& prefix, const std::function<std::string()>& fn) {
  try {
    return "ok:" + fn();
  } catch (const std::exception& e) {
    return "error:" + prefix + e.what();
  }
}

/// The value under `key` of `store`, waiting up to `limit` in slices, so that `cancel` is seen within
/// 100 ms. Throws Error on cancel and on timeout (naming `who`).
inline std::string await_key(Store& store, const std::string& key, std::chrono::milliseconds limit,
                             const std::atomic<bool>& cancel, const std::string& who) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    DTENSOR_CHECK(!cancel.load(), "abandoned (an exception on this rank)");
    if (store.check({key})) {
      const std::vector<char> v = store.get(key);
      return std::string(v.begin(), v.end());
    }
    DTENSOR_CHECK(std::chrono::steady_clock::now() < until,
                  who + " did not finish within " + std::to_string(limit.count()) + " ms");
    try {
      store.wait({key}, std::chrono::milliseconds(100));
    } catch (const TimeoutError&) {
    }
  }
}

/// The outcome another step posted under `key` (await_key; the key is removed): what it returned; its error
/// is thrown.
inline std::string take_outcome(Store& store, const std::string& key, std::chrono::milliseconds limit,
                                const std::atomic<bool>& cancel, const std::string& who) {
  const std::string v = await_key(store, key, limit, cancel, who);
  store.delete_key(key);
  DTENSOR_CHECK(v.rfind("ok:", 0) == 0, v.substr(v.find(':') + 1));
  return v.substr(3);
}

/// A key of the job's store for the n-th call about `what` of this rank: "dtensor/<kind>/<what>/<n>", n
/// counting the calling thread's calls (a rank's thread: the same on every rank, the calls being
/// collective; ranks that are threads of one process count apart).
inline std::string collective_key(const std::string& kind, const std::filesystem::path& what) {
  thread_local std::map<std::string, int> count;
  const std::string k = kind + "/" + std::filesystem::absolute(what).lexically_normal().string();
  return "dtensor/" + k + "/" + std::to_string(count[k]++);
}

/// The background half of an asynchronous save of `tensors` (snapshots) into `tmp`, published as `dir`
/// by the publisher after `publish` (the parts' list, when in parts); see the top of this file. The error,
/// "" when published.
inline std::string finish_async_save(const std::filesystem::path& dir, const std::filesystem::path& tmp,
                                     const std::vector<Named>& tensors, const SaveOptions& options,
                                     const SaveSlot& slot, Store& store, const std::string& keys,
                                     const std::function<void()>& publish, const std::atomic<bool>& cancel) {
  const ProcessGroup& world = tensors.front().world();
  const int rank = world.rank();
  const std::chrono::milliseconds limit = world.timeout();
  const std::filesystem::path files = slot.subdir.empty() ? tmp : tmp / slot.subdir;
  const std::string part = keys + "/part-" + std::to_string(slot.part);
  store.set(part + "/file-" + std::to_string(rank), outcome_of("rank " + std::to_string(rank) + ": ", [&] {
              return write_rank_file(files, tensors, rank, options.chunk_bytes);
            }));
  if (rank == 0) { // the part's index
    store.set(part + "/index", outcome_of("", [&] {
                std::vector<std::string> all;
                for (int r = 0; r < world.size(); ++r) {
                  all.push_back(take_outcome(store, part + "/file-" + std::to_string(r), limit, cancel,
                                             "rank " + std::to_string(r)));
                }
                if (options.on_stage) {
                  options.on_stage("files");
                }
                write_index(dir, files, tensors, all, options.chunk_bytes);
                if (options.on_stage) {
                  options.on_stage("index");
                }
                return std::string();
              }));
  }
  if (rank == 0 && slot.part == 0) { // the publisher
    store.set(keys + "/done", outcome_of("", [&] {
                for (int p = 0; p < std::max(slot.parts, 1); ++p) {
                  take_outcome(store, keys + "/part-" + std::to_string(p) + "/index", limit, cancel,
                               "part " + std::to_string(p) + "'s index");
                }
                if (publish) {
                  publish();
                }
                swap_in(tmp, dir);
                return std::string();
              }));
  }
  const std::string done = await_key(store, keys + "/done", limit, cancel, "the publisher (rank 0)");
  if (store.add(keys + "/read", 1) == std::int64_t(world.size()) * std::max(slot.parts, 1)) {
    store.delete_key(keys + "/done");
    store.delete_key(keys + "/read");
  }
  return done.rfind("ok:", 0) == 0 ? std::string()
                                   : "checkpoint::save_async " + dir.string() + ": " + done.substr(6);
}

/// The snapshots of `tensors` an asynchronous save writes.
inline std::vector<Named> snapshots(const std::vector<Named>& tensors) {
  std::vector<Named> out;
  out.reserve(tensors.size());
  for (const Named& t : tensors) {
    out.push_back(t.snapshot());
  }
  return out;
}

} // namespace detail

/// Saves `tensors` into `dir` as save() does, in the background (see the top of this file). Collective
/// over the tensors' world: every rank calls it with the same names in the same order.
inline PendingSave save_async(const std::filesystem::path& dir, const std::vector<Named>& tensors,
                              SaveOptions options = {}) {
  detail::check_save(dir, tensors, options);
  const ProcessGroup& world = tensors.front().world();
  Store* store = world.backend().job_store();
  if (store == nullptr) { // no store to finish through: now, on this thread
    return PendingSave::now([&] { save(dir, tensors, options); });
  }
  const std::filesystem::path tmp = detail::sibling(dir, ".tmp");
  detail::on_rank0(world, tensors.front().device(), [&] { detail::prepare_save(dir, tmp, tensors); });
  const std::string keys = detail::collective_key("async_save", dir);
  return PendingSave([dir, tmp, snap = detail::snapshots(tensors), options = std::move(options), store,
                      keys](const std::atomic<bool>& cancel) {
    return detail::finish_async_save(dir, tmp, snap, options, {}, *store, keys, {}, cancel);
  });
}

} // namespace dtensor::checkpoint
