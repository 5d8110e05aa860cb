// Huge shapes are errors that name the shape, never signed overflow (issue 18, defect 4). This TU is built
// with -fsanitize=signed-integer-overflow and no recovery (tests/CMakeLists.txt), so an overflow anywhere in
// the library code it runs aborts the test instead of wrapping silently.

#include <catch2/catch.hpp>

#include <dtensor/core/any_tensor.hpp>
#include <dtensor/core/tensor.hpp>
#include <dtensor/layout/algebra.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/ops/shape.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/tensor/dtensor.hpp>
#include <dtensor/testing/run_ranks.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace dtensor;
using Catch::Matchers::Contains;

namespace {

using Mesh1 = MeshShape<Axis<"x">>;
using Mesh2 = MeshShape<Axis<"dp">, Axis<"tp">>;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// Sizes read through a volatile, so the compiler cannot fold the arithmetic on them at compile time.
std::int64_t runtime(std::int64_t v) {
  volatile std::int64_t x = v;
  return x;
}
std::int64_t pow2(int e) {
  return runtime(std::int64_t{1} << e);
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no dtensor::Error thrown>";
}

/// Every rank's error text (empty where none was thrown) from running `fn` on `n` ranks.
std::vector<std::string> rank_errors(int n, const std::function<void(ProcessGroup&)>& fn) {
  std::vector<std::string> errors(n);
  testing::run_ranks(n, [&](ProcessGroup& world) {
    try {
      fn(world);
    } catch (const Error& e) {
      errors[world.rank()] = e.what();
    }
  });
  return errors;
}

} // namespace

TEST_CASE("Tensor shapes whose size or strides overflow int64 are errors", "[tensor][overflow]") {
  const std::int64_t g40 = pow2(40);
  const std::int64_t g62 = pow2(62);
  // 2^120 elements: the strides overflowed before the element count was checked.
  CHECK_THAT(error_of([&] {
               Tensor<float, 3>({g40, g40, g40});
             }),
             Contains("[1099511627776, 1099511627776, 1099511627776] is too large"));
  // No elements, but the stride of dim 0 would be 2^124: was accepted with a wrapped stride.
  CHECK_THAT(error_of([&] { Tensor<float, 3>({0, g62, g62}); }), Contains("[0, 4611686018427387904, "));
  CHECK_THAT(error_of([&] { Tensor<float, 3>({g62, g62, 0}); }), Contains("is too large"));
  CHECK_THAT(error_of([&] { Tensor<float, 2>::zeros({0, runtime(kMax)}); }), Contains("is too large"));
  // Elements fit but bytes do not.
  CHECK_THAT(error_of([&] { Tensor<double, 1>({pow2(61)}); }),
             Contains("[2305843009213693952] is too large"));
  CHECK_THAT(error_of([&] {
               Tensor<float, 3>::from_blob(nullptr, {0, g62, g62});
             }),
             Contains("Tensor::from_blob: shape [0, 4611686018427387904, 4611686018427387904] is too large"));
  // Empty tensors whose other sizes fit are fine, with representable strides.
  Tensor<std::uint8_t, 3> ok({0, pow2(31), pow2(31)});
  CHECK(ok.numel() == 0);
  CHECK(ok.strides() == std::array<std::int64_t, 3>{std::int64_t{1} << 62, std::int64_t{1} << 31, 1});
  CHECK(Tensor<float, 2>({pow2(40), 0}).strides() == std::array<std::int64_t, 2>{0, 1});
}

TEST_CASE("Tensor view products are checked", "[tensor][overflow]") {
  const std::int64_t g62 = pow2(62);
  auto empty = Tensor<float, 1>({0});
  CHECK_THAT(error_of([&] { (void)empty.view<3>({0, g62, g62}); }), Contains("is too large"));
  CHECK_THAT(error_of([&] { (void)empty.view<3>({g62, g62, 0}); }), Contains("is too large"));
  CHECK_THAT(error_of([&] { (void)empty.view<3>({g62, g62, -1}); }), Contains("is too large"));
  auto twelve = Tensor<float, 1>::zeros({12});
  CHECK_THAT(error_of([&] { (void)twelve.view<3>({g62, 4, -1}); }), Contains("[4611686018427387904, 4, -1]"));
  CHECK_THAT(error_of([&] { (void)twelve.view<2>({g62, 4}); }), Contains("Tensor::view"));
  CHECK(empty.view<3>({0, pow2(20), pow2(20)}).strides() ==
        std::array<std::int64_t, 3>{std::int64_t{1} << 40, std::int64_t{1} << 20, 1});
}

TEST_CASE("AnyTensor shapes whose size or strides overflow are errors", "[tensor][overflow]") {
  const std::int64_t g62 = pow2(62);
  CHECK_THAT(error_of([&] {
               (void)AnyTensor::empty(DType::float32, Extents{0, g62, g62}, Device::cpu());
             }),
             Contains("AnyTensor::empty: invalid shape (0, 4611686018427387904, 4611686018427387904)"));
  CHECK_THAT(error_of([&] {
               (void)AnyTensor::empty(DType::float32, Extents{-1, 2}, Device::cpu());
             }),
             Contains("negative size"));
  const AnyTensor empty = AnyTensor::empty(DType::float32, Extents{0}, Device::cpu());
  CHECK_THAT(error_of([&] { (void)empty.view(Extents{g62, g62, 0}); }), Contains("invalid shape"));
}

TEST_CASE("torch.chunk sizes and offsets of sizes near INT64_MAX", "[layout][overflow]") {
  const std::int64_t n = runtime(kMax);
  CHECK(full_chunk_size(n, 2) == std::int64_t{1} << 62);
  CHECK(chunk_size(n, 2, 0) == std::int64_t{1} << 62);
  CHECK(chunk_size(n, 2, 1) == (std::int64_t{1} << 62) - 1);
  CHECK(chunk_offset(n, 2, 1) == std::int64_t{1} << 62);
  CHECK(full_chunk_size(n, 1) == kMax);
  CHECK(chunk_size(n, 1, 0) == kMax);
  for (std::int64_t m : {n, n - 1, n - 2, n - 6, pow2(62), pow2(62) + 1}) {
    for (int k = 1; k <= 9; ++k) {
      std::int64_t at = 0;
      for (int i = 0; i < k; ++i) { // the chunks tile [0, m) in order
        INFO("m=" << m << " k=" << k << " i=" << i);
        REQUIRE(chunk_offset(m, k, i) == at);
        REQUIRE(chunk_size(m, k, i) >= 0);
        REQUIRE(chunk_size(m, k, i) <= full_chunk_size(m, k));
        at += chunk_size(m, k, i);
      }
      REQUIRE(at == m);
    }
  }
  // Two axes splitting one dim of INT64_MAX rows.
  std::int64_t rows = 0;
  for (int r = 0; r < 4; ++r) {
    const Block b = local_block(Extents{n, 1}, PlacementList{Placement::shard(0), Placement::shard(0)},
                                MeshSizes{2, 2}, r);
    CHECK(b.offset[0] == rows);
    rows += b.shape[0];
  }
  CHECK(rows == kMax);
}

TEST_CASE("from_local rejects global shapes that are negative or too large", "[dtensor][overflow]") {
  // {INT64_MAX, 1} split over 2 ranks: the chunk arithmetic wrapped to empty blocks, so (0, 1) locals were
  // accepted.
  for (bool verify : {false, true}) {
    auto errors = rank_errors(2, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      (void)DTensor<float, 2, Mesh1, Shard<0>>::from_local(
          mesh, Tensor<float, 2>({0, 1}), std::array<std::int64_t, 2>{runtime(kMax), 1}, {.verify = verify});
    });
    for (const std::string& e : errors) {
      CHECK_THAT(e, Contains("the global shape (9223372036854775807, 1) is too large"));
    }
  }
  // Representable in elements but not in bytes of float; zero-size locals.
  auto errors = rank_errors(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    (void)DTensor<float, 2, Mesh1, Replicate>::from_local(mesh, Tensor<float, 2>({0, 0}),
                                                          std::array<std::int64_t, 2>{pow2(62), 0});
  });
  for (const std::string& e : errors) {
    CHECK_THAT(e, Contains("(4611686018427387904, 0) is too large"));
  }
  // Negative global sizes, with and without verify.
  for (bool verify : {false, true}) {
    errors = rank_errors(2, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      (void)DTensor<float, 2, Mesh1, Shard<0>>::from_local(
          mesh, Tensor<float, 2>({0, 3}), std::array<std::int64_t, 2>{-4, 3}, {.verify = verify});
    });
    for (const std::string& e : errors) {
      CHECK_THAT(e, Contains("the global shape (-4, 3) has a negative size"));
    }
  }
  // With verify, one rank's bad global shape fails every rank (none is left waiting in the exchange).
  for (std::int64_t bad : {std::int64_t{-4}, kMax}) {
    errors = rank_errors(2, [&](ProcessGroup& world) {
      world.set_timeout(std::chrono::seconds(5));
      auto mesh = init_device_mesh<Mesh1>(world);
      const bool odd = world.rank() == 1;
      (void)DTensor<float, 2, Mesh1, Shard<0>>::from_local(
          mesh, Tensor<float, 2>({odd ? 0 : 2, 3}), std::array<std::int64_t, 2>{odd ? runtime(bad) : 4, 3},
          {.verify = true});
    });
    for (const std::string& e : errors) {
      CHECK_THAT(e, Contains(bad < 0 ? "(-4, 3)" : "(9223372036854775807, 3)"));
      CHECK_THAT(e, Contains("mesh rank 1"));
    }
  }
  // The inferred global size overflows: 2^62 rows per rank times 2 ranks.
  errors = rank_errors(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    (void)DTensor<std::uint8_t, 2, Mesh1, Shard<0>>::from_local(mesh, Tensor<std::uint8_t, 2>({pow2(62), 0}));
  });
  for (const std::string& e : errors) {
    CHECK_THAT(e, Contains("gives a global size that does not fit in int64"));
  }
  // The factories check their global shape the same way.
  errors = rank_errors(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 1);
    (void)zeros<float, Shard<0>, Shard<0>>(mesh, {kMax, 0});
  });
  for (const std::string& e : errors) {
    CHECK_THAT(e, Contains("from_global_index: the global shape (9223372036854775807, 0) is too large"));
  }
}

TEST_CASE("mesh axis sizes whose product overflows are errors", "[mesh][overflow]") {
  using Mesh3 = MeshShape<Axis<"a">, Axis<"b">, Axis<"c">>;
  auto errors = rank_errors(
      1, [&](ProcessGroup& world) { (void)init_device_mesh<Mesh3>(world, 1 << 30, 1 << 30, 1 << 30); });
  CHECK_THAT(errors[0], Contains("the axis sizes multiply to more than int64 holds"));
}

TEST_CASE("unflatten sizes whose product overflows are errors", "[ops][overflow]") {
  auto errors = rank_errors(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    auto x = distribute_tensor<Shard<0>>(mesh, Tensor<float, 1>::zeros({12}), replicated_source);
    (void)unflatten<0>(x, std::array<std::int64_t, 3>{pow2(62), pow2(62), -1});
  });
  for (const std::string& e : errors) {
    CHECK_THAT(e,
               Contains("unflatten<0>: the sizes [4611686018427387904, 4611686018427387904, -1] multiply to "
                        "more than int64 holds"));
  }
}
