#pragma once
// Optimizers on sharded parameters: torch.optim.SGD and torch.optim.AdamW applied to the local shards of
// DTensor parameters whose gradients have the same placements (Shard or Replicate on each mesh axis).
// An elementwise update needs no communication, so each rank steps its own shard; a replicated parameter
// is stepped identically on every rank that holds it.
//
//   optim::AdamW opt({.lr = 1e-3, .weight_decay = 0.01});
//   opt.step(0, w1, dw1);                           // w1 [R,S(1)], dw1 [R,S(1)]: updated in place
//   opt.step(std::tie(w1, w2), std::tie(dw1, dw2)); // parameter i = tuple element i
//   opt.step(3, flat_shard, flat_grad_shard);       // raw local shards (Tensor<T, 1>), e.g. an FSDP buffer
//
// Parameters are numbered by the caller; each has its own state and step count (as torch's per-parameter
// state['step']), created on its first step as local tensors of its shard's shape: SGD's momentum_buffer,
// AdamW's exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad). State is kept in float (double for double
// parameters): for bfloat16 / half parameters it is fp32. With `master_weights` such a parameter also gets
// an fp32 copy (made from it on its first step) that the update is applied to, and the parameter is that
// copy rounded; without it the update is computed in fp32 from the parameter and rounded into it at every
// step (torch with bf16 parameters keeps bf16 state; we do not).
//
// A Partial gradient does not compile: it is a sum pending over ranks, reduce it first (redistribute it to
// the parameter's placements, or let DDPReducer average it). The update runs as a local kernel on the
// library's launcher (local/copy.hpp: Thrust's cpp system on the host, a kernel on the parameter's
// stream for CUDA tensors in an nvcc translation unit). Each step is one pass over the shard: on the host,
// without amsgrad or master weights, in blocks that vectorise (the same operations, rounded alike).

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor::optim {

/// torch.optim.SGD's options (lr has no default in torch < 2.2; 1e-3 since).
struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  bool maximize = false;
  /// bfloat16 / half parameters: keep an fp32 copy and step it (ignored for float and double).
  bool master_weights = false;
};

/// torch.optim.AdamW's options (betas = (beta1, beta2)); weight decay is decoupled: p *= 1 - lr * wd.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
  /// bfloat16 / half parameters: keep an fp32 copy and step it (ignored for float and double).
  bool master_weights = false;
};

/// The state of one parameter: local tensors of its shard's shape, in state_t of its element type;
/// undefined until the step that needs them.
struct ParamState {
  std::int64_t step = 0;         ///< steps taken (torch's state['step'])
  AnyTensor momentum_buffer;     ///< SGD with momentum
  AnyTensor exp_avg, exp_avg_sq; ///< AdamW
  AnyTensor max_exp_avg_sq;      ///< AdamW with amsgrad
  AnyTensor master;              ///< the fp32 copy of a bfloat16 / half parameter (master_weights)
};

/// The type an optimizer keeps state in and computes in for parameters of type T.
template <class T>
using state_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

} // namespace dtensor::optim

namespace dtensor::optim::detail {

using dtensor::detail::shape_to_string;

template <class T>
consteval bool check_optimizer_element() {
  static_assert(std::is_floating_point_v<T> || dtensor::detail::is_reduced_float_v<T>,
                "optimizer step: parameters must have a floating element type (float, double, bfloat16, "
                "half)");
  return true;
}

/// Parameter and gradient types an optimizer steps: same element type, rank and mesh, the same placements,
/// none Partial.
template <class P, class G>
consteval bool check_param_grad() {
  using PT = dtensor::detail::dtensor_traits<P>;
  using GT = dtensor::detail::dtensor_traits<G>;
  static_assert(std::is_same_v<typename PT::value_type, typename GT::value_type> && PT::rank == GT::rank &&
                    std::is_same_v<typename PT::shape_type, typename GT::shape_type>,
                "optimizer step: the gradient must have the parameter's element type, rank and mesh shape");
  constexpr bool grad_partial = [] {
    for (const Placement& p : GT::placements) {
      if (p.is_partial()) {
        return true;
      }
    }
    return false;
  }();
  static_assert(!grad_partial,
                "optimizer step: the gradient is Partial on a mesh axis (a sum still pending over ranks): "
                "reduce it first, grad.redistribute<...>() to the parameter's placements (or let "
                "DDPReducer average it over the data-parallel axis)");
  static_assert(grad_partial || PT::placements == GT::placements, // (one error for a Partial gradient)
                "optimizer step: the gradient's placements differ from the parameter's: redistribute the "
                "gradient to the parameter's placements first");
  return check_optimizer_element<typename PT::value_type>();
}

/// A contiguous tensor seen as one dim (a view of the same elements).
template <class T, int R>
Tensor<T, 1> as_flat_1d(const Tensor<T, R>& t) {
  return t.template view<1>({t.numel()});
}

/// A zero (or uninitialised) state tensor of `shape` on `like`'s device and stream.
template <class S, class T>
AnyTensor new_state(const Extents& shape, const Tensor<T, 1>& like, bool zero) {
  const MemoryCategoryScope category(MemoryCategory::optimizer_state);
  AnyTensor s = AnyTensor::empty(dtype_v<S>, shape, like.device(), like.stream_handle());
  if (zero) {
    local::fill(s.view(Extents{s.numel()}).as<S, 1>(), S(0));
  }
  return s;
}

/// `state`'s memory as one dim, after checking that it still has `numel` elements.
template <class S>
Tensor<S, 1> state_view(const AnyTensor& state, std::int64_t numel, int index, const char* what) {
  DTENSOR_CHECK(state.numel() == numel, std::string(what) + ": parameter " + std::to_string(index) + " has " +
                                            std::to_string(numel) + " local elements, its state " +
                                            std::to_string(state.numel()) +
                                            " (a parameter's shard must keep its shape between steps)");
  return state.view(Extents{numel}).as<S, 1>();
}

/// state_view of a state that may be absent: an undefined tensor when `state` is undefined.
template <class S>
Tensor<S, 1> optional_state_view(const AnyTensor& state, std::int64_t numel, int index, const char* what) {
  return state.defined() ? state_view<S>(state, numel, index, what) : Tensor<S, 1>();
}

/// An optional operand's data, nullptr when it is undefined.
template <class S>
S* data_or_null(const Tensor<S, 1>& t) {
  return t.defined() ? t.data() : nullptr;
}

/// The pointer to element e of an operand, or nullptr for an absent operand.
template <class U>
DTENSOR_HOST_DEVICE U* at(U* base, std::int64_t e) {
  return base == nullptr ? nullptr : base + e;
}

inline namespace DTENSOR_LOCAL_OPS_NS {

/// Index i applies torch.optim.SGD's update to tile i: operands parameter, gradient, momentum buffer
/// (nullptr without momentum), fp32 master (nullptr without master weights). Computed in S.
template <class T, class S>
struct SgdRuns {
  local::RunLayout<1, 4> layout;
  T* param;
  const T* grad;
  S* buf;
  S* master;
  S lr, momentum, dampening, weight_decay;
  bool nesterov, maximize, first;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const local::Tile<4> t = layout.locate(i);
#if !defined(__CUDA_ARCH__)
    if (!DTENSOR_ON_DEVICE && master == nullptr) {
      for (std::int64_t r = 0; r < t.rows; ++r) {
        host_run(param + t.offset[0] + r * t.row_stride[0], grad + t.offset[1] + r * t.row_stride[1],
                 buf == nullptr ? nullptr : buf + t.offset[2] + r * t.row_stride[2], t.n);
      }
      return;
    }
#endif
    for (std::int64_t r = 0; r < t.rows; ++r) {
      for (std::int64_t k = 0; k < t.n; ++k) {
        T* p = param + t.offset[0] + r * t.row_stride[0] + k;
        S* m = at(master, t.offset[3] + r * t.row_stride[3] + k);
        const S x = m != nullptr && !first ? *m : static_cast<S>(*p);
        S d = static_cast<S>(grad[t.offset[1] + r * t.row_stride[1] + k]);
        d = maximize ? -d : d;
        if (weight_decay != S(0)) {
          d = d + weight_decay * x;
        }
        if (buf != nullptr) {
          S* b = buf + t.offset[2] + r * t.row_stride[2] + k;
          const S nb = first ? d : momentum * *b + (S(1) - dampening) * d;
          *b = nb;
          d = nesterov ? d + momentum * nb : nb;
        }
        const S y = x - lr * d;
        if (m != nullptr) {
          *m = y;
        }
        *p = T(y);
      }
    }
  }

  /// The update of n contiguous elements without master weights, on the host: blocks of
  /// local::host_block elements loaded into local arrays, the same operations as above with the
  /// per-step choices as selects (a loop that vectorises), the rest one by one.
  void host_run(T* p, const T* g, S* b, std::int64_t n) const {
    constexpr int B = local::host_block;
    const S sign = maximize ? S(-1) : S(1);
    const bool decay = weight_decay != S(0);
    const bool has_buf = b != nullptr;
    std::int64_t k = 0;
    for (; k + B <= n; k += B) {
      S x[B], d[B], nb[B] = {};
      for (int j = 0; j < B; ++j) {
        x[j] = static_cast<S>(p[k + j]);
        d[j] = static_cast<S>(g[k + j]);
      }
      if (b != nullptr) {
        for (int j = 0; j < B; ++j) {
          nb[j] = b[k + j];
        }
      }
      for (int j = 0; j < B; ++j) {
        const S dj = local::math::choose(decay, d[j] * sign + weight_decay * x[j], d[j] * sign);
        nb[j] = local::math::choose(first, dj, momentum * nb[j] + (S(1) - dampening) * dj);
        const S dm = local::math::choose(nesterov, dj + momentum * nb[j], nb[j]);
        x[j] = x[j] - lr * local::math::choose(has_buf, dm, dj);
      }
      for (int j = 0; j < B; ++j) {
        p[k + j] = T(x[j]);
      }
      if (b != nullptr) {
        for (int j = 0; j < B; ++j) {
          b[k + j] = nb[j];
        }
      }
    }
    for (; k < n; ++k) {
      const S x = static_cast<S>(p[k]);
      S d = static_cast<S>(g[k]) * sign;
      d = decay ? d + weight_decay * x : d;
      if (b != nullptr) {
        const S v = first ? d : momentum * b[k] + (S(1) - dampening) * d;
        b[k] = v;
        d = nesterov ? d + momentum * v : v;
      }
      p[k] = T(x - lr * d);
    }
  }
};

/// Index i applies torch.optim.AdamW's update to tile i: operands parameter, gradient, exp_avg,
/// exp_avg_sq, max_exp_avg_sq (nullptr without amsgrad), fp32 master (nullptr without master weights).
template <class T, class S>
struct AdamWRuns {
  local::RunLayout<1, 6> layout;
  T* param;
  const T* grad;
  S* exp_avg;
  S* exp_avg_sq;
  S* max_sq;
  S* master;
  S decay;        ///< 1 - lr * weight_decay
  S beta1_weight; ///< 1 - beta1 (the lerp weight)
  S beta2, one_minus_beta2;
  S step_size; ///< lr / (1 - beta1^step)
  S bias_correction2_sqrt;
  S eps;
  bool maximize, first;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const local::Tile<6> t = layout.locate(i);
#if !defined(__CUDA_ARCH__)
    if (!DTENSOR_ON_DEVICE && max_sq == nullptr && master == nullptr) {
      for (std::int64_t r = 0; r < t.rows; ++r) {
        host_run(param + t.offset[0] + r * t.row_stride[0], grad + t.offset[1] + r * t.row_stride[1],
                 exp_avg + t.offset[2] + r * t.row_stride[2], exp_avg_sq + t.offset[3] + r * t.row_stride[3],
                 t.n);
      }
      return;
    }
#endif
    for (std::int64_t r = 0; r < t.rows; ++r) {
      for (std::int64_t k = 0; k < t.n; ++k) {
        T* p = param + t.offset[0] + r * t.row_stride[0] + k;
        S* mw = at(master, t.offset[5] + r * t.row_stride[5] + k);
        S x = mw != nullptr && !first ? *mw : static_cast<S>(*p);
        S g = static_cast<S>(grad[t.offset[1] + r * t.row_stride[1] + k]);
        g = maximize ? -g : g;
        x = x * decay;
        S* m = exp_avg + t.offset[2] + r * t.row_stride[2] + k;
        S* v = exp_avg_sq + t.offset[3] + r * t.row_stride[3] + k;
        // exp_avg.lerp_(grad, 1 - beta1), as torch's lerp computes it.
        const S mn =
            beta1_weight < S(0.5) ? *m + beta1_weight * (g - *m) : g - (g - *m) * (S(1) - beta1_weight);
        const S vn = *v * beta2 + one_minus_beta2 * (g * g);
        *m = mn;
        *v = vn;
        S second = vn;
        if (max_sq != nullptr) {
          S* vm = max_sq + t.offset[4] + r * t.row_stride[4] + k;
          second = *vm > vn || *vm != *vm ? *vm : vn; // torch.maximum: NaN propagates
          *vm = second;
        }
        const S denom = std::sqrt(second) / bias_correction2_sqrt + eps;
        const S y = x + (-step_size) * (mn / denom);
        if (mw != nullptr) {
          *mw = y;
        }
        *p = T(y);
      }
    }
  }

  /// The update of n contiguous elements without amsgrad or master weights, on the host: blocks of
  /// local::host_block elements in local arrays, the same operations as above (the lerp's two forms as a
  /// select, the square roots by math::sqrt_block), the rest one by one.
  void host_run(T* p, const T* g, S* m, S* v, std::int64_t n) const {
    constexpr int B = local::host_block;
    const S sign = maximize ? S(-1) : S(1);
    const bool low = beta1_weight < S(0.5);
    std::int64_t k = 0;
    for (; k + B <= n; k += B) {
      S x[B], gg[B], mn[B], vn[B], root[B];
      for (int j = 0; j < B; ++j) {
        x[j] = static_cast<S>(p[k + j]);
        gg[j] = static_cast<S>(g[k + j]);
        mn[j] = m[k + j];
        vn[j] = v[k + j];
      }
      for (int j = 0; j < B; ++j) {
        const S gj = gg[j] * sign;
        const S mo = mn[j];
        x[j] = x[j] * decay;
        mn[j] =
            local::math::choose(low, mo + beta1_weight * (gj - mo), gj - (gj - mo) * (S(1) - beta1_weight));
        vn[j] = vn[j] * beta2 + one_minus_beta2 * (gj * gj);
        root[j] = vn[j];
      }
      local::math::sqrt_block(root, B);
      for (int j = 0; j < B; ++j) {
        const S denom = root[j] / bias_correction2_sqrt + eps;
        x[j] = x[j] + (-step_size) * (mn[j] / denom);
      }
      for (int j = 0; j < B; ++j) {
        m[k + j] = mn[j];
        v[k + j] = vn[j];
        p[k + j] = T(x[j]);
      }
    }
    for (; k < n; ++k) {
      const S gk = static_cast<S>(g[k]) * sign;
      const S mo = m[k];
      const S x = static_cast<S>(p[k]) * decay;
      const S mk = low ? mo + beta1_weight * (gk - mo) : gk - (gk - mo) * (S(1) - beta1_weight);
      const S vk = v[k] * beta2 + one_minus_beta2 * (gk * gk);
      m[k] = mk;
      v[k] = vk;
      p[k] = T(x + (-step_size) * (mk / (std::sqrt(vk) / bias_correction2_sqrt + eps)));
    }
  }
};

template <class F>
void run_update(const F& f, const Device& device, CUstream_st* stream, const char* what) {
  local::launch(f, device, stream, what);
}

} // namespace DTENSOR_LOCAL_OPS_NS

/// Checks that a parameter shard and its gradient shard can be stepped together.
template <class T>
void check_shards(const Tensor<T, 1>& param, const Tensor<T, 1>& grad, int index, const char* what) {
  DTENSOR_CHECK(index >= 0, std::string(what) + ": parameter index " + std::to_string(index) + " < 0");
  DTENSOR_CHECK(param.numel() == grad.numel(), std::string(what) + ": parameter " + std::to_string(index) +
                                                   " has local shape " + shape_to_string(param.shape()) +
                                                   ", its gradient " + shape_to_string(grad.shape()));
  DTENSOR_CHECK(param.device() == grad.device(), std::string(what) + ": parameter " + std::to_string(index) +
                                                     " and its gradient are on different devices");
}

/// The 1-D layout of n elements under the operands' strides (1 for absent operands).
template <int N>
local::RunLayout<1, N> layout_1d(std::int64_t n, const std::array<std::int64_t, N>& strides,
                                 const Device& device) {
  std::array<std::array<std::int64_t, 1>, N> s{};
  for (int k = 0; k < N; ++k) {
    s[k] = {strides[k]};
  }
  return local::make_run_layout<1, N>({n}, s, device.is_cpu() ? local::host_tile : local::cuda_tile);
}

} // namespace dtensor::optim::detail

namespace dtensor::optim {

/// What SGD and AdamW share: per-parameter state by index and the typed shells over `update`.
template <class Derived>
class Optimizer {
public:
  /// Steps parameter `index` (a DTensor, updated in place through its shard) with its gradient, which has
  /// the same placements (Shard / Replicate; a Partial gradient does not compile).
  template <AnyDTensor P, AnyDTensor G>
  void step(int index, P& param, const G& grad) {
    static_assert(detail::check_param_grad<std::remove_cvref_t<P>, std::remove_cvref_t<G>>());
    DTENSOR_CHECK(param.global_shape() == grad.global_shape(),
                  std::string(Derived::name) + ": parameter " + std::to_string(index) + " has global shape " +
                      detail::shape_to_string(param.global_shape()) + ", its gradient " +
                      detail::shape_to_string(grad.global_shape()));
    self().update(index, detail::as_flat_1d(param.local()), detail::as_flat_1d(grad.local()),
                  dtensor::detail::to_extents(param.local().shape()));
  }

  /// Steps a raw local shard (e.g. a parameter's part of an FSDP flat buffer) with its gradient shard; the
  /// shard may be a strided view. The state has the shard's shape (n).
  template <class T>
  void step(int index, const Tensor<T, 1>& param_shard, const Tensor<T, 1>& grad_shard) {
    static_assert(detail::check_optimizer_element<T>());
    self().update(index, param_shard, grad_shard, Extents{param_shard.numel()});
  }

  /// Steps an FSDP group's shard as parameter `index`: its local_param() with its local_grad(), element for
  /// element (a FlatParamGroup, train/fsdp.hpp). The state has the shard's shape.
  template <class Group>
  requires requires(const Group& g) {
    g.local_param();
    g.local_grad();
    g.flat_layout();
  }
  void step(int index, const Group& group) {
    using T = typename Group::value_type;
    if constexpr (std::is_same_v<T, typename Group::reduce_type>) {
      step(index, group.local_param(), group.local_grad());
    } else { // gradients reduced in another type (bfloat16 for float masters): converted to the master's
      const auto g = group.local_grad();
      Tensor<T, 1> converted({g.numel()}, g.device());
      local::convert(converted, g);
      step(index, group.local_param(), converted);
    }
  }

  /// Steps every parameter: parameter i is element i of `params` (std::tie(w1, w2, ...)), its gradient
  /// element i of `grads`.
  template <class... P, class... G>
  void step(const std::tuple<P&...>& params, const std::tuple<G&...>& grads) {
    static_assert(sizeof...(P) == sizeof...(G), "optimizer step: one gradient per parameter");
    step_all(params, grads, std::index_sequence_for<P...>{});
  }

  /// Parameter `index`'s state (throws when it has taken no step).
  const ParamState& state(int index) const {
    DTENSOR_CHECK(index >= 0 && index < static_cast<int>(states_.size()) && states_[index].step > 0,
                  std::string(Derived::name) + ": parameter " + std::to_string(index) + " has no state yet");
    return states_[index];
  }
  /// Number of parameter indices seen so far.
  int num_params() const noexcept { return static_cast<int>(states_.size()); }
  /// Whether parameter `index` has taken a step (so state(index) exists).
  bool has_state(int index) const noexcept {
    return index >= 0 && index < num_params() && states_[static_cast<std::size_t>(index)].step > 0;
  }
  /// Replaces parameter `index`'s state (resuming from a checkpoint: train/train_state.hpp): its step
  /// count and tensors of its shard's element count in state_t of its element type. The next step goes on
  /// from it as from the state a step left.
  void load_state(int index, ParamState state) {
    DTENSOR_CHECK(index >= 0 && state.step >= 0, std::string(Derived::name) + "::load_state: parameter " +
                                                     std::to_string(index) + ", step " +
                                                     std::to_string(state.step));
    for (const AnyTensor* t :
         {&state.momentum_buffer, &state.exp_avg, &state.exp_avg_sq, &state.max_exp_avg_sq, &state.master}) {
      set_memory_category(*t, MemoryCategory::optimizer_state);
    }
    state_for(index) = std::move(state);
  }

protected:
  /// What every update starts from (begin_update).
  template <class S>
  struct UpdateStart {
    ParamState& state;   ///< the parameter's state (its step not yet counted)
    bool first;          ///< this is the parameter's first step: the update creates its state
    std::int64_t n;      ///< elements of the shard
    Tensor<S, 1> master; ///< the fp32 master copy (undefined without master weights)
  };

  /// The start of an update: checks the shards, finds parameter `index`'s state and, on its first step,
  /// makes its master copy when `master_weights` is asked for and T is computed in a wider S (bfloat16,
  /// half). The caller makes its own state on the first step, then counts the step.
  template <class T>
  UpdateStart<state_t<T>> begin_update(int index, const Tensor<T, 1>& param, const Tensor<T, 1>& grad,
                                       const Extents& shape, bool master_weights) {
    using S = state_t<T>;
    detail::check_shards(param, grad, index, Derived::name);
    ParamState& st = state_for(index);
    const bool first = st.step == 0;
    const std::int64_t n = param.numel();
    if (first) {
      st.master =
          master_weights && !std::is_same_v<T, S> ? detail::new_state<S>(shape, param, false) : AnyTensor();
    }
    return {st, first, n, detail::optional_state_view<S>(st.master, n, index, Derived::name)};
  }

private:
  ParamState& state_for(int index) {
    if (index >= static_cast<int>(states_.size())) {
      states_.resize(static_cast<std::size_t>(index) + 1);
    }
    return states_[index];
  }

  Derived& self() { return static_cast<Derived&>(*this); }

  template <class PT, class GT, std::size_t... I>
  void step_all(const PT& params, const GT& grads, std::index_sequence<I...>) {
    (step(static_cast<int>(I), std::get<I>(params), std::get<I>(grads)), ...);
  }

  std::vector<ParamState> states_;
};

/// torch.optim.SGD on local shards: with d = g (+ weight_decay * p), momentum buffer b = d on the first
/// step, then b = momentum * b + (1 - dampening) * d; d = b, or d + momentum * b with nesterov;
/// p = p - lr * d.
class SGD : public Optimizer<SGD> {
public:
  using options_type = SGDOptions;
  static constexpr const char* name = "SGD";

  explicit SGD(SGDOptions options) : options_(options) {
    DTENSOR_CHECK(options.lr >= 0, "SGD: invalid learning rate " + std::to_string(options.lr));
    DTENSOR_CHECK(options.momentum >= 0, "SGD: invalid momentum " + std::to_string(options.momentum));
    DTENSOR_CHECK(options.weight_decay >= 0,
                  "SGD: invalid weight_decay " + std::to_string(options.weight_decay));
    DTENSOR_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
                  "SGD: Nesterov momentum requires a momentum and zero dampening");
  }

  const SGDOptions& options() const noexcept { return options_; }
  /// For schedules: the learning rate of the next steps.
  void set_lr(double lr) { options_.lr = lr; }

  /// One step of parameter `index`'s shard (the typed step() calls this).
  template <class T>
  void update(int index, const Tensor<T, 1>& param, const Tensor<T, 1>& grad, const Extents& shape) {
    using S = state_t<T>;
    auto [st, first, n, master] = begin_update(index, param, grad, shape, options_.master_weights);
    if (first) {
      // The buffer is d itself on the first step: the kernel writes it before reading.
      st.momentum_buffer = options_.momentum != 0 ? detail::new_state<S>(shape, param, false) : AnyTensor();
    }
    const Tensor<S, 1> buf = detail::optional_state_view<S>(st.momentum_buffer, n, index, name);
    ++st.step;
    if (n == 0) {
      return;
    }
    detail::SgdRuns<T, S> run{
        detail::layout_1d<4>(n, {param.strides()[0], grad.strides()[0], 1, 1}, param.device()),
        param.data(),
        grad.data(),
        detail::data_or_null(buf),
        detail::data_or_null(master),
        static_cast<S>(options_.lr),
        static_cast<S>(options_.momentum),
        static_cast<S>(options_.dampening),
        static_cast<S>(options_.weight_decay),
        options_.nesterov,
        options_.maximize,
        first};
    detail::run_update(run, param.device(), param.stream_handle(), "SGD step");
  }

private:
  SGDOptions options_;
};

/// torch.optim.AdamW on local shards: step t = t + 1; p = p * (1 - lr * weight_decay);
/// m = lerp(m, g, 1 - beta1); v = beta2 * v + (1 - beta2) * g^2 (amsgrad: v_max = max(v_max, v), used for
/// v); p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
class AdamW : public Optimizer<AdamW> {
public:
  using options_type = AdamWOptions;
  static constexpr const char* name = "AdamW";

  explicit AdamW(AdamWOptions options) : options_(options) {
    DTENSOR_CHECK(options.lr >= 0, "AdamW: invalid learning rate " + std::to_string(options.lr));
    DTENSOR_CHECK(options.eps >= 0, "AdamW: invalid epsilon " + std::to_string(options.eps));
    DTENSOR_CHECK(options.beta1 >= 0 && options.beta1 < 1,
                  "AdamW: invalid beta parameter at index 0: " + std::to_string(options.beta1));
    DTENSOR_CHECK(options.beta2 >= 0 && options.beta2 < 1,
                  "AdamW: invalid beta parameter at index 1: " + std::to_string(options.beta2));
    DTENSOR_CHECK(options.weight_decay >= 0,
                  "AdamW: invalid weight_decay " + std::to_string(options.weight_decay));
  }

  const AdamWOptions& options() const noexcept { return options_; }
  void set_lr(double lr) { options_.lr = lr; }

  template <class T>
  void update(int index, const Tensor<T, 1>& param, const Tensor<T, 1>& grad, const Extents& shape) {
    using S = state_t<T>;
    auto [st, first, n, master] = begin_update(index, param, grad, shape, options_.master_weights);
    if (first) {
      st.exp_avg = detail::new_state<S>(shape, param, true);
      st.exp_avg_sq = detail::new_state<S>(shape, param, true);
      st.max_exp_avg_sq = options_.amsgrad ? detail::new_state<S>(shape, param, true) : AnyTensor();
    }
    const Tensor<S, 1> m = detail::state_view<S>(st.exp_avg, n, index, name);
    const Tensor<S, 1> v = detail::state_view<S>(st.exp_avg_sq, n, index, name);
    const Tensor<S, 1> vmax = detail::optional_state_view<S>(st.max_exp_avg_sq, n, index, name);
    const std::int64_t t = ++st.step;
    if (n == 0) {
      return;
    }
    const double bias_correction1 = 1 - std::pow(options_.beta1, static_cast<double>(t));
    const double bias_correction2 = 1 - std::pow(options_.beta2, static_cast<double>(t));
    detail::AdamWRuns<T, S> run{
        detail::layout_1d<6>(n, {param.strides()[0], grad.strides()[0], 1, 1, 1, 1}, param.device()),
        param.data(),
        grad.data(),
        m.data(),
        v.data(),
        detail::data_or_null(vmax),
        detail::data_or_null(master),
        static_cast<S>(1 - options_.lr * options_.weight_decay),
        static_cast<S>(1 - options_.beta1),
        static_cast<S>(options_.beta2),
        static_cast<S>(1 - options_.beta2),
        static_cast<S>(options_.lr / bias_correction1),
        static_cast<S>(std::sqrt(bias_correction2)),
        static_cast<S>(options_.eps),
        options_.maximize,
        first};
    detail::run_update(run, param.device(), param.stream_handle(), "AdamW step");
  }

private:
  AdamWOptions options_;
};

} // namespace dtensor::optim
