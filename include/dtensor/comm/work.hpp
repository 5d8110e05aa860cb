#pragma once
// Work: the handle an `async_op` collective or point-to-point op returns (torch.distributed's Work).
//
//   auto work = dtensor::all_reduce(t, dtensor::ReduceOp::sum, group, dtensor::async_op);
//   compute_something_else();
//   work.wait();          // t now holds the sum; rethrows the op's error (dtensor::Error / TimeoutError)

#include "dtensor/backends/backend.hpp"

#include <functional>
#include <memory>
#include <utility>

namespace dtensor {

/// Tag type selecting the asynchronous overload of a collective: `all_reduce(t, op, group, async_op)`.
struct AsyncOp {
  explicit AsyncOp() = default;
};
inline constexpr AsyncOp async_op{};

/// Completion handle of an asynchronous op. Copyable (copies share the op); a default-constructed Work is
/// already complete. The tensors the op reads and writes are kept alive until it completes.
/// Dropping the last copy of an unfinished op's Work waits for the op (bounded by its timeout).
class Work {
public:
  Work() = default;

  /// `keep_alive` is held until the op completes; `finish` runs once, in the first wait() that succeeds
  /// (it copies staged results into the caller's tensors).
  explicit Work(std::shared_ptr<WorkImpl> impl, std::shared_ptr<void> keep_alive = {},
                std::function<void()> finish = {})
      : state_(std::make_shared<State>(std::move(impl), std::move(keep_alive), std::move(finish))) {}

  /// Non-blocking: true once the op finished (successfully or not). Results are visible after wait().
  bool is_completed() const { return !state_ || !state_->impl || state_->impl->is_completed(); }

  /// Blocks until the op finished and its results are in the output tensors; rethrows its error.
  void wait() const {
    if (!state_ || !state_->impl) {
      return;
    }
    state_->impl->wait();
    if (state_->finish) {
      auto finish = std::exchange(state_->finish, nullptr);
      finish();
    }
  }

  /// The backend's completion object (nullptr for a default-constructed Work).
  const std::shared_ptr<WorkImpl>& impl() const noexcept {
    static const std::shared_ptr<WorkImpl> none;
    return state_ ? state_->impl : none;
  }

private:
  struct State {
    std::shared_ptr<WorkImpl> impl;
    std::shared_ptr<void> keep_alive;
    std::function<void()> finish;

    State(std::shared_ptr<WorkImpl> i, std::shared_ptr<void> k, std::function<void()> f)
        : impl(std::move(i)), keep_alive(std::move(k)), finish(std::move(f)) {}
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    /// The last handle of an unfinished op waits for it (bounded by the op's timeout) before releasing
    /// the tensors it reads and writes, so dropping an isend's Work cannot free a buffer in flight.
    /// Errors are dropped here: nobody is left to receive them.
    ~State() {
      if (impl && keep_alive && !impl->is_completed()) {
        try {
          impl->wait();
        } catch (...) {
        }
      }
    }
  };
  std::shared_ptr<State> state_;
};

} // namespace dtensor
