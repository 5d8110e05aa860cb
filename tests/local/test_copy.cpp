// Local data movement (local/copy.hpp) on the host: RunLayout's collapsing, and strided copies,
// fills and scalings of narrowed views of every rank 1-4 and every element type against a reference
// loop, compared bit for bit. The device path is in test_tensor_cuda.cu.

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/copy.hpp"

#include "../support/random_bytes.hpp"

using dtensor::Tensor;
namespace local = dtensor::local;

#define DTENSOR_LOCAL_OPS_TYPES                                                                              \
  float, double, dtensor::bfloat16, dtensor::half, dtensor::float8_e4m3, dtensor::float8_e5m2, std::int32_t, \
      std::int64_t, std::uint8_t

namespace {

using dtensor::test_support::random_bytes;

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Row-major multi-index of flat index i in `shape`.
template <int R>
std::array<std::int64_t, R> unflatten(std::int64_t i, const std::array<std::int64_t, R>& shape) {
  std::array<std::int64_t, R> idx{};
  for (int d = R - 1; d >= 0; --d) {
    idx[d] = i % shape[d];
    i /= shape[d];
  }
  return idx;
}

template <int R>
std::int64_t offset_of(const std::array<std::int64_t, R>& idx, const std::array<std::int64_t, R>& strides) {
  std::int64_t o = 0;
  for (int d = 0; d < R; ++d) {
    o += idx[d] * strides[d];
  }
  return o;
}

template <int R>
std::int64_t numel_of(const std::array<std::int64_t, R>& shape) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    n *= s;
  }
  return n;
}

/// A random view of `t`: every dim narrowed to a random sub-range of length `shape[d]`.
template <class T, int R>
Tensor<T, R> narrowed(const Tensor<T, R>& t, const std::array<std::int64_t, R>& shape, std::mt19937& rng) {
  Tensor<T, R> v = t;
  for (int d = 0; d < R; ++d) {
    const std::int64_t slack = t.shape()[d] - shape[d];
    v = v.narrow(d, slack > 0 ? static_cast<std::int64_t>(rng() % (slack + 1)) : 0, shape[d]);
  }
  return v;
}

/// Copies between random narrowed views of random parents, checking every element of the destination's
/// parent: inside the view it equals the source, outside it is untouched.
template <class T, int R>
void check_copies(std::mt19937& rng, int trials) {
  for (int trial = 0; trial < trials; ++trial) {
    std::array<std::int64_t, R> shape{};
    std::array<std::int64_t, R> dst_parent{};
    std::array<std::int64_t, R> src_parent{};
    for (int d = 0; d < R; ++d) {
      shape[d] = static_cast<std::int64_t>(rng() % 5); // 0 (empty) .. 4
      if (trial == 0) {
        shape[d] = 3; // at least one non-empty case per rank
      }
      dst_parent[d] = shape[d] + static_cast<std::int64_t>(rng() % 3);
      src_parent[d] = shape[d] + static_cast<std::int64_t>(rng() % 3);
    }
    const auto dst_full = random_bytes<T, R>(dst_parent, rng);
    const auto src_full = random_bytes<T, R>(src_parent, rng);
    const auto before = dst_full.clone();
    const auto dst = narrowed<T, R>(dst_full, shape, rng);
    const auto src = narrowed<T, R>(src_full, shape, rng);
    local::copy(dst, src);

    // Reference: the expected parent, element by element.
    auto expected = before.clone();
    const std::int64_t dst_base = dst.numel() > 0 ? dst.data() - dst_full.data() : 0;
    for (std::int64_t i = 0; i < numel_of<R>(shape); ++i) {
      const auto idx = unflatten<R>(i, shape);
      expected.data()[dst_base + offset_of<R>(idx, dst.strides())] =
          src.data()[offset_of<R>(idx, src.strides())];
    }
    int wrong = 0;
    for (std::int64_t i = 0; i < dst_full.numel(); ++i) {
      wrong += same_bits(dst_full.data()[i], expected.data()[i]) ? 0 : 1;
    }
    INFO("rank " << R << ", trial " << trial << ", shape " << dtensor::detail::shape_to_string(shape));
    CHECK(wrong == 0);
  }
}

/// Fills and (for floating types) scales of random narrowed views: inside changed as the reference loop
/// says, outside untouched.
template <class T, int R>
void check_fills(std::mt19937& rng, int trials) {
  for (int trial = 0; trial < trials; ++trial) {
    std::array<std::int64_t, R> shape{};
    std::array<std::int64_t, R> parent{};
    for (int d = 0; d < R; ++d) {
      shape[d] = trial == 0 ? 2 : static_cast<std::int64_t>(rng() % 4);
      parent[d] = shape[d] + static_cast<std::int64_t>(rng() % 3);
    }
    auto full = random_bytes<T, R>(parent, rng);
    if constexpr (!std::is_integral_v<T>) { // finite values, so that scaling is checkable
      for (std::int64_t i = 0; i < full.numel(); ++i) {
        full.data()[i] = T(static_cast<float>(static_cast<int>(rng() % 17) - 8));
      }
    }
    const auto view = narrowed<T, R>(full, shape, rng);
    const std::int64_t base = view.numel() > 0 ? view.data() - full.data() : 0;
    auto expected = full.clone();
    const T value = T(static_cast<float>(5));
    local::fill(view, value);
    for (std::int64_t i = 0; i < numel_of<R>(shape); ++i) {
      expected.data()[base + offset_of<R>(unflatten<R>(i, shape), view.strides())] = value;
    }
    int wrong = 0;
    for (std::int64_t i = 0; i < full.numel(); ++i) {
      wrong += same_bits(full.data()[i], expected.data()[i]) ? 0 : 1;
    }
    INFO("fill: rank " << R << ", trial " << trial << ", shape " << dtensor::detail::shape_to_string(shape));
    CHECK(wrong == 0);

    if constexpr (std::is_floating_point_v<T> || dtensor::detail::is_reduced_float_v<T>) {
      const auto outer = full.narrow(0, 0, parent[0] > 0 ? parent[0] - (parent[0] > 1 ? 1 : 0) : 0);
      auto scaled = full.clone();
      local::scale(outer, -0.5);
      for (std::int64_t i = 0; i < outer.numel(); ++i) {
        using S = local::scale_type_t<T>;
        scaled.data()[i] = T(static_cast<S>(scaled.data()[i]) * static_cast<S>(-0.5));
      }
      wrong = 0;
      for (std::int64_t i = 0; i < full.numel(); ++i) {
        wrong += same_bits(full.data()[i], scaled.data()[i]) ? 0 : 1;
      }
      INFO("scale");
      CHECK(wrong == 0);
    }
  }
}

} // namespace

TEST_CASE("RunLayout collapses regions into runs and cuts them into tiles", "[local_ops]") {
  using local::make_run_layout;
  constexpr auto host = local::host_tile;
  SECTION("a contiguous tensor is one run") {
    const auto l = make_run_layout<3, 1>({2, 3, 4}, {{{12, 4, 1}}}, host);
    CHECK(l.dims == 0);
    CHECK(l.run == 24);
    CHECK(l.count == 1);
    const auto t = l.locate(0);
    CHECK(t.rows == 1);
    CHECK(t.n == 24);
  }
  SECTION("packing a non-leading dim: rows of runs, all in one host tile") {
    // dst (4, 3) contiguous, src = a (4, 6) narrowed to columns [2, 5)
    const auto l = make_run_layout<2, 2>({4, 3}, {{{3, 1}, {6, 1}}}, host);
    CHECK(l.dims == 1);
    CHECK(l.shape[0] == 4);
    CHECK(l.strides[0][0] == 3);
    CHECK(l.strides[1][0] == 6);
    CHECK(l.run == 3);
    CHECK(l.count == 1);
    const auto t = l.locate(0);
    CHECK(t.rows == 4);
    CHECK(t.n == 3);
    CHECK(t.row_stride[0] == 3);
    CHECK(t.row_stride[1] == 6);
  }
  SECTION("size-1 dims are dropped and mergeable dims merged") {
    const auto l = make_run_layout<4, 2>({2, 1, 3, 4}, {{{12, 99, 4, 1}, {40, 7, 4, 1}}}, host);
    CHECK(l.dims == 1); // dims 2 and 3 merge into a run of 12; dim 0 differs
    CHECK(l.run == 12);
    CHECK(l.count == 1);
    CHECK(l.locate(0).rows == 2);
  }
  SECTION("outer dims beyond the row dim are one host index each") {
    // (2, 3, 4) narrowed from (2, 5, 8) in dims 1 and 2: rows of dim 1, runs of 4, one index per dim-0 slice
    const auto l = make_run_layout<3, 2>({2, 3, 4}, {{{12, 4, 1}, {40, 8, 1}}}, host);
    CHECK(l.dims == 2);
    CHECK(l.count == 2);
    const auto t = l.locate(1);
    CHECK(t.offset[0] == 12);
    CHECK(t.offset[1] == 40);
    CHECK(t.rows == 3);
    CHECK(t.row_stride[1] == 8);
  }
  SECTION("device tiles are single elements") {
    const auto l = make_run_layout<2, 1>({3, 5}, {{{8, 1}}}, local::cuda_tile);
    CHECK(l.run == 5);
    CHECK(l.count == 15);
    const auto t = l.locate(7); // row 1, element 2
    CHECK(t.offset[0] == 10);
    CHECK(t.rows == 1);
    CHECK(t.n == 1);
    const auto w = make_run_layout<2, 1>({3, 5}, {{{8, 1}}}, local::TileShape{2, 2});
    CHECK(w.count == 6);        // 2 row tiles x 3 column tiles
    const auto e = w.locate(5); // rows [2, 3), elements [4, 5): the ragged corner
    CHECK(e.offset[0] == 20);
    CHECK(e.rows == 1);
    CHECK(e.n == 1);
  }
  SECTION("no unit stride: runs of one element") {
    const auto l = make_run_layout<2, 2>({3, 4}, {{{1, 3}, {4, 1}}}, host); // a transpose
    CHECK(l.dims == 2);
    CHECK(l.run == 1);
    CHECK(l.count == 3);
    CHECK(l.locate(2).rows == 4);
  }
  SECTION("empty regions launch nothing; rank 0 is one element") {
    CHECK(make_run_layout<2, 1>({3, 0}, {{{0, 1}}}, host).count == 0);
    const auto s = make_run_layout<0, 2>({}, {}, host);
    CHECK(s.count == 1);
    CHECK(s.run == 1);
  }
}

/// Every tile shape covers every element exactly once (the device's one-element tiles, run here).
TEST_CASE("every tile shape covers a region exactly once", "[local_ops]") {
  const std::array<std::int64_t, 3> shape{3, 4, 5};
  auto parent = Tensor<int, 3>::zeros({4, 6, 7});
  const auto view = parent.narrow(0, 1, 3).narrow(1, 1, 4).narrow(2, 2, 5);
  for (const local::TileShape tile :
       {local::host_tile, local::cuda_tile, local::TileShape{3, 2}, local::TileShape{1, 4}}) {
    parent.fill(0);
    const auto l = local::make_run_layout<3, 1>(shape, {view.strides()}, tile);
    for (std::int64_t i = 0; i < l.count; ++i) {
      const auto t = l.locate(i);
      for (std::int64_t r = 0; r < t.rows; ++r) {
        for (std::int64_t k = 0; k < t.n; ++k) {
          view.data()[t.offset[0] + r * t.row_stride[0] + k] += 1;
        }
      }
    }
    INFO("tile " << tile.rows << " x " << tile.width);
    CHECK(dtensor::detail::shape_to_string(view.shape()) == "[3, 4, 5]");
    int ones = 0;
    int others = 0;
    for (std::int64_t i = 0; i < parent.numel(); ++i) {
      ones += parent.data()[i] == 1 ? 1 : 0;
      others += parent.data()[i] > 1 ? 1 : 0;
    }
    CHECK(ones == 60);
    CHECK(others == 0);
  }
}

TEST_CASE("the host path uses Thrust when the build found it", "[local_ops]") {
  // CMake defines DTENSOR_HAS_THRUST=1 when it finds CCCL; then the headers must be reachable too.
  STATIC_REQUIRE(DTENSOR_LOCAL_OPS_THRUST == DTENSOR_HAS_THRUST);
  STATIC_REQUIRE(DTENSOR_LOCAL_OPS_CUDA == 0); // a g++ translation unit
  SUCCEED("DTENSOR_LOCAL_OPS_THRUST = " << DTENSOR_LOCAL_OPS_THRUST);
}

TEMPLATE_TEST_CASE("strided copies of every rank match a reference loop", "[local_ops]",
                   DTENSOR_LOCAL_OPS_TYPES) {
  std::mt19937 rng(42);
  check_copies<TestType, 1>(rng, 20);
  check_copies<TestType, 2>(rng, 30);
  check_copies<TestType, 3>(rng, 30);
  check_copies<TestType, 4>(rng, 30);
}

TEMPLATE_TEST_CASE("fills and scales of every rank match a reference loop", "[local_ops]",
                   DTENSOR_LOCAL_OPS_TYPES) {
  std::mt19937 rng(7);
  check_fills<TestType, 1>(rng, 10);
  check_fills<TestType, 2>(rng, 15);
  check_fills<TestType, 3>(rng, 15);
  check_fills<TestType, 4>(rng, 15);
}

TEST_CASE("rank-0 tensors and shape mismatches", "[local_ops]") {
  auto a = Tensor<float, 0>::full({}, 1.5f);
  auto b = Tensor<float, 0>::full({}, 0.0f);
  local::copy(b, a);
  CHECK(b.item() == 1.5f);
  local::fill(b, 4.0f);
  CHECK(b.item() == 4.0f);
  local::scale(b, 0.25);
  CHECK(b.item() == 1.0f);
  auto x = Tensor<int, 2>::zeros({2, 3});
  auto y = Tensor<int, 2>::zeros({3, 2});
  CHECK_THROWS_WITH(local::copy(x, y), Catch::Contains("local::copy: shape mismatch: destination [2, 3] "
                                                       "vs source [3, 2]"));
}

TEST_CASE("CUDA tensors without CUDA support give a clear error", "[local_ops]") {
  // A device pointer may be wrapped without CUDA; moving its data needs CUDA.
  auto d = Tensor<float, 1>::from_blob(reinterpret_cast<float*>(64), {4}, dtensor::Device::cuda(0));
  auto h = Tensor<float, 1>::zeros({4});
  CHECK_THROWS_WITH(local::copy(h, d), Catch::Contains("compiled without CUDA"));
  CHECK_THROWS_WITH(local::fill(d, 1.0f), Catch::Contains("compiled without CUDA"));
  CHECK_THROWS_WITH(local::scale(d, 2.0), Catch::Contains("compile this translation unit with nvcc"));
}
