#pragma once
// The losses a model's loss_function() returns (nn/contract.hpp): callables f(y, target) giving the
// loss, a rank-0 Replicate DTensor (the mean over the global batch), and f(y, target, with_backward) giving
// it with its backward: back(g) is y's gradient for a loss gradient g (the trainers pass 1 / K for one of K
// micro-batches). Any callable of that form is a loss: a user's own is written the same way.
//
//   auto loss_function() const { return nn::MseLoss{}; }            // regression
//   auto loss_function() const { return nn::CrossEntropyLoss{}; }    // classes or a vocabulary, sharded
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/ops/loss.hpp"

namespace dtensor::nn {

/// The mean cross-entropy of logits (rows..., classes) against integer targets (rows...): dtensor::
/// cross_entropy, which takes the classes sharded (a vocab-parallel head) without gathering them.
struct CrossEntropyLoss {
  template <AnyDTensor Y, AnyDTensor Target>
  auto operator()(const Y& logits, const Target& target) const {
    return cross_entropy(logits, target);
  }
  template <AnyDTensor Y, AnyDTensor Target>
  auto operator()(const Y& logits, const Target& target, WithBackwardTag) const {
    return cross_entropy(logits, target, with_backward);
  }
};

/// The mean squared error of y against a target of y's type: dtensor::mse_loss.
struct MseLoss {
  template <AnyDTensor Y>
  auto operator()(const Y& y, const Y& target) const {
    return mse_loss(y, target);
  }
  template <AnyDTensor Y>
  auto operator()(const Y& y, const Y& target, WithBackwardTag) const {
    return mse_loss(y, target, with_backward);
  }
};

} // namespace dtensor::nn
