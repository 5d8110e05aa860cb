#pragma once
// WithBackward: what a differentiable op returns, its output and the typed context of its backward, so a
// backward pass is written by hand without an autograd engine or a tape:
//
//   auto [y, back] = dtensor::autograd::all_gather(x, /*dim=*/0, group);   // backward/collectives.hpp
//   auto [z, back2] = dtensor::redistribute_with_backward<Replicate>(d);    // backward/redistribute.hpp
//   auto gx = back(gy);

namespace dtensor {

/// A forward's output and the context of its backward: `auto [y, back] = op(...)`.
template <class Output, class Backward>
struct WithBackward {
  Output output;
  Backward backward;
};

/// An input a backward keeps as it was: what ops that can also take a function computing their input again
/// (`all_gather_linear(x, ws, with_backward, again)`) keep by default. `again()` gives it back.
template <class X>
struct Kept {
  X value;
  const X& operator()() const { return value; }
};

} // namespace dtensor

namespace dtensor {

/// Tag selecting the form of an op that also returns its backward context: `relu(x, with_backward)`.
struct WithBackwardTag {
  explicit WithBackwardTag() = default;
};
inline constexpr WithBackwardTag with_backward{};

/// Tag selecting the form of a layer whose backward is split for zero-bubble pipelines: its backward gives
/// the input's gradient now and a function computing the parameters' gradients later (nn::SplitGradients).
struct WithSplitBackwardTag {
  explicit WithSplitBackwardTag() = default;
};
inline constexpr WithSplitBackwardTag with_split_backward{};

} // namespace dtensor
