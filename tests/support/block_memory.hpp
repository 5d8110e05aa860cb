#pragma once
// What a nn::TransformerBlock keeps for its backward, derived term by term (docs/parallel.md, activation
// memory): the formula tests/nn/test_layers.cpp pins a block's bytes to, and tests/train/test_trainer.cpp a
// real step's peak per block.
#include <dtensor/nn/module.hpp>

#include <cstdint>

namespace dtensor::testing {

/// The bytes of T a TransformerBlock's backward keeps beyond the block's input (docs/parallel.md,
/// activation memory), on a rank that holds `tokens` of the batch x sequence (over the data and context
/// axes), the residual stream over tp as well under sequence parallelism. Under Recompute::selective (the
/// bound):
///   RMSNorm 2's input (RMSNorm 1's is the block's input), each RMSNorm's 1/rms per token
///   q, k, v (a + 2g heads of d over tp)
///   the attention's output (W_o's gradient rebuilds its transposed input from it); twice under Ulysses,
///   whose attention keeps its output before the all_to_all back
///   the attention's log-sum-exp per token and head
///   W1's and W3's outputs (f over tp)
/// The norms' outputs are computed again from their inputs and W2's input silu(W1 x) * W3 x from W1's and
/// W3's outputs; the gathered inputs of the column-parallel GEMMs are not kept (under sequence parallelism
/// the shard is, gathered again in the backward). Recompute::none keeps the norms' outputs and silu(W1 x)
/// and W2's input as well; Recompute::full nothing but the block's input.
template <class T>
inline std::int64_t expected_block_kept(const nn::TransformerConfig& c, std::int64_t tokens, int t, bool sp,
                                        int output_copies = 1,
                                        nn::Recompute mode = nn::Recompute::selective) {
  if (mode == nn::Recompute::full) {
    return 0;
  }
  const std::int64_t h = c.hidden, a = c.heads, g = c.kv_head_count(), d = c.head_dim(), f = c.ffn;
  const std::int64_t residual_tokens = sp ? tokens / t : tokens;
  const std::int64_t norms = residual_tokens * h + 2 * residual_tokens;
  const std::int64_t attention =
      tokens * (a + 2 * g) * d / t + output_copies * tokens * a * d / t + tokens * a / t;
  const std::int64_t mlp = 2 * tokens * f / t;
  const std::int64_t rebuilt = mode == nn::Recompute::none ? 2 * residual_tokens * h + 2 * tokens * f / t : 0;
  return std::int64_t(sizeof(T)) * (norms + attention + mlp + rebuilt);
}

} // namespace dtensor::testing
