#pragma once
// Activation checkpointing (torch.utils.checkpoint.checkpoint; named activation_checkpoint here, apart from
// the sharded checkpoints of checkpoint/): trade compute for memory by keeping a block's inputs instead of
// the activations its backward would need, and running its forward again in the backward.
//
//   auto block = [&](const Act& h, const W& w, WithBackwardTag) { ...; return WithBackward{out, back}; };
//   auto [y, back] = activation_checkpoint(block, h, w); // runs block; keeps h and w, not its activations
//   ...
//   auto grads = back(dy); // runs block(h, w, with_backward) again, then its backward
//
// `f(inputs..., with_backward)` is a differentiable function in the library's form: it returns something
// with `.output` and `.backward` (WithBackward, or any struct with those members). The forward runs as
// `f(inputs...)` when f has that form too (no backward context is made at all), otherwise as
// `f(inputs..., with_backward)`, whose context is dropped at once; the result is WithBackward{output,
// recompute}, where recompute(dy) = f(inputs..., with_backward).backward(dy). Between forward and backward
// only the inputs (handles: DTensors share their storage) and the output are held; the forward runs twice.
// The recomputation repeats the forward's collectives (a tensor-parallel block gathers again) and its
// random draws: the library's dropout and init are keyed by explicit seeds and offsets, so the recomputed
// forward is the first one again, and the gradients equal those without checkpointing bit for bit.

#include <concepts>
#include <type_traits>
#include <utility>

#include "dtensor/backward/with_backward.hpp"

namespace dtensor {

template <class F, class... A>
requires std::invocable<const F&, const A&..., WithBackwardTag>
auto activation_checkpoint(F f, const A&... inputs) {
  auto output = [&] {
    if constexpr (std::invocable<const F&, const A&...>) {
      return f(inputs...);
    } else {
      return f(inputs..., with_backward).output; // the context dies here
    }
  }();
  auto recompute = [f = std::move(f), inputs...](const auto& dy) {
    return f(inputs..., with_backward).backward(dy);
  };
  return WithBackward<decltype(output), decltype(recompute)>{std::move(output), std::move(recompute)};
}

} // namespace dtensor
