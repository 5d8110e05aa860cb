#pragma once
// CheckpointFolder: a run's training states in one folder, saved every so many steps (in the background by
// default) and resumed from the latest complete one by itself: with dtensor-run --max-restarts, a run that
// loses a rank starts again and goes on from its last save, on the same layout bit for bit, or on fewer
// ranks after an elastic restart (the states reload onto any layout of the same model: train_state.hpp).
//
//   CheckpointFolder ckpt("run/ckpt", {.every = 50});
//   TrainingProgress p = ckpt.resume(trainer, opt);     // the latest complete state; step 0 when none
//   for (std::int64_t s = p.step; s < steps; ++s) {
//     trainer.step(batch_of(s), opt);                   // the data a function of the step
//     ckpt.step_done(trainer, opt, {.step = s + 1, .data_position = (s + 1) * batch});  // saves every 50
//   }
//   ckpt.wait();                                        // the last save published (or its error thrown)
//
// On disk: <folder>/step-<N>, the state after N steps (save_training_state's, one checkpoint or one part per
// pipeline stage), published in one rename; the `keep` newest are kept, older ones removed once a newer one
// is published. A save in progress, or one killed, is "<folder>/step-<N>.tmp": never read, cleared by a
// later save. The latest complete state is the highest N whose step-<N> holds index.json or parts.json.
//
// Every rank of the trainer makes the same calls. Global rank 0 chooses the state to resume and tells the
// others through the job's store, so every rank loads the same one; it also removes the old states.

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "dtensor/checkpoint/async_save.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/rendezvous/store.hpp"
#include "dtensor/train/train_state.hpp"

namespace dtensor {

/// How a CheckpointFolder saves.
struct CheckpointFolderOptions {
  /// step_done saves when the progress's step is a multiple of it (0: only explicit save() calls).
  std::int64_t every = 0;
  /// Complete states kept (at least 1): the newest.
  int keep = 2;
  /// Saves in the background (save_training_state_async): the step waits only for the host copy of the state.
  bool async = true;
};

/// A run's states in one folder (see the top of this file).
class CheckpointFolder {
public:
  explicit CheckpointFolder(std::filesystem::path folder, CheckpointFolderOptions options = {})
      : folder_(std::move(folder)), options_(options) {
    DTENSOR_CHECK(options_.keep >= 1, "CheckpointFolder " + folder_.string() +
                                          ": keep must be at least 1, not " + std::to_string(options_.keep));
    DTENSOR_CHECK(options_.every >= 0, "CheckpointFolder " + folder_.string() +
                                           ": every must be 0 (no periodic saves) or positive, not " +
                                           std::to_string(options_.every));
  }
  CheckpointFolder(const CheckpointFolder&) = delete;
  CheckpointFolder& operator=(const CheckpointFolder&) = delete;
  /// Waits for a save in flight; while an exception unwinds, abandons it (the previous state stays).
  ~CheckpointFolder() = default;

  const std::filesystem::path& folder() const noexcept { return folder_; }
  const CheckpointFolderOptions& options() const noexcept { return options_; }

  /// The directory of the state after `step` steps.
  std::filesystem::path state(std::int64_t step) const { return folder_ / ("step-" + std::to_string(step)); }

  /// The steps whose states are complete, ascending (this process's view of the folder).
  std::vector<std::int64_t> complete_steps() const {
    namespace fs = std::filesystem;
    std::vector<std::int64_t> steps;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(folder_, ec)) {
      const std::optional<std::int64_t> step = step_of(e.path().filename().string());
      if (step && (fs::exists(e.path() / "index.json") || fs::exists(e.path() / "parts.json"))) {
        steps.push_back(*step);
      }
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }

  /// The latest complete state; nullopt when there is none.
  std::optional<std::filesystem::path> latest() const {
    const std::int64_t step = latest_step();
    return step < 0 ? std::nullopt : std::optional(state(step));
  }

  /// Loads the latest complete state into `trainer` and `opt` (any layout and trainer of the same model)
  /// and returns its progress; a fresh run's (step 0) when the folder holds none. Global rank 0 chooses,
  /// so every rank loads the same state. Collective over every rank of the trainer.
  template <class Trainer, class Opt>
  TrainingProgress resume(Trainer& trainer, Opt& opt) {
    const std::int64_t step = agreed_latest(trainer.mesh().world());
    if (step < 0) {
      return {};
    }
    TrainingProgress p = load_training_state(trainer, state(step), opt);
    DTENSOR_CHECK(p.step == step, "CheckpointFolder::resume: " + state(step).string() + " says step " +
                                      std::to_string(p.step) + ", its name " + std::to_string(step));
    return p;
  }

  /// Saves the state after `progress.step` steps as state(progress.step): waits for the previous save
  /// first, then saves in the background (options().async) or now. Collective over every rank of the trainer.
  template <class Trainer, class Opt>
  void save(Trainer& trainer, const Opt& opt, const TrainingProgress& progress) {
    wait();
    rank0_ = trainer.mesh().world().rank() == 0;
    if (rank0_) {
      std::filesystem::create_directories(folder_);
    }
    const std::filesystem::path dir = state(progress.step);
    if (options_.async) {
      pending_ = save_training_state_async(trainer, dir, opt, progress);
    } else {
      save_training_state(trainer, dir, opt, progress);
      prune();
    }
  }

  /// After a training step: saves when options().every divides `progress.step`; whether it did.
  template <class Trainer, class Opt>
  bool step_done(Trainer& trainer, const Opt& opt, const TrainingProgress& progress) {
    if (options_.every == 0 || progress.step % options_.every != 0) {
      return false;
    }
    save(trainer, opt, progress);
    return true;
  }

  /// Until the save in flight is published (then the states beyond `keep` are removed); throws its error.
  void wait() {
    pending_.wait();
    prune();
  }

private:
  /// N of "step-<N>" (decimal digits only); nullopt for any other name.
  static std::optional<std::int64_t> step_of(const std::string& name) {
    if (name.size() <= 5 || name.rfind("step-", 0) != 0 || name[5] < '0' || name[5] > '9') {
      return std::nullopt;
    }
    const char* const end = name.data() + name.size();
    std::int64_t n = 0;
    const auto [at, error] = std::from_chars(name.data() + 5, end, n);
    return error == std::errc() && at == end ? std::optional(n) : std::nullopt;
  }

  /// This process's latest complete step; -1 when there is none.
  std::int64_t latest_step() const {
    const std::vector<std::int64_t> steps = complete_steps();
    return steps.empty() ? -1 : steps.back();
  }

  /// Global rank 0's latest complete step (-1: none), the same on every rank: through the job's store.
  std::int64_t agreed_latest(const ProcessGroup& world) {
    Store* store = world.backend().job_store();
    if (store == nullptr || world.size() == 1) {
      return latest_step();
    }
    const std::string key = checkpoint::detail::collective_key("checkpoint_folder_resume", folder_);
    if (world.rank() == 0) {
      const std::int64_t step = latest_step();
      store->set(key, std::to_string(step));
      return step;
    }
    const std::vector<char> v = store->get(key);
    return std::stoll(std::string(v.begin(), v.end()));
  }

  /// Global rank 0 removes the complete states beyond `keep` and the leftovers of older saves.
  void prune() {
    namespace fs = std::filesystem;
    if (!rank0_) {
      return;
    }
    const std::vector<std::int64_t> steps = complete_steps();
    if (steps.empty()) {
      return;
    }
    const std::size_t drop = steps.size() > std::size_t(options_.keep) ? steps.size() - options_.keep : 0;
    for (std::size_t i = 0; i < drop; ++i) {
      fs::remove_all(state(steps[i]));
    }
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(folder_, ec)) { // a killed save's .tmp or .old, older
      const std::string name = e.path().filename().string();
      const auto dot = name.rfind('.');
      if (dot == std::string::npos || (name.substr(dot) != ".tmp" && name.substr(dot) != ".old")) {
        continue;
      }
      const std::optional<std::int64_t> step = step_of(name.substr(0, dot));
      if (step && *step < steps.back()) {
        fs::remove_all(e.path());
      }
    }
  }

  std::filesystem::path folder_;
  CheckpointFolderOptions options_;
  checkpoint::PendingSave pending_;
  bool rank0_ = false; ///< global rank 0 (of the trainer of the last save): prunes
};

} // namespace dtensor
