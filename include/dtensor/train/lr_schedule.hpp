#pragma once
// Learning-rate schedules as values: the rate of step s, set on an optimizer before its step.
//
//   const optim::WarmupCosine lr{.peak = 3e-3, .warmup = 20, .steps = 450};
//   for (int s = 0; s < 450; ++s) { opt.set_lr(lr(s)); trainer.step(input, target, opt); }
#include <algorithm>
#include <cmath>

namespace dtensor::optim {

/// A linear warmup to `peak` over the first `warmup` steps (step s at (s + 1) / warmup of it), then a cosine
/// decay from `peak` to `floor * peak` over the remaining steps up to `steps` (torch's LinearLR then
/// CosineAnnealingLR with eta_min = floor * peak).
struct WarmupCosine {
  double peak = 1e-3;
  int warmup = 0;
  int steps = 1;
  double floor = 0.1;

  double operator()(int s) const {
    if (s < warmup) {
      return peak * double(s + 1) / double(warmup);
    }
    const double t = double(s - warmup) / double(std::max(1, steps - warmup));
    return peak * (floor + (1 - floor) * 0.5 * (1 + std::cos(3.141592653589793 * std::min(1.0, t))));
  }
};

} // namespace dtensor::optim
