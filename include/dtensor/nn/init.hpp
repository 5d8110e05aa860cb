#pragma once
// Parameter initialisation with torch.nn.init's names, on DTensors of any Shard / Replicate placements,
// from the sharding-invariant random numbers of ops/random.hpp: element i of the global parameter is a
// function of (seed, offset, i) only, so every layout starts from the same weights as one rank, bit for
// bit, with no communication.
//
//   init::InitKeys keys(/*seed=*/1234);                     // parameter k gets offset first + k
//   init::kaiming_uniform_(w1, keys.next(), std::sqrt(5.0)); // nn.Linear's weight init, fan_in = in
//   init::uniform_(b1, -bound, bound, keys.next());
//   init::normal_(emb, 0.0, 0.02, keys.next());
//   init::zeros_(b2);
//
// Each fill writes the parameter's own shard in place. The values: uniform_(a, b): a + (b - a) u with u
// the uniform in (0, 1) of local::uniform_at; normal_(mean, std): mean + std z with z local::normal_at's
// standard normal; each one fma in float (double for double), rounded to the element type once (the same
// bits on the host and on CUDA), so
// normal_(x, 0, 1, {s, o}) equals randn<T>(mesh, shape, s, o) and uniform_(x, 0, 1, {s, o}) rand's. Fans
// follow torch's _calculate_fan_in_and_fan_out on the *global* shape: a weight is (out, in, *kernel) as
// linear takes it (fan_in = in * kernel, fan_out = out * kernel); a matmul weight (in, out) has them
// swapped, pass FanMode::fan_out to kaiming for its fan_in. A Partial parameter does not compile. Needs
// Random123 (the dtensor::random target), as rand and randn do.

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/random.hpp"
#include "dtensor/ops/random.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor::init {

/// What keys one random fill: the seed and the stream (offset) of the counter-based generator.
struct InitKey {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
};

/// One key per parameter: the same seed, offsets first, first + 1, ... (distinct streams, so no two
/// parameters share values). Give the parameters their keys in a fixed order (e.g. registration order) on
/// every rank and in the one-rank reference.
class InitKeys {
public:
  explicit InitKeys(std::uint64_t seed, std::uint64_t first_offset = 0) : seed_(seed), next_(first_offset) {}
  /// The key of the next parameter.
  InitKey next() noexcept { return {seed_, next_++}; }
  /// The key parameter `k` (counted from `first_offset`) gets.
  InitKey at(std::uint64_t k, std::uint64_t first_offset = 0) const noexcept {
    return {seed_, first_offset + k};
  }

private:
  std::uint64_t seed_;
  std::uint64_t next_;
};

/// torch.nn.init.calculate_gain's nonlinearities.
enum class Nonlinearity { linear, sigmoid, tanh, relu, leaky_relu, selu };
/// Which fan kaiming keeps: fan_in preserves the forward's variance, fan_out the backward's.
enum class FanMode { fan_in, fan_out };

/// torch.nn.init.calculate_gain: linear and sigmoid 1, tanh 5/3, relu sqrt(2), leaky_relu
/// sqrt(2 / (1 + slope^2)) (slope `param`), selu 3/4.
inline double calculate_gain(Nonlinearity nonlinearity, double param = 0.01) {
  switch (nonlinearity) {
  case Nonlinearity::tanh:
    return 5.0 / 3;
  case Nonlinearity::relu:
    return std::sqrt(2.0);
  case Nonlinearity::leaky_relu:
    return std::sqrt(2.0 / (1 + param * param));
  case Nonlinearity::selu:
    return 3.0 / 4;
  default:
    return 1;
  }
}

/// Fans of a weight of global shape `shape` (torch's _calculate_fan_in_and_fan_out): rank >= 2;
/// fan_in = shape[1] * receptive, fan_out = shape[0] * receptive, receptive the product of shape[2:].
struct Fans {
  std::int64_t fan_in = 0;
  std::int64_t fan_out = 0;
};
template <std::size_t R>
Fans fan_in_and_fan_out(const std::array<std::int64_t, R>& shape) {
  if constexpr (R < 2) {
    dtensor::detail::throw_error(
        "init: fan in and fan out can not be computed for a tensor with fewer than 2 "
        "dimensions (global shape " +
        dtensor::detail::shape_to_string(shape) + ")");
    return {};
  } else {
    std::int64_t receptive = 1;
    for (std::size_t d = 2; d < R; ++d) {
      receptive *= shape[d];
    }
    return {shape[1] * receptive, shape[0] * receptive};
  }
}

} // namespace dtensor::init

namespace dtensor::init::detail {

template <class X>
consteval bool check_init_param() {
  using XT = dtensor::detail::dtensor_traits<X>;
  constexpr bool partial = [] {
    for (const Placement& p : XT::placements) {
      if (p.is_partial()) {
        return true;
      }
    }
    return false;
  }();
  static_assert(!partial, "init: a Partial parameter: initialise it Replicate (or Shard) and redistribute");
  return true;
}

#if DTENSOR_HAS_RANDOM123
/// mean + std * z, z standard normal: one fma in C (the same bits on the host and on CUDA, whatever the
/// compilers contract), rounded to T.
template <class T>
struct NormalFill {
  std::uint64_t seed;
  std::uint64_t offset;
  double mean;
  double stddev;
  DTENSOR_HOST_DEVICE T operator()(std::uint64_t index) const {
    using C = local::scale_type_t<T>;
    return T(dtensor::detail::rng::fma(static_cast<C>(stddev), local::normal_at<C>(seed, offset, index),
                                       static_cast<C>(mean)));
  }
};
/// a + (b - a) * u, u uniform in (0, 1): one fma in C, rounded to T.
template <class T>
struct UniformFill {
  std::uint64_t seed;
  std::uint64_t offset;
  double low;
  double width;
  DTENSOR_HOST_DEVICE T operator()(std::uint64_t index) const {
    using C = local::scale_type_t<T>;
    return T(dtensor::detail::rng::fma(static_cast<C>(width), local::uniform_at<C>(seed, offset, index),
                                       static_cast<C>(low)));
  }
};

#else
// Without Random123 the fills do not instantiate (fill_shard's static_assert names the package).
template <class T>
struct NormalFill {
  std::uint64_t seed, offset;
  double mean, stddev;
};
template <class T>
struct UniformFill {
  std::uint64_t seed, offset;
  double low, width;
};
#endif

/// Fills x's shard with gen(global flat index).
template <class X, class Gen>
void fill_shard(X& x, Gen gen, const char* what) {
  static_assert(check_init_param<std::remove_cvref_t<X>>());
  using T = typename X::value_type;
  static_assert(dtensor::detail::check_random_element<T>());
#if DTENSOR_HAS_RANDOM123
  constexpr int R = X::rank;
  local::fill_random(x.local(), gen, GlobalBlock<R>{x.local_offset(), x.global_shape()}, what);
#else
  (void)x;
  (void)gen;
  (void)what;
#endif
}

} // namespace dtensor::init::detail

namespace dtensor::init {

/// x = mean + std * N(0, 1), element i of the global tensor from (key, i). torch.nn.init.normal_.
template <AnyDTensor X>
void normal_(X& x, double mean, double stddev, InitKey key) {
  detail::fill_shard(x, detail::NormalFill<typename X::value_type>{key.seed, key.offset, mean, stddev},
                     "init::normal_");
}

/// x = U(a, b) (a + (b - a) u, u in (0, 1)). torch.nn.init.uniform_.
template <AnyDTensor X>
void uniform_(X& x, double a, double b, InitKey key) {
  detail::fill_shard(x, detail::UniformFill<typename X::value_type>{key.seed, key.offset, a, b - a},
                     "init::uniform_");
}

/// Every element `value`. torch.nn.init.constant_.
template <AnyDTensor X>
void constant_(X& x, double value) {
  static_assert(detail::check_init_param<std::remove_cvref_t<X>>());
  using T = typename X::value_type;
  local::fill(x.local(), T(value));
}
template <AnyDTensor X>
void zeros_(X& x) {
  constant_(x, 0.0);
}
template <AnyDTensor X>
void ones_(X& x) {
  constant_(x, 1.0);
}

/// U(-bound, bound) with bound = gain * sqrt(3 / fan), gain = calculate_gain(nonlinearity, a), fan from x's
/// global shape by `mode`. torch.nn.init.kaiming_uniform_; nn.Linear's weight is a = sqrt(5) (bound
/// 1 / sqrt(fan_in)).
template <AnyDTensor X>
void kaiming_uniform_(X& x, InitKey key, double a = 0, FanMode mode = FanMode::fan_in,
                      Nonlinearity nonlinearity = Nonlinearity::leaky_relu) {
  const Fans f = fan_in_and_fan_out(x.global_shape());
  const std::int64_t fan = mode == FanMode::fan_in ? f.fan_in : f.fan_out;
  DTENSOR_CHECK(fan > 0, "init::kaiming_uniform_: zero fan (global shape " +
                             dtensor::detail::shape_to_string(x.global_shape()) + ")");
  const double bound = calculate_gain(nonlinearity, a) * std::sqrt(3.0 / static_cast<double>(fan));
  uniform_(x, -bound, bound, key);
}

/// N(0, std^2) with std = gain / sqrt(fan). torch.nn.init.kaiming_normal_.
template <AnyDTensor X>
void kaiming_normal_(X& x, InitKey key, double a = 0, FanMode mode = FanMode::fan_in,
                     Nonlinearity nonlinearity = Nonlinearity::leaky_relu) {
  const Fans f = fan_in_and_fan_out(x.global_shape());
  const std::int64_t fan = mode == FanMode::fan_in ? f.fan_in : f.fan_out;
  DTENSOR_CHECK(fan > 0, "init::kaiming_normal_: zero fan (global shape " +
                             dtensor::detail::shape_to_string(x.global_shape()) + ")");
  normal_(x, 0.0, calculate_gain(nonlinearity, a) / std::sqrt(static_cast<double>(fan)), key);
}

/// U(-bound, bound) with bound = gain * sqrt(6 / (fan_in + fan_out)). torch.nn.init.xavier_uniform_.
template <AnyDTensor X>
void xavier_uniform_(X& x, InitKey key, double gain = 1) {
  const Fans f = fan_in_and_fan_out(x.global_shape());
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(f.fan_in + f.fan_out));
  uniform_(x, -bound, bound, key);
}

/// N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out)). torch.nn.init.xavier_normal_.
template <AnyDTensor X>
void xavier_normal_(X& x, InitKey key, double gain = 1) {
  const Fans f = fan_in_and_fan_out(x.global_shape());
  normal_(x, 0.0, gain * std::sqrt(2.0 / static_cast<double>(f.fan_in + f.fan_out)), key);
}

/// nn.Linear's bias init: U(-1 / sqrt(fan_in), 1 / sqrt(fan_in)), fan_in the weight's (its in features).
template <AnyDTensor X>
void linear_bias_(X& bias, std::int64_t fan_in, InitKey key) {
  const double bound = fan_in > 0 ? 1 / std::sqrt(static_cast<double>(fan_in)) : 0;
  uniform_(bias, -bound, bound, key);
}

} // namespace dtensor::init

namespace dtensor::detail {

/// randn / zeros with the placements of the DTensor type D.
template <class D>
struct factory_of;
template <class T, int R, class Shape, class... Q>
struct factory_of<DTensor<T, R, Shape, Q...>> {
  static auto randn(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[R], std::uint64_t seed) {
    return dtensor::randn<T, Q...>(mesh, shape, seed);
  }
  static auto zeros(const DeviceMesh<Shape>& mesh, const std::int64_t (&shape)[R],
                    Device device = Device::cpu()) {
    return dtensor::zeros<T, Q...>(mesh, shape, device);
  }
};

} // namespace dtensor::detail
