// The device kernels no CUDA test covers, on the emulated device (tests/support/emulated_cuda), against the
// host kernels: local::convert between every pair of floating types (fp8 included) on strided views; map
// (every element functor, broadcast operands, strided outputs), expand, reduce over each dim (sum, mean,
// max, min, product; NaN) and sum_to_rank; softmax, log_softmax, layer_norm and rms_norm forward and
// backward (on CUDA a composition of map, reduce and expand; on the host row kernels); embedding's gather
// and scatter; cross_entropy's row sums and its element-wise gradient (the host's is per row); MoE's row
// gather and combine; the fake backend's collectives and redistributions on CUDA tensors. And the
// emulation itself: host code cannot read device memory, a kernel cannot read past an allocation or after a
// free, fresh device memory is poison.
//
// Shapes like the CUDA tests' (odd sizes, 37-67 wide rows that reach the host's 16-lane sums and 32-element
// blocks and their tails), every floating type; integer-valued data where the order of a sum would blur
// the comparison, tolerances where the two kernels compute differently (exp: the C library's on the device,
// local/math.hpp's on the host; softmax and the norms: other algorithms). Outputs written into existing
// views are poisoned first; new device tensors start as 0xff bytes (the emulated cudaMalloc).

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/init.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/core/tensor_io.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/local/rows.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/moe.hpp"
#include "dtensor/ops/embedding.hpp"
#include "dtensor/ops/loss.hpp"
#include "dtensor/ops/norm.hpp"
#include "dtensor/ops/softmax.hpp"

#include "../support/emulated_cuda/emulated_cuda.hpp"
#include "../support/random_bytes.hpp"

using dtensor::bfloat16;
using dtensor::Device;
using dtensor::Tensor;
namespace local = dtensor::local;

static_assert(DTENSOR_EMULATE_DEVICE == 1 && DTENSOR_LOCAL_OPS_CUDA == 1,
              "built in emulation: CUDA tensors run the device kernels on the host");

namespace {

const Device gpu = Device::cuda(0);

/// The value of element i of a test tensor: an integer in [-3, 3] (exact in every type, sums too).
float small_int(std::int64_t i, int seed) {
  return static_cast<float>((i * 7 + seed * 13 + (i * i) % 5) % 7 - 3);
}

template <class T, int R>
Tensor<T, R> ints(const std::array<std::int64_t, R>& shape, int seed, float scale = 1) {
  Tensor<T, R> t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data()[i] = T(scale * small_int(i, seed));
  }
  return t;
}

template <class X>
X narrowed(X t, const typename X::Shape& at, const typename X::Shape& shape) {
  for (int d = 0; d < X::rank; ++d) {
    t = t.narrow(d, at[d], shape[d]);
  }
  return t;
}

/// Elements (of contiguous copies) whose bytes differ.
template <class T, int R>
std::int64_t differing_bytes(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  REQUIRE(a.shape() == b.shape());
  const Tensor<T, R> ca = a.to(Device::cpu()).contiguous();
  const Tensor<T, R> cb = b.to(Device::cpu()).contiguous();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < ca.numel(); ++i) {
    bad += std::memcmp(ca.data() + i, cb.data() + i, sizeof(T)) != 0;
  }
  return bad;
}

/// Elements where |device - host| > tol (1 + |host|) (NaN only where both are NaN).
template <class T, int R>
std::int64_t differing(const Tensor<T, R>& device, const Tensor<T, R>& host, double tol) {
  REQUIRE(device.device() == gpu);
  REQUIRE(device.shape() == host.shape());
  const Tensor<T, R> d = device.to(Device::cpu()).contiguous();
  const Tensor<T, R> h = host.contiguous();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < d.numel(); ++i) {
    const double a = static_cast<double>(static_cast<local::compute_t<T>>(d.data()[i]));
    const double b = static_cast<double>(static_cast<local::compute_t<T>>(h.data()[i]));
    const bool same = (a == b) || (a != a && b != b) || std::abs(a - b) <= tol * (1 + std::abs(b));
    if (!same && ++bad <= 3) {
      UNSCOPED_INFO("element " << i << ": device " << a << ", host " << b);
    }
  }
  return bad;
}

/// Tolerances: T's rounding where the device and the host compute differently (the exp of each, a sum's
/// order), 0 where they compute alike.
template <class T>
double loose() {
  return std::is_same_v<T, double> ? 1e-12 : std::is_same_v<T, float> ? 2e-6 : 1e-2;
}

/// Runs `f` in a child process; true when the child died of SIGSEGV or SIGBUS (a fault).
template <class F>
bool faults(F f) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) { // quiet, and without Catch2's handlers: the signal ends the child
    std::signal(SIGSEGV, SIG_DFL);
    std::signal(SIGBUS, SIG_DFL);
    (void)std::freopen("/dev/null", "w", stdout);
    (void)std::freopen("/dev/null", "w", stderr);
    f();
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return WIFSIGNALED(status) && (WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS);
}

/// A kernel reading element `at` of `p` (the index launched is 0): what a buggy kernel does.
struct ReadAt {
  struct {
    std::int64_t count;
  } layout;
  const float* p;
  std::int64_t at;
  float* out;
  void operator()(std::int64_t) const { *out = p[at]; }
};

} // namespace

TEST_CASE("emulated device: device memory is off limits to host code, and kernels stay in bounds",
          "[emulated]") {
  const auto before = dtensor::emulated_cuda::counters();
  Tensor<float, 1> d = Tensor<float, 1>::full({64}, 2.0f, gpu); // 256 bytes: ends at a page's end
  Tensor<float, 1> out({1}, gpu);
  CHECK(dtensor::emulated_cuda::is_device_pointer(d.data()));
  CHECK(!dtensor::emulated_cuda::is_device_pointer(&before));
  CHECK(dtensor::equal(d, Tensor<float, 1>::full({64}, 2.0f))); // through cudaMemcpy: allowed
  // Host code reading or writing device memory faults, as on a GPU machine.
  CHECK(faults([&] { std::printf("%g\n", static_cast<double>(d.data()[3])); }));
  CHECK(faults([&] { d.data()[0] = 1; }));
  // A kernel reading its own allocation is fine; past its end, or freed memory, faults.
  local::launch(ReadAt{{1}, d.data(), 63, out.data()}, gpu, nullptr, "read");
  CHECK(out.item() == 2.0f);
  CHECK(faults([&] { local::launch(ReadAt{{1}, d.data(), 64, out.data()}, gpu, nullptr, "read past"); }));
  const float* freed = Tensor<float, 1>::full({64}, 1.0f, gpu).data();
  CHECK(faults([&] { local::launch(ReadAt{{1}, freed, 0, out.data()}, gpu, nullptr, "read freed"); }));
  // Copies must stay inside one allocation; a fresh one holds 0xff bytes (NaN).
  float host[65] = {};
  CHECK(cudaMemcpy(host, d.data(), 65 * sizeof(float), cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
  CHECK(cudaMemcpy(d.data(), host, 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidMemcpyDirection);
  (void)cudaGetLastError();
  CHECK(std::isnan(Tensor<float, 1>({3}, gpu).to(Device::cpu()).data()[2]));
  const auto after = dtensor::emulated_cuda::counters();
  CHECK(after.kernels == before.kernels + 1); // the in-bounds read (the faulting ones ran in children)
}

TEMPLATE_TEST_CASE("convert on CUDA tensors equals the host's, bit for bit, every pair of floating types",
                   "[emulated][convert]", float, double, bfloat16, dtensor::half, dtensor::float8_e4m3,
                   dtensor::float8_e5m2) {
  using S = TestType;
  std::mt19937 rng(11);
  auto to = [&]<class D>() {
    if constexpr (!std::is_same_v<D, S>) {
      INFO("to " << dtensor::dtype_name(dtensor::dtype_v<D>));
      const std::array<std::int64_t, 3> shape{3, 5, 37};
      const std::array<std::int64_t, 3> parent{4, 7, 40};
      const auto src = dtensor::test_support::random_bytes<S, 3>(parent, rng); // NaN patterns included
      const auto poison = dtensor::test_support::random_bytes<D, 3>(parent, rng);
      const Tensor<D, 3> host = poison.clone();
      const Tensor<D, 3> dev = poison.to(gpu);
      const std::array<std::int64_t, 3> dst_at{1, 0, 2}, src_at{0, 2, 1};
      local::convert(narrowed(host, dst_at, shape), narrowed(src, src_at, shape));
      local::convert(narrowed(dev, dst_at, shape), narrowed(src.to(gpu), src_at, shape));
      CHECK(differing_bytes(dev, host) == 0);
      // A transposed source: runs of one element.
      const Tensor<S, 2> flat = src.template view<2>({28, 40});
      const Tensor<S, 2> t = Tensor<S, 2>::from_blob(flat.data(), {40, 28}, {1, 40});
      const Tensor<D, 2> th({40, 28});
      const Tensor<D, 2> td({40, 28}, gpu);
      local::convert(th, t);
      local::convert(td, Tensor<S, 2>::from_blob(src.to(gpu).data(), {40, 28}, {1, 40}, gpu));
      CHECK(differing_bytes(td, th) == 0);
    }
  };
  to.template operator()<float>();
  to.template operator()<double>();
  to.template operator()<bfloat16>();
  to.template operator()<dtensor::half>();
  to.template operator()<dtensor::float8_e4m3>();
  to.template operator()<dtensor::float8_e5m2>();
}

namespace {

/// map(f, a, rest...) on the host and the device, and map_into a poisoned strided view: equal within tol.
template <class T, class F, class... Rest>
void check_map(const char* name, F f, double tol, const Tensor<T, 3>& a, const Rest&... rest) {
  INFO(name);
  const auto host = local::map(f, a, rest...);
  const auto dev = local::map(f, a.to(gpu), rest.to(gpu)...);
  CHECK(differing(dev, host, tol) == 0);
  // Into every other column of a poisoned (.., 2 w) buffer: strided output, contiguous inputs.
  const auto s = a.shape();
  const Tensor<T, 3> poison = Tensor<T, 3>::full({s[0], s[1], 2 * s[2]}, T(-7.0f));
  const Tensor<T, 3> ho = poison.clone();
  const Tensor<T, 3> dout = poison.to(gpu);
  auto every_other = [&](const Tensor<T, 3>& t) {
    return Tensor<T, 3>::from_blob(t.data(), s, {s[1] * 2 * s[2], 2 * s[2], 2}, t.device());
  };
  local::map_into(every_other(ho), f, a, rest...);
  local::map_into(every_other(dout), f, a.to(gpu), rest.to(gpu)...);
  CHECK(differing(dout, ho, tol) == 0);
}

template <class T>
void check_maps() {
  // Values in [-1.5, 1.5] (steps of 0.5), a strided view of a larger tensor; b and the biases nonzero.
  const std::array<std::int64_t, 3> shape{2, 19, 37};
  const Tensor<T, 3> a = narrowed(ints<T, 3>({3, 21, 41}, 1, 0.5f), {1, 2, 3}, shape);
  Tensor<T, 3> b = ints<T, 3>(shape, 2);
  b = local::map(local::AddScalar{4}, b); // in [1, 7]
  const Tensor<T, 1> bias = ints<T, 1>({37}, 3);
  const Tensor<T, 2> bias2 = ints<T, 2>({19, 37}, 4);
  const double exact = 0;
  const double tol = std::is_integral_v<T> ? 0 : loose<T>();
  check_map<T>("relu", local::Relu{}, exact, a);
  check_map<T>("add, a rank-1 bias", local::Add{}, exact, a, bias);
  check_map<T>("sub, a rank-2 bias", local::Sub{}, exact, a, bias2);
  check_map<T>("mul", local::Mul{}, exact, a, b);
  check_map<T>("axpy", local::Axpy{-2}, exact, a, b);
  check_map<T>("scale", local::Scale{0.5}, exact, a);
  check_map<T>("attained", local::Attained{}, exact, a, local::map(local::Relu{}, a));
  check_map<T>("relu backward", local::BackwardOf<local::Relu>{}, exact, a, b);
  if constexpr (!std::is_integral_v<T>) {
    check_map<T>("div", local::Div{}, exact, a, b);
    check_map<T>("divisor grad", local::DivisorGrad{}, exact, a, b, b);
    check_map<T>("exp", local::Exp{}, tol, a);
    check_map<T>("gelu", local::Gelu{}, tol, a);
    check_map<T>("silu", local::Silu{}, tol, a);
    check_map<T>("gelu backward", local::BackwardOf<local::Gelu>{}, tol, a, b);
    check_map<T>("silu backward", local::BackwardOf<local::Silu>{}, tol, a, b);
  }
  // expand: a dim of size 1 repeated, inner and outer.
  const Tensor<T, 3> row = ints<T, 3>({2, 1, 37}, 5);
  CHECK(differing(local::expand(local::Scale{2}, row.to(gpu), {2, 19, 37}),
                  local::expand(local::Scale{2}, row, {2, 19, 37}), 0) == 0);
  const Tensor<T, 3> col = ints<T, 3>({1, 19, 1}, 6);
  CHECK(differing(local::expand(local::Relu{}, col.to(gpu), {2, 19, 37}),
                  local::expand(local::Relu{}, col, {2, 19, 37}), 0) == 0);
}

template <class T>
void check_reductions() {
  // (3, 40, 37) inside a larger tensor: 40 and 37 reach the host's 16 lanes and blocks of 32 and their
  // tails. Integer values (sums exact in any order); powers of two for the product.
  const std::array<std::int64_t, 3> shape{3, 40, 37};
  const Tensor<T, 3> x = narrowed(ints<T, 3>({4, 43, 39}, 7), {1, 1, 2}, shape);
  Tensor<T, 3> p({4, 43, 39});
  for (std::int64_t i = 0; i < p.numel(); ++i) {
    const int k = static_cast<int>(i % 5);
    p.data()[i] = T(k == 0 ? -1.0f : k == 1 ? 2.0f : k == 2 ? 0.5f : 1.0f);
  }
  const Tensor<T, 3> pv = narrowed(p, {1, 1, 2}, shape);
  for (int dim = 0; dim < 3; ++dim) {
    INFO("dim " << dim);
    for (dtensor::ReduceOp op : {dtensor::ReduceOp::sum, dtensor::ReduceOp::max, dtensor::ReduceOp::min}) {
      INFO("op " << static_cast<int>(op));
      CHECK(differing(local::reduce(op, x.to(gpu), dim), local::reduce(op, x, dim), 0) == 0);
    }
    const double n = static_cast<double>(shape[static_cast<std::size_t>(dim)]);
    CHECK(differing(local::reduce(dtensor::ReduceOp::avg, x.to(gpu), dim, n),
                    local::reduce(dtensor::ReduceOp::avg, x, dim, n), 0) == 0);
    CHECK(differing(local::reduce(dtensor::ReduceOp::product, pv.to(gpu), dim),
                    local::reduce(dtensor::ReduceOp::product, pv, dim), 0) == 0);
  }
  CHECK(differing(local::sum_to_rank<1>(x.to(gpu)), local::sum_to_rank<1>(x), 0) == 0);
  CHECK(differing(local::sum_to_rank<2>(x.to(gpu)), local::sum_to_rank<2>(x), 0) == 0);
  if constexpr (!std::is_integral_v<T>) { // a NaN wins max and min wherever it is
    Tensor<T, 3> nan = x.contiguous();
    nan.data()[5 * 37 + 3] = T(std::nanf(""));
    for (int dim = 0; dim < 3; ++dim) {
      CHECK(differing(local::reduce(dtensor::ReduceOp::max, nan.to(gpu), dim),
                      local::reduce(dtensor::ReduceOp::max, nan, dim), 0) == 0);
      CHECK(differing(local::reduce(dtensor::ReduceOp::min, nan.to(gpu), dim),
                      local::reduce(dtensor::ReduceOp::min, nan, dim), 0) == 0);
    }
  }
}

} // namespace

TEMPLATE_TEST_CASE("map, expand, reduce and sum_to_rank on CUDA tensors equal the host's", "[emulated][map]",
                   float, double, bfloat16, dtensor::half, std::int32_t, std::int64_t) {
  check_maps<TestType>();
  check_reductions<TestType>();
}

namespace {

using Mesh = dtensor::MeshShape<dtensor::Axis<"x">>;
template <class T, int R>
using Rep = dtensor::DTensor<T, R, Mesh, dtensor::Replicate>;

/// A one-rank mesh of the fake backend: the DTensor ops' local kernels, nothing communicated.
dtensor::DeviceMesh<Mesh> one_rank() {
  return dtensor::init_device_mesh<Mesh>(dtensor::fake_world(0, 1));
}

template <class T, int R>
Rep<T, R> on(const dtensor::DeviceMesh<Mesh>& mesh, const Tensor<T, R>& t, const Device& device) {
  return Rep<T, R>(mesh, device.is_cpu() ? t : t.to(device), t.shape());
}

} // namespace

TEMPLATE_TEST_CASE("softmax, log_softmax, layer_norm and rms_norm of CUDA tensors equal the host's, "
                   "forward and backward",
                   "[emulated][softmax][norm]", float, double, bfloat16) {
  using T = TestType;
  const auto mesh = one_rank();
  const double tol = loose<T>();
  // Rows of 67: the host's 16-lane sums and 32-element blocks with their tails.
  const Tensor<T, 3> x = ints<T, 3>({2, 19, 67}, 1, 0.25f);
  const Tensor<T, 3> g = ints<T, 3>({2, 19, 67}, 2, 0.5f);
  const auto xh = on(mesh, x, Device::cpu());
  const auto xd = on(mesh, x, gpu);
  const auto gh = on(mesh, g, Device::cpu());
  const auto gd = on(mesh, g, gpu);
  auto along = [&]<int D>() {
    INFO("dim " << D);
    CHECK(differing(dtensor::softmax<D>(xd).local(), dtensor::softmax<D>(xh).local(), tol) == 0);
    CHECK(differing(dtensor::log_softmax<D>(xd).local(), dtensor::log_softmax<D>(xh).local(), tol) == 0);
    auto [yd, backd] = dtensor::softmax<D>(xd, dtensor::with_backward);
    auto [yh, backh] = dtensor::softmax<D>(xh, dtensor::with_backward);
    CHECK(differing(backd(gd).local(), backh(gh).local(), tol) == 0);
    auto [ld, lbackd] = dtensor::log_softmax<D>(xd, dtensor::with_backward);
    auto [lh, lbackh] = dtensor::log_softmax<D>(xh, dtensor::with_backward);
    CHECK(differing(lbackd(gd).local(), lbackh(gh).local(), tol) == 0);
  };
  along.template operator()<2>();
  along.template operator()<1>();
  const Tensor<T, 1> w = ints<T, 1>({67}, 3, 0.5f);
  const Tensor<T, 1> b = ints<T, 1>({67}, 4, 0.5f);
  const auto wh = on(mesh, w, Device::cpu());
  const auto wd = on(mesh, w, gpu);
  const auto bh = on(mesh, b, Device::cpu());
  const auto bd = on(mesh, b, gpu);
  const double eps = 1e-5;
  const double ntol = std::is_same_v<T, double> ? 1e-10 : tol * 10; // a variance's rounding, twice
  CHECK(differing(dtensor::layer_norm<1>(xd, wd, bd, eps).local(),
                  dtensor::layer_norm<1>(xh, wh, bh, eps).local(), ntol) == 0);
  CHECK(differing(dtensor::rms_norm<1>(xd, wd, eps).local(), dtensor::rms_norm<1>(xh, wh, eps).local(),
                  ntol) == 0);
  auto [yd, backd] = dtensor::layer_norm<1>(xd, wd, bd, eps, dtensor::with_backward);
  auto [yh, backh] = dtensor::layer_norm<1>(xh, wh, bh, eps, dtensor::with_backward);
  const auto [dxd, dwd, dbd] = backd(gd);
  const auto [dxh, dwh, dbh] = backh(gh);
  CHECK(differing(dxd.local(), dxh.local(), ntol) == 0);
  CHECK(differing(dwd.local(), dwh.local(), ntol) == 0);
  CHECK(differing(dbd.local(), dbh.local(), ntol) == 0);
  auto [rd, rbackd] = dtensor::rms_norm<1>(xd, wd, eps, dtensor::with_backward);
  auto [rh, rbackh] = dtensor::rms_norm<1>(xh, wh, eps, dtensor::with_backward);
  const auto [rdxd, rdwd] = rbackd(gd);
  const auto [rdxh, rdwh] = rbackh(gh);
  CHECK(differing(rdxd.local(), rdxh.local(), ntol) == 0);
  CHECK(differing(rdwd.local(), rdwh.local(), ntol) == 0);
}

TEMPLATE_TEST_CASE("embedding and cross_entropy of CUDA tensors equal the host's, forward and backward",
                   "[emulated][embedding][loss]", float, double, bfloat16) {
  using T = TestType;
  const auto mesh = one_rank();
  auto check_ids = [&]<class I>() {
    INFO(sizeof(I) * 8 << "-bit ids");
    // ids (2, 37) of a vocab of 45 rows of 7 (repeated ids: the scatter adds several positions)
    Tensor<I, 2> ids({2, 37});
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      ids.data()[i] = static_cast<I>((i * 11 + 3) % 45);
    }
    const Tensor<T, 2> w = ints<T, 2>({45, 7}, 1);
    const Tensor<T, 3> g = ints<T, 3>({2, 37, 7}, 2);
    auto [yd, backd] = dtensor::embedding(on(mesh, ids, gpu), on(mesh, w, gpu), dtensor::with_backward);
    auto [yh, backh] =
        dtensor::embedding(on(mesh, ids, Device::cpu()), on(mesh, w, Device::cpu()), dtensor::with_backward);
    CHECK(differing(yd.local(), yh.local(), 0) == 0);
    CHECK(differing(backd(on(mesh, g, gpu)).local(), backh(on(mesh, g, Device::cpu())).local(), 0) == 0);
    // logits (2, 19, 45) against targets with ignored rows
    const Tensor<T, 3> x = ints<T, 3>({2, 19, 45}, 3, 0.5f);
    Tensor<I, 2> t({2, 19});
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      t.data()[i] = static_cast<I>(i % 6 == 5 ? dtensor::ignore_index : (i * 7) % 45);
    }
    auto [ld, lbackd] = dtensor::cross_entropy(on(mesh, x, gpu), on(mesh, t, gpu), dtensor::with_backward);
    auto [lh, lbackh] = dtensor::cross_entropy(on(mesh, x, Device::cpu()), on(mesh, t, Device::cpu()),
                                               dtensor::with_backward);
    CHECK(differing(ld.local(), lh.local(), loose<T>()) == 0);
    CHECK(differing(lbackd(0.5).local(), lbackh(0.5).local(), loose<T>()) == 0);
  };
  check_ids.template operator()<std::int32_t>();
  check_ids.template operator()<std::int64_t>();
}

TEMPLATE_TEST_CASE("local::gather_rows and combine_rows (MoE's) on CUDA tensors equal the host's",
                   "[emulated][moe]", float, double, bfloat16) {
  using T = TestType;
  const Tensor<T, 2> in = ints<T, 2>({37, 5}, 1);
  std::vector<std::int64_t> index;
  std::vector<double> weight;
  for (std::int64_t r = 0; r < 50; ++r) { // every token twice, some rows not at all
    index.push_back((r * 3) % 25);
    weight.push_back(r % 4 == 0 ? 0.5 : r % 4 == 1 ? -1.0 : 0.25);
  }
  CHECK(differing(local::gather_rows(in.to(gpu), index), local::gather_rows(in, index), 0) == 0);
  CHECK(differing(local::gather_rows(in.to(gpu), index, weight), local::gather_rows(in, index, weight), 0) ==
        0);
  // 25 tokens with k = 2 slots each into 50 rows; slot -1: a dropped assignment
  const Tensor<T, 2> rows = ints<T, 2>({50, 5}, 2);
  std::vector<std::int64_t> slot;
  for (std::int64_t s = 0; s < 50; ++s) {
    slot.push_back(s % 9 == 4 ? -1 : (s * 13) % 50);
  }
  CHECK(differing(local::combine_rows(rows.to(gpu), slot, weight, 25, 2),
                  local::combine_rows(rows, slot, weight, 25, 2), 0) == 0);
  CHECK(differing(local::combine_rows(rows.to(gpu), slot, {}, 25, 2),
                  local::combine_rows(rows, slot, {}, 25, 2), 0) == 0);
}

TEST_CASE("the fake backend moves CUDA tensors of the emulated device: collectives and redistributions",
          "[emulated][fake]") {
  // Rank 1 of 4, alone (backends/fake): each op's data movement runs as one emulated kernel.
  const dtensor::ProcessGroup world = dtensor::fake_world(1, 4);
  const Tensor<float, 2> h = ints<float, 2>({3, 10}, 1);
  const Tensor<float, 2> d = h.to(gpu);
  dtensor::all_reduce(h, dtensor::ReduceOp::sum, world);
  dtensor::all_reduce(d, dtensor::ReduceOp::sum, world);
  CHECK(differing(d, h, 0) == 0);
  const Tensor<float, 2> gh({12, 10});
  const Tensor<float, 2> gd({12, 10}, gpu);
  dtensor::all_gather_into_tensor(gh, h, world);
  dtensor::all_gather_into_tensor(gd, d, world);
  CHECK(differing(gd, gh, 0) == 0);
  // A DTensor on a mesh of the 4 fake ranks: gathered (all_gather), then sharded on the other dim (local).
  using Mesh4 = dtensor::MeshShape<dtensor::Axis<"x">>;
  const auto mesh = dtensor::init_device_mesh<Mesh4>(world);
  using S0 = dtensor::DTensor<float, 2, Mesh4, dtensor::Shard<0>>;
  const Tensor<float, 2> block = ints<float, 2>({2, 10}, 2);
  auto redistributed = [&](const Device& device) {
    const S0 x(mesh, device.is_cpu() ? block : block.to(device), {8, 10});
    const auto r = x.redistribute<dtensor::Replicate>();
    return std::pair{r.local(), r.redistribute<dtensor::Shard<1>>().local()};
  };
  const auto [rh, sh] = redistributed(Device::cpu());
  const auto [rd, sd] = redistributed(gpu);
  CHECK(differing(rd, rh, 0) == 0);
  CHECK(differing(sd, sh, 0) == 0);
}
