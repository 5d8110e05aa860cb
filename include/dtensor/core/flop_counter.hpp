#pragma once
// FlopCounter: the floating-point operations of the GEMMs and attention this thread ran while the counter
// was in scope, as torch's FlopCounterMode counts them: 2mnk a GEMM, and for attention its two (forward)
// or five (backward) GEMMs over the query-key pairs a query sees (causal: the keys at or before it).
//
//   dtensor::FlopCounter flops;
//   trainer.step(ids, targets, opt);
//   flops.flops();                    // the step's model flops on this rank: 6 x params x tokens, and more
//
// The local kernels (local/gemm.hpp, local/grouped_gemm.hpp, local/attention.hpp) add what they compute on
// every device, meta tensors included (core/device.hpp), where nothing runs: a dry run counts what the real
// step would. Counters nest freely: each reads one running count per thread (this thread's flop clock,
// which the op log of CommDebugMode uses to place ops on the step's timeline, plan/comm_time.hpp).

namespace dtensor {

namespace detail {

/// This thread's flop clock: every flop its local kernels counted since it started.
inline double& thread_flops() noexcept {
  thread_local double flops = 0;
  return flops;
}

} // namespace detail

/// Adds `flops` to this thread's flop clock (the local kernels call it).
inline void count_flops(double flops) noexcept {
  detail::thread_flops() += flops;
}

/// The flops this thread counted since the counter was made (or reset).
class FlopCounter {
public:
  FlopCounter() noexcept : start_(detail::thread_flops()) {}

  double flops() const noexcept { return detail::thread_flops() - start_; }
  void reset() noexcept { start_ = detail::thread_flops(); }
  /// This thread's flop clock: every flop it counted since it started (plan/comm_time.hpp's timeline).
  static double clock() noexcept { return detail::thread_flops(); }

private:
  double start_;
};

} // namespace dtensor
