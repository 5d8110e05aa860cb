// Random numbers that do not depend on the sharding (local/random.hpp, ops/random.hpp): Philox's known
// answers and the counter layout; any block of a local fill is the global fill's block; rand and randn on
// 1-D meshes of 1-4 ranks and on (2,2), every placement (uneven and empty shards, Partial), equal the
// one-rank fill bit for bit; dropout's mask is the same on every sharding, Partial passes through, the
// backward applies the same mask; statistics over 2^20 samples; seeds and offsets give other numbers.
#include <catch2/catch.hpp>

#include <dtensor/core/extents.hpp>
#include <dtensor/layout/partial_identity.hpp>
#include <dtensor/local/random.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/random.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include "../support/ops_tensors.hpp"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Pmax = Partial<ReduceOp::max>;

using Elements = TypeList<float, double, bfloat16, half>;

template <class T>
std::string type_name() {
  return std::string(dtype_name(dtype_v<T>));
}

/// Whether two tensors have one shape and the same bytes (contiguous copies are compared).
template <class T, int Rk>
bool same_bits(const Tensor<T, Rk>& a, const Tensor<T, Rk>& b) {
  if (a.shape() != b.shape()) {
    return false;
  }
  const Tensor<T, Rk> ca = a.contiguous();
  const Tensor<T, Rk> cb = b.contiguous();
  return std::memcmp(ca.data(), cb.data(), ca.nbytes()) == 0;
}

/// `t` cut to the block at `offset` of `shape`.
template <class T, int Rk>
Tensor<T, Rk> block_of(const Tensor<T, Rk>& t, const typename Tensor<T, Rk>::Shape& offset,
                       const typename Tensor<T, Rk>::Shape& shape) {
  Tensor<T, Rk> v = t;
  for (int d = 0; d < Rk; ++d) {
    v = v.narrow(d, offset[d], shape[d]);
  }
  return v;
}

enum class Kind { uniform, normal };

template <class T, Kind K, int Rk>
Tensor<T, Rk> one_rank(const std::array<std::int64_t, Rk>& shape, std::uint64_t seed, std::uint64_t offset) {
  return K == Kind::uniform ? local::rand<T, Rk>(shape, seed, offset)
                            : local::randn<T, Rk>(shape, seed, offset);
}

} // namespace

TEST_CASE("Philox4x32-10: Random123's known answers, and the counter layout (seed, index, offset)", "[ops]") {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  auto zero = detail::rng::philox(0, 0, 0);
  CHECK(zero[0] == 0x6627e8d5u);
  CHECK(zero[1] == 0xe169c58du);
  CHECK(zero[2] == 0xbc57ac4cu);
  CHECK(zero[3] == 0x9b00dbd8u);
  // counter {243f6a88 85a308d3 13198a2e 03707344}, key {a4093822 299f31d0}: the index fills the counter's
  // first two words (low first), the offset the last two, the seed the key (low first).
  auto pi = detail::rng::philox(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a308d3243f6a88ull);
  CHECK(pi[0] == 0xd16cfe09u);
  CHECK(pi[1] == 0x94fdccebu);
  CHECK(pi[2] == 0x5001e420u);
  CHECK(pi[3] == 0x24126ea1u);
  // The uniform of element 0 under seed 0: ((r0 >> 8) | 1) * 2^-24.
  CHECK(local::uniform_at<float>(0, 0, 0) == float((0x6627e8d5u >> 8) | 1u) * 0x1p-24f);
  CHECK(local::uniform_at<double>(0, 0, 0) ==
        double(((std::uint64_t{0x6627e8d5u} << 32 | 0xe169c58du) >> 11) | 1u) * 0x1p-53);
  CHECK(float(local::uniform_at<bfloat16>(0, 0, 0)) == float((0x6627e8d5u >> 24) | 1u) * 0x1p-8f);
  CHECK(float(local::uniform_at<half>(0, 0, 0)) == float((0x6627e8d5u >> 21) | 1u) * 0x1p-11f);
}

TEST_CASE("Box-Muller's log and cos: within a few ulp of the long double functions", "[ops]") {
  const long double pi = 3.141592653589793238462643383279502884L;
  double log_f = 0, log_d = 0, cos_f = 0, cos_d = 0;
  for (std::uint64_t i = 0; i < 200000; ++i) {
    const auto w = detail::rng::philox(11, 0, i);
    const std::uint32_t n24 = (w[0] >> 8) | 1u;
    const std::uint64_t n53 = (detail::rng::join(w[0], w[1]) >> 11) | 1u;
    const long double l24 = std::log(static_cast<long double>(n24) * 0x1p-24L);
    const long double l53 = std::log(static_cast<long double>(n53) * 0x1p-53L);
    log_f = std::max(log_f, double(std::fabs((detail::rng::log_fixedpt24(n24) - l24) / l24) / 0x1p-24L));
    log_d = std::max(log_d, double(std::fabs((detail::rng::log_fixedpt53(n53) - l53) / l53) / 0x1p-53L));
    const std::uint64_t a64 = detail::rng::join(w[2], w[3]);
    const long double c32 = std::cos(2 * pi * (static_cast<long double>(w[1]) * 0x1p-32L));
    const long double c64 = std::cos(2 * pi * (static_cast<long double>(a64) * 0x1p-64L));
    cos_f = std::max(cos_f, double(std::fabs(detail::rng::cos_turn32(w[1]) - c32) / 0x1p-24L));
    cos_d = std::max(cos_d, double(std::fabs(detail::rng::cos_turn64(a64) - c64) / 0x1p-53L));
  }
  INFO("log: " << log_f << " / " << log_d << " ulp (relative); cos: " << cos_f << " / " << cos_d
               << " units of 2^-24 / 2^-53 (absolute)");
  CHECK(log_f < 5);
  CHECK(log_d < 5);
  CHECK(cos_f < 3); // includes rounding the angle to float
  CHECK(cos_d < 3);
}

TEST_CASE("local fills: every block (strided, empty) of the global fill is that fill's block, bit for bit",
          "[ops]") {
  const std::array<std::int64_t, 3> global{7, 5, 3};
  for_each(Elements{}, [&]<class T>() {
    for (Kind kind : {Kind::uniform, Kind::normal}) {
      INFO(type_name<T>() << (kind == Kind::uniform ? " rand" : " randn"));
      const auto whole = kind == Kind::uniform ? one_rank<T, Kind::uniform, 3>(global, 5, 2)
                                               : one_rank<T, Kind::normal, 3>(global, 5, 2);
      auto fill = [&](const Tensor<T, 3>& out, const std::array<std::int64_t, 3>& at) {
        if (kind == Kind::uniform) {
          local::rand_into(out, 5, 2, GlobalBlock<3>{at, global});
        } else {
          local::randn_into(out, 5, 2, GlobalBlock<3>{at, global});
        }
      };
      for (const auto& [at, shape] :
           {std::pair<std::array<std::int64_t, 3>, std::array<std::int64_t, 3>>{{0, 0, 0}, {7, 5, 3}},
            {{2, 0, 0}, {3, 5, 3}},
            {{0, 1, 0}, {7, 3, 3}},
            {{4, 2, 1}, {3, 3, 2}},
            {{6, 4, 2}, {1, 1, 1}},
            {{3, 5, 0}, {2, 0, 3}}}) {
        Tensor<T, 3> block(shape);
        fill(block, at);
        CHECK(same_bits(block, block_of(whole, at, shape)));
        // The same block into a strided view (a window of a larger tensor): only the values are written.
        Tensor<T, 3> big = Tensor<T, 3>::zeros({shape[0] + 2, shape[1] + 3, shape[2] + 1});
        const Tensor<T, 3> window = block_of(big, {1, 2, 1}, shape);
        fill(window, at);
        CHECK(same_bits(window, block_of(whole, at, shape)));
      }
      Tensor<T, 3> misplaced({3, 5, 3});
      CHECK_THROWS_AS(fill(misplaced, {5, 0, 0}), Error);
    }
  });
}

namespace {

/// rand<T, Ps...> and randn<T, Ps...> for a Placements<Ps...> list.
template <class PL>
struct Fill;
template <class... Ps>
struct Fill<Placements<Ps...>> {
  template <class T, class Mesh, std::size_t Rk>
  static auto uniform(const DeviceMesh<Mesh>& mesh, const std::array<std::int64_t, Rk>& shape,
                      std::uint64_t seed, std::uint64_t offset) {
    return rand<T, Ps...>(mesh, shape, seed, offset);
  }
  template <class T, class Mesh, std::size_t Rk>
  static auto normal(const DeviceMesh<Mesh>& mesh, const std::array<std::int64_t, Rk>& shape,
                     std::uint64_t seed, std::uint64_t offset) {
    return randn<T, Ps...>(mesh, shape, seed, offset);
  }
};

/// rand and randn with placements PL on `mesh` against the one-rank fill, bit for bit: full_tensor(), and
/// the local block where this rank holds the value (Partial axes: coordinate 0 of a sum, all for avg, max).
template <class PL, class Mesh, std::size_t N>
void check_fills(const DeviceMesh<Mesh>& mesh, const std::array<std::int64_t, N>& shape) {
  constexpr int Rk = static_cast<int>(N);
  for_each(Elements{}, [&]<class T>() {
    auto check = [&](const auto& x, const Tensor<T, Rk>& want, const char* what) {
      using XT = std::remove_cvref_t<decltype(x)>;
      static_assert(std::is_same_v<typename XT::value_type, T> && XT::rank == Rk);
      const std::string name = std::string(what) + "<" + type_name<T>() + ", " + to_string(XT::placements) +
                               "> of " + detail::shape_to_string(shape) + " on mesh rank " +
                               std::to_string(mesh.rank());
      expect(x.global_shape() == shape, name + ": global shape");
      // Partial<avg> over an axis of 3 ranks: the all_reduce's (v + v + v) / 3 rounds (within an ulp).
      bool avg_rounds = false;
      for (int a = 0; a < XT::placements.size(); ++a) {
        const int size = mesh.sizes()[a];
        avg_rounds = avg_rounds || (XT::placements[a].op == ReduceOp::avg && XT::placements[a].is_partial() &&
                                    (size & (size - 1)) != 0);
      }
      const auto full = x.full_tensor();
      if (!avg_rounds) {
        expect(same_bits(full, want), name + ": full_tensor() differs from the one-rank fill");
      } else {
        const double ulp = std::is_same_v<T, double>  ? 0x1p-52
                           : std::is_same_v<T, float> ? 0x1p-23
                           : std::is_same_v<T, half>  ? 0x1p-10
                                                      : 0x1p-7;
        for (std::int64_t e = 0; e < want.numel(); ++e) {
          const double a = static_cast<double>(full.data()[e]);
          const double b = static_cast<double>(want.data()[e]);
          expect(std::fabs(a - b) <= ulp * std::fabs(b), name + ": full_tensor() more than an ulp off");
        }
      }
      if (holds_partial_value(XT::placements, mesh.coordinate())) {
        const Block b = spec_block(detail::to_extents(shape), XT::spec, mesh.sizes(), mesh.coordinate());
        expect(same_bits(x.local(),
                         block_of(want, detail::to_array<Rk>(b.offset), detail::to_array<Rk>(b.shape))),
               name + ": the local block differs from the one-rank fill's");
      }
    };
    check(Fill<PL>::template uniform<T>(mesh, shape, 9, 3), local::rand<T, Rk>(shape, 9, 3), "rand");
    check(Fill<PL>::template normal<T>(mesh, shape, 9, 3), local::randn<T, Rk>(shape, 9, 3), "randn");
  });
}

template <class Mesh, class Opts, class... Sizes>
void fill_cases(int ranks, Opts opts, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    for_each(opts, [&]<class PL>() {
      check_fills<PL>(mesh, std::array<std::int64_t, 2>{5, 3}); // uneven; empty shards on 4 ranks
      check_fills<PL>(mesh, std::array<std::int64_t, 2>{8, 6});
      check_fills<PL>(mesh, std::array<std::int64_t, 2>{0, 3});
    });
    if constexpr (Mesh::rank == 1) { // rank 1 and 3, float by default
      auto v = rand<S<0>>(mesh, {10}, 4);
      static_assert(std::is_same_v<decltype(v), DTensor<float, 1, Mesh, S<0>>>);
      expect(same_bits(v.full_tensor(), local::rand<float, 1>({10}, 4)), "rand<S(0)> of (10,)");
      auto w = randn<double, S<2>>(mesh, {3, 4, 5}, 4, 1);
      expect(same_bits(w.full_tensor(), local::randn<double, 3>({3, 4, 5}, 4, 1)),
             "randn<double, S(2)> of (3, 4, 5)");
    }
  });
}

using One = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<P>, Placements<Pavg>,
                     Placements<Pmax>>;
using Two = TypeList<Placements<R, R>, Placements<S<0>, S<1>>, Placements<S<1>, S<0>>, Placements<S<0>, S<0>>,
                     Placements<S<1>, S<1>>, Placements<R, S<1>>, Placements<S<0>, R>, Placements<P, S<0>>,
                     Placements<R, P>, Placements<Pavg, S<1>>>;

} // namespace

TEST_CASE("rand, randn: on 1-D meshes of 1-4 ranks and on (2,2), every placement, uneven and empty shards, "
          "equal the one-rank fill bit for bit",
          "[ops]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    fill_cases<Mesh1>(n, One{});
  }
  fill_cases<Mesh2>(4, Two{}, 2, 2);
}

namespace {

/// The global tensor value(seed, .) of `shape`.
template <int Rk>
Tensor<double, Rk> values(const std::array<std::int64_t, Rk>& shape, int seed) {
  Tensor<double, Rk> t(shape);
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    t.data()[e] = value(seed, e);
  }
  return t;
}

template <class Mesh, class Opts, class... Sizes>
void dropout_cases(int ranks, Opts opts, Sizes... sizes) {
  testing::run_ranks(ranks, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh>(world, sizes...);
    for_each(opts, [&]<class PL>() {
      for (const auto& shape : {std::array<std::int64_t, 2>{5, 3}, std::array<std::int64_t, 2>{8, 6}}) {
        using X = typename dt<Mesh, 2, PL>::type;
        const std::string name = to_string(X::placements) + " of " + detail::shape_to_string(shape);
        const X x = make<X>(mesh, shape, 1);
        const double p = 0.25;
        const Tensor<double, 2> want = local::dropout(values<2>(shape, 1), p, 21, 4);
        auto y = dropout(x, p, 21, 4);
        static_assert(std::is_same_v<decltype(y), X>, "dropout keeps x's placements");
        bool partial = false;
        for (int a = 0; a < X::placements.size(); ++a) {
          partial = partial || X::placements[a].is_partial();
        }
        if (!partial) {
          expect(same_bits(y.full_tensor(), want),
                 "dropout " + name + ": not the one-rank result, bit for bit");
        } else { // the partial values carry noise that cancels in the sum: equal within rounding
          check_full(
              y, [&](std::int64_t e) { return want.data()[e]; }, 1e-14, "dropout " + name);
        }
        // The backward: the same mask on the gradient (value(7, .)), in x's placements.
        auto [y2, back] = dropout(x, p, 21, 4, with_backward);
        using Y = std::remove_cvref_t<decltype(y2)>;
        const Y dy = make<Y>(mesh, shape, 7);
        auto dx = back(dy);
        const Tensor<double, 2> dwant = local::dropout(values<2>(shape, 7), p, 21, 4);
        check_full(
            dx, [&](std::int64_t e) { return dwant.data()[e]; }, 1e-14, "dropout backward " + name);
        // A Replicate gradient of a sharded x comes back in x's placements (a local chunk).
        using RG = typename dt<Mesh, 2, typename detail::AllReplicate<Mesh::rank>::type>::type;
        auto dxr = back(make<RG>(mesh, shape, 7));
        check_full(
            dxr, [&](std::int64_t e) { return dwant.data()[e]; }, 0,
            "dropout backward of a Replicate gradient " + name);
      }
    });
  });
}

} // namespace

TEST_CASE("dropout: one mask on every sharding (1-4 ranks, (2,2)), Partial passes through, the backward "
          "applies the same mask",
          "[ops]") {
  using One = TypeList<Placements<R>, Placements<S<0>>, Placements<S<1>>, Placements<P>, Placements<Pavg>>;
  using Two = TypeList<Placements<R, R>, Placements<S<0>, S<1>>, Placements<S<0>, S<0>>, Placements<S<1>, R>,
                       Placements<P, S<1>>, Placements<R, Pavg>, Placements<P, P>>;
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    dropout_cases<Mesh1>(n, One{});
  }
  dropout_cases<Mesh2>(4, Two{}, 2, 2);
}

TEST_CASE("dropout's mask is rand<float>(seed, offset) >= p, for every element type, p = 0 and p = 1",
          "[ops]") {
  const std::array<std::int64_t, 2> shape{64, 33};
  const double p = 0.3;
  const Tensor<float, 2> u = local::rand<float, 2>(shape, 17, 5);
  for_each(Elements{}, [&]<class T>() {
    INFO(type_name<T>());
    using C = local::scale_type_t<T>; // what x is scaled in: float, double for double
    const auto scale = static_cast<C>(1.0 / (1.0 - p));
    const Tensor<T, 2> x = local::randn<T, 2>(shape, 3);
    const Tensor<T, 2> y = local::dropout(x, p, 17, 5);
    int wrong = 0;
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const T want = T(static_cast<C>(x.data()[e]) * (u.data()[e] >= p ? scale : C(0)));
      wrong += std::memcmp(&want, &y.data()[e], sizeof(T)) != 0;
    }
    CHECK(wrong == 0);
    CHECK(same_bits(local::dropout(x, 0.0, 17, 5), x));
    const Tensor<T, 2> none = local::dropout(x, 1.0, 17, 5);
    bool zero = true;
    for (std::int64_t e = 0; e < none.numel(); ++e) {
      zero = zero && static_cast<double>(none.data()[e]) == 0;
    }
    CHECK(zero);
    CHECK_THROWS_AS(local::dropout(x, 1.5, 17, 5), Error);
    CHECK_THROWS_AS(local::dropout(x, -0.1, 17, 5), Error);
  });
}

TEST_CASE("statistics over 2^20 samples: mean, variance, tails of rand and randn, dropout's keep fraction",
          "[ops]") {
  // The fills are deterministic, so each bound either always holds or never. Each is 6 standard errors
  // of its statistic for N = 2^20 independent samples (a correct generator misses one with probability
  // ~2e-9): uniform mean 1/2, se sqrt(1/12 / N) = 2.8e-4; variance 1/12, se sqrt((1/80 - 1/144) / N) =
  // 7.3e-5; normal mean 0, se 1/sqrt(N) = 9.8e-4; variance 1, se sqrt(2 / N) = 1.4e-3; E z^4 = 3, se
  // sqrt(96 / N) = 9.6e-3; P(|z| > 3) = 0.0026998, se 5.1e-5; P(z < 1) = 0.8413447, se 3.6e-4; dropout's
  // keep fraction 1 - p = 0.7, se sqrt(0.21 / N) = 4.5e-4.
  constexpr std::int64_t n = std::int64_t{1} << 20;
  auto moments = [](const auto& t) {
    std::array<double, 6> m{}; // mean, variance, E x^4, P(|x| > 3), P(x < 1), min; max in [5] below
    double lo = 1e300;
    double hi = -1e300;
    for (std::int64_t e = 0; e < t.numel(); ++e) {
      const double v = static_cast<double>(t.data()[e]);
      m[0] += v;
      m[1] += v * v;
      m[2] += v * v * v * v;
      m[3] += std::fabs(v) > 3 ? 1 : 0;
      m[4] += v < 1 ? 1 : 0;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const double count = double(t.numel());
    for (double& v : m) {
      v /= count;
    }
    m[1] -= m[0] * m[0];
    m[5] = lo;
    return std::pair{m, hi};
  };
  for_each(TypeList<float, double, bfloat16, half>{}, [&]<class T>() {
    INFO(type_name<T>());
    const auto [u, umax] = moments(local::rand<T, 1>({n}, 2024));
    CHECK(std::fabs(u[0] - 0.5) < 6 * 2.8e-4);
    CHECK(std::fabs(u[1] - 1.0 / 12) < 6 * 7.3e-5 + 1.0 / (12 * 256 * 256)); // bfloat16: 256 steps
    CHECK(u[5] > 0);
    CHECK(umax < 1);
    const auto [z, zmax] = moments(local::randn<T, 1>({n}, 2024));
    const double coarse = std::is_same_v<T, bfloat16> ? 4e-3 : 0; // rounding z to 8 bits adds ~z^2 2^-18
    CHECK(std::fabs(z[0]) < 6 * 9.8e-4);
    CHECK(std::fabs(z[1] - 1) < 6 * 1.4e-3 + coarse);
    CHECK(std::fabs(z[2] - 3) < 6 * 9.6e-3 + 3 * coarse);
    CHECK(std::fabs(z[3] - 0.0026998) < 6 * 5.1e-5);
    CHECK(std::fabs(z[4] - 0.8413447) <
          6 * 3.6e-4 + (std::is_same_v<T, float> || std::is_same_v<T, double> ? 0 : 4e-3));
    CHECK(zmax < 6.5);
    CHECK(z[5] > -6.5);
  });
  const Tensor<float, 1> kept = local::dropout(Tensor<float, 1>::full({n}, 1.0f), 0.3, 99);
  double fraction = 0;
  for (std::int64_t e = 0; e < n; ++e) {
    fraction += kept.data()[e] != 0 ? 1 : 0;
  }
  CHECK(std::fabs(fraction / double(n) - 0.7) < 6 * 4.5e-4);
}

TEST_CASE("seeds and offsets: other numbers for another seed or offset, high words included", "[ops]") {
  const std::array<std::pair<std::uint64_t, std::uint64_t>, 5> keys{
      {{1, 0}, {2, 0}, {1, 1}, {1 + (std::uint64_t{1} << 32), 0}, {1, std::uint64_t{1} << 32}}};
  for (std::size_t a = 0; a < keys.size(); ++a) {
    for (std::size_t b = a + 1; b < keys.size(); ++b) {
      const auto x = local::rand<float, 1>({4096}, keys[a].first, keys[a].second);
      const auto y = local::rand<float, 1>({4096}, keys[b].first, keys[b].second);
      int equal = 0;
      for (std::int64_t e = 0; e < 4096; ++e) {
        equal += x.data()[e] == y.data()[e];
      }
      INFO("keys " << a << " and " << b);
      CHECK(equal <= 2); // 2^-23 per element by chance
    }
  }
  // The index's high word is part of the counter: elements 5 and 5 + 2^32 differ.
  CHECK(local::uniform_at<double>(1, 0, 5) != local::uniform_at<double>(1, 0, 5 + (std::uint64_t{1} << 32)));
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    const auto a = rand<S<0>>(mesh, {6, 4}, 8).full_tensor();
    const auto b = rand<S<0>>(mesh, {6, 4}, 8, 1).full_tensor();
    expect(!same_bits(a, b), "rand with offset 1 equals offset 0");
  });
}
