#pragma once
// What the trainer tests of models of the contract share (tests/train/test_any_model.cpp,
// test_vision.cpp): a run's losses, gradient norms and final parameters, read from any trainer, and their
// comparison with the one-rank run. Parameters are keyed by their index in nn::model_parameters' order, so
// a pipeline stage compares the parameters it holds.
#include <dtensor/core/error.hpp>
#include <dtensor/nn/contract.hpp>
#include <dtensor/train/optim.hpp>
#include <dtensor/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace dtensor::testing {

struct ModelRun {
  std::vector<double> losses, norms;
  std::map<int, std::vector<double>> params; ///< by index in nn::model_parameters' order
};

/// The values of DTensor w, gathered.
template <class W>
std::vector<double> full_values(const W& w) {
  const auto full = w.full_tensor();
  return std::vector<double>(full.data(), full.data() + full.numel());
}

/// The final parameters of a trainer's model: with_gathered (DDP, FSDP), or for_each_parameter (a
/// pipeline: this rank's).
template <class Trainer>
void read_params(Trainer& trainer, ModelRun& run) {
  if constexpr (requires { trainer.for_each_parameter([](int, const auto&) {}); }) {
    trainer.for_each_parameter([&](int i, const auto& w) { run.params[i] = full_values(w); });
  } else {
    trainer.with_gathered([&](auto& m) {
      int i = 0;
      nn::for_each_tensor(nn::model_parameters(m), [&](const auto& w) { run.params[i++] = full_values(w); });
    });
  }
}

/// The optimizer of the runs: AdamW, lr 2e-2, weight decay 0.01.
inline optim::AdamW run_optimizer() {
  return optim::AdamW({.lr = 2e-2, .weight_decay = 0.01});
}

/// Steps [first, last) of `trainer` with `opt` on batch_of(step): a std::vector of (input, target) pairs,
/// trained as micro-batches when `micro` (else its first pair as the batch). Then the parameters.
template <class Trainer, class Optimizer, class BatchOf>
ModelRun train_steps(Trainer& trainer, Optimizer& opt, int first, int last, bool micro, BatchOf&& batch_of) {
  ModelRun run;
  for (int s = first; s < last; ++s) {
    const auto batches = batch_of(s);
    const nn::StepResult r = micro ? trainer.step(std::span(batches), opt)
                                   : trainer.step(batches[0].first, batches[0].second, opt);
    run.losses.push_back(r.loss);
    run.norms.push_back(r.grad_norm);
  }
  read_params(trainer, run);
  return run;
}
/// `steps` steps from a fresh run_optimizer().
template <class Trainer, class BatchOf>
ModelRun train_steps(Trainer& trainer, int steps, bool micro, BatchOf&& batch_of) {
  auto opt = run_optimizer();
  return train_steps(trainer, opt, 0, steps, micro, batch_of);
}

/// `run` from step `first` on: its later losses and norms, the same parameters.
inline ModelRun steps_from(ModelRun run, int first) {
  run.losses.erase(run.losses.begin(), run.losses.begin() + first);
  run.norms.erase(run.norms.begin(), run.norms.begin() + first);
  return run;
}

/// got equals want within `tol` (relative): every loss and norm, and every parameter got holds.
inline void compare_runs(const ModelRun& got, const ModelRun& want, const std::string& name, double tol) {
  const auto expect = [](bool ok, const std::string& what) { DTENSOR_CHECK(ok, what); };
  expect(got.losses.size() == want.losses.size(), name + ": the number of steps");
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    expect(std::abs(got.losses[s] - want.losses[s]) <= tol * std::abs(want.losses[s]),
           name + ": step " + std::to_string(s) + "'s loss " + std::to_string(got.losses[s]) + ", one rank " +
               std::to_string(want.losses[s]));
    expect(std::abs(got.norms[s] - want.norms[s]) <= tol * std::abs(want.norms[s]),
           name + ": step " + std::to_string(s) + "'s gradient norm " + std::to_string(got.norms[s]) +
               ", one rank " + std::to_string(want.norms[s]));
  }
  expect(!got.params.empty(), name + ": no parameters read");
  for (const auto& [i, values] : got.params) {
    const auto it = want.params.find(i);
    expect(it != want.params.end() && it->second.size() == values.size(),
           name + ": parameter " + std::to_string(i) + " is not the one-rank model's");
    for (std::size_t e = 0; e < values.size(); ++e) {
      const double d = std::abs(values[e] - it->second[e]);
      expect(d <= tol * std::max(1.0, std::abs(it->second[e])), name + ": parameter " + std::to_string(i) +
                                                                    " element " + std::to_string(e) +
                                                                    " differs by " + std::to_string(d));
    }
  }
}

} // namespace dtensor::testing
