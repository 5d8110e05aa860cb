// Training utilities on sharded parameters (train/optim.hpp, clip.hpp, param_init.hpp) against
// single-process references written out from torch's documented formulas: SGD (momentum, dampening, nesterov,
// weight decay, maximize) and AdamW (decoupled weight decay, bias correction, amsgrad) over several steps on
// 1-D meshes of 1-4 ranks and on (2,2), uneven shards, shards of 32+ contiguous elements with a tail (the
// host update's vectorised blocks of 32 and the elements after them; double and float), raw flat
// shards, bf16 parameters with fp32 state and master weights; clip_grad_norm against the norm of the full
// gradients (replicas counted once, a mix of Shard and Replicate gradients on a 2-D mesh, one all_reduce),
// applied and not applied, the inf norm; parameter init equal to the one-rank fill bit for bit for several
// placements.
#include <catch2/catch.hpp>

#include <dtensor/comm/collectives.hpp>
#include <dtensor/comm/comm_debug.hpp>
#include <dtensor/core/extents.hpp>
#include <dtensor/local/copy.hpp>
#include <dtensor/mesh/device_mesh.hpp>
#include <dtensor/nn/init.hpp>
#include <dtensor/ops/random.hpp>
#include <dtensor/tensor/distribute.hpp>
#include <dtensor/testing/run_ranks.hpp>
#include <dtensor/train/clip.hpp>
#include <dtensor/train/optim.hpp>

#include "../support/ops_tensors.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

using namespace dtensor;
using namespace dtensor::test_support;

namespace {

using Vec = std::vector<double>;

Vec values(int seed, std::int64_t n, double scale = 1) {
  Vec v(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) {
    v[static_cast<std::size_t>(e)] = scale * value(seed, e);
  }
  return v;
}

template <class DT, class Mesh>
DT make_scaled(const DeviceMesh<Mesh>& mesh, const typename DT::shape_type& shape, int seed, double scale) {
  DT x = make<DT>(mesh, shape, seed);
  local::scale(x.local(), scale);
  return x;
}

// ---- references: torch's algorithms, written plainly ---------------------------------------------------

// torch.optim.SGD, one parameter.
struct SgdRef {
  explicit SgdRef(optim::SGDOptions options) : o(options) {}
  optim::SGDOptions o;
  Vec buf;
  bool first = true;
  void step(Vec& p, const Vec& grad) {
    if (first && o.momentum != 0) {
      buf.assign(p.size(), 0);
    }
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = o.maximize ? -grad[i] : grad[i];
      if (o.weight_decay != 0) {
        g = g + o.weight_decay * p[i];
      }
      if (o.momentum != 0) {
        buf[i] = first ? g : o.momentum * buf[i] + (1 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
      }
      p[i] = p[i] - o.lr * g;
    }
    first = false;
  }
};

// torch.optim.AdamW, one parameter: the documented algorithm (m_hat, v_hat).
struct AdamWRef {
  explicit AdamWRef(optim::AdamWOptions options) : o(options) {}
  optim::AdamWOptions o;
  Vec m, v, vmax;
  int t = 0;
  void step(Vec& p, const Vec& grad) {
    if (t == 0) {
      m.assign(p.size(), 0);
      v.assign(p.size(), 0);
      vmax.assign(p.size(), 0);
    }
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double g = o.maximize ? -grad[i] : grad[i];
      p[i] = p[i] - o.lr * o.weight_decay * p[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      const double m_hat = m[i] / (1 - std::pow(o.beta1, t));
      double v_hat = v[i] / (1 - std::pow(o.beta2, t));
      if (o.amsgrad) {
        vmax[i] = std::max(vmax[i], v[i]);
        v_hat = vmax[i] / (1 - std::pow(o.beta2, t));
      }
      p[i] = p[i] - o.lr * m_hat / (std::sqrt(v_hat) + o.eps);
    }
  }
};

template <class Y>
void check_vec(const Y& y, const Vec& want, double tol, const std::string& what) {
  check_full(
      y, [&](std::int64_t e) { return want[static_cast<std::size_t>(e)]; }, tol, what);
}

const std::vector<optim::SGDOptions> sgd_options = {
    {.lr = 0.1},
    {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
    {.lr = 0.05, .momentum = 0.8, .weight_decay = 0.05, .nesterov = true},
    {.lr = 0.02, .momentum = 0.5, .maximize = true},
};
const std::vector<optim::AdamWOptions> adamw_options = {
    {.lr = 0.05},
    {.lr = 0.1, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1},
    {.lr = 0.05, .weight_decay = 0.02, .amsgrad = true},
    {.lr = 0.01, .beta1 = 0.6, .maximize = true},
};

// Four steps of each optimizer configuration on a parameter of type DT (values value(1, .)), gradients
// value(10 + step, .), two parameters stepped together (the tuple form): DT and a replicated vector.
template <class Mesh>
struct ReplicatedVector;
template <>
struct ReplicatedVector<Mesh1> {
  using type = DTensor<double, 1, Mesh1, R>;
};
template <>
struct ReplicatedVector<Mesh2> {
  using type = DTensor<double, 1, Mesh2, R, R>;
};

template <class DT, class Mesh>
void optimizer_case(const DeviceMesh<Mesh>& mesh, const typename DT::shape_type& shape,
                    const std::string& what, const std::vector<optim::SGDOptions>& sgd = sgd_options,
                    const std::vector<optim::AdamWOptions>& adamw = adamw_options, double tol = 1e-12) {
  using V = typename ReplicatedVector<Mesh>::type;
  std::int64_t n = 1;
  for (auto s : shape) {
    n *= s;
  }
  auto run = [&]<class Opt, class Ref>(const auto& options, const std::string& name) {
    for (std::size_t c = 0; c < options.size(); ++c) {
      DT w = make<DT>(mesh, shape, 1);
      V b = make<V>(mesh, {5}, 2);
      Vec w_ref = values(1, n), b_ref = values(2, 5);
      Opt opt(options[c]);
      Ref rw{options[c]}, rb{options[c]};
      for (int step = 0; step < 4; ++step) {
        const DT gw = make<DT>(mesh, shape, 10 + step);
        const V gb = make<V>(mesh, {5}, 20 + step);
        opt.step(std::tie(w, b), std::tie(gw, gb));
        rw.step(w_ref, values(10 + step, n));
        rb.step(b_ref, values(20 + step, 5));
        const std::string at =
            what + " " + name + " options " + std::to_string(c) + " step " + std::to_string(step);
        check_vec(w, w_ref, tol, at + " (weight)");
        check_vec(b, b_ref, tol, at + " (bias)");
      }
      expect(opt.state(0).step == 4 && opt.state(1).step == 4, what + ": step counts");
    }
  };
  run.template operator()<optim::SGD, SgdRef>(sgd, "SGD");
  run.template operator()<optim::AdamW, AdamWRef>(adamw, "AdamW");
}

// Configurations for the shards that reach the vectorised host update: maximize with weight decay and
// momentum (maximize negates the gradient before the decay is added), nesterov, no momentum; AdamW with
// maximize and weight decay, both forms of its lerp (1 - beta1 below and above 0.5), amsgrad.
const std::vector<optim::SGDOptions> sgd_block_options = {
    {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.1, .maximize = true},
    {.lr = 0.05, .momentum = 0.8, .weight_decay = 0.05, .nesterov = true, .maximize = true},
    {.lr = 0.1, .weight_decay = 0.2, .maximize = true},
    {.lr = 0.1, .momentum = 0.5},
};
const std::vector<optim::AdamWOptions> adamw_block_options = {
    {.lr = 0.05, .weight_decay = 0.1, .maximize = true},
    {.lr = 0.1, .beta1 = 0.3, .beta2 = 0.9, .eps = 1e-6, .weight_decay = 0.05},
    {.lr = 0.05, .weight_decay = 0.02, .amsgrad = true},
};

} // namespace

TEST_CASE("SGD and AdamW on sharded parameters equal torch's formulas over several steps: 1-D meshes of 1-4 "
          "ranks and (2,2), uneven shards",
          "[parallel]") {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    INFO("ranks " << ranks);
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      optimizer_case<DTensor<double, 2, Mesh1, S<0>>>(mesh, {5, 3}, "[S(0)] (5, 3)");
      optimizer_case<DTensor<double, 2, Mesh1, S<1>>>(mesh, {2, 7}, "[S(1)] (2, 7)");
      optimizer_case<DTensor<double, 2, Mesh1, R>>(mesh, {3, 3}, "[R] (3, 3)");
      optimizer_case<DTensor<double, 1, Mesh1, S<0>>>(mesh, {3}, "[S(0)] (3): empty shards");
    });
  }
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    optimizer_case<DTensor<double, 2, Mesh2, S<0>, S<1>>>(mesh, {5, 3}, "[S(0),S(1)] (5, 3)");
    optimizer_case<DTensor<double, 2, Mesh2, R, S<0>>>(mesh, {5, 3}, "[R,S(0)] (5, 3)");
    optimizer_case<DTensor<double, 2, Mesh2, S<1>, R>>(mesh, {2, 5}, "[S(1),R] (2, 5)");
    optimizer_case<DTensor<double, 2, Mesh2, S<0>, S<0>>>(mesh, {7, 2}, "[S(0),S(0)] (7, 2)");
  });
}

TEST_CASE("SGD and AdamW on shards of 32+ elements and a tail: the vectorised host update equals torch's "
          "formulas, double and float, on 1-D meshes of 1-4 ranks and (2,2)",
          "[parallel]") {
  // 201 elements: shards of 201; 101, 100; 67 x 3; 51 x 3 and 48. (3, 134) on dim 1: (3, 134), (3, 67),
  // (3, 45) / (3, 44), (3, 34) / (3, 32), each contiguous. Every shard is whole blocks of 32 and a tail.
  for (int ranks = 1; ranks <= 4; ++ranks) {
    INFO("ranks " << ranks);
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      optimizer_case<DTensor<double, 1, Mesh1, S<0>>>(mesh, {201}, "[S(0)] (201)", sgd_block_options,
                                                      adamw_block_options);
      optimizer_case<DTensor<double, 2, Mesh1, S<1>>>(mesh, {3, 134}, "[S(1)] (3, 134)", sgd_block_options,
                                                      adamw_block_options);
      optimizer_case<DTensor<double, 1, Mesh1, R>>(mesh, {67}, "[R] (67)", sgd_block_options,
                                                   adamw_block_options);
      // float: state and arithmetic in float, against the double reference.
      optimizer_case<DTensor<float, 1, Mesh1, S<0>>>(mesh, {201}, "float [S(0)] (201)", sgd_block_options,
                                                     adamw_block_options, 2e-6);
    });
  }
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    optimizer_case<DTensor<double, 2, Mesh2, S<0>, S<1>>>(mesh, {5, 134}, "[S(0),S(1)] (5, 134)",
                                                          sgd_block_options, adamw_block_options);
  });
}

TEST_CASE("optimizers step raw local shards: parameters in a flat buffer (FSDP-like), strided views",
          "[parallel]") {
  // Two parameters of 6 and 5 elements in one flat buffer, and their gradients in another.
  Tensor<double, 1> flat({11});
  Tensor<double, 1> grad({11});
  const Vec init = values(3, 11, 0.5);
  std::copy(init.begin(), init.end(), flat.data());
  Vec p1(init.begin(), init.begin() + 6), p2(init.begin() + 6, init.end());
  optim::AdamW opt({.lr = 0.05, .weight_decay = 0.1, .amsgrad = true});
  AdamWRef r1{opt.options()}, r2{opt.options()};
  // A third parameter: every other element of an 8-element buffer (stride 2).
  Tensor<double, 1> strided_storage({8});
  const Vec init3 = values(4, 8);
  std::copy(init3.begin(), init3.end(), strided_storage.data());
  const auto p3_view = Tensor<double, 1>::from_blob(strided_storage.data(), {4}, {2});
  Vec p3 = {init3[0], init3[2], init3[4], init3[6]};
  optim::SGD sgd({.lr = 0.1, .momentum = 0.9, .nesterov = true});
  SgdRef r3{sgd.options()};
  for (int step = 0; step < 3; ++step) {
    const Vec g = values(30 + step, 11);
    std::copy(g.begin(), g.end(), grad.data());
    opt.step(0, flat.narrow(0, 0, 6), grad.narrow(0, 0, 6));
    opt.step(1, flat.narrow(0, 6, 5), grad.narrow(0, 6, 5));
    r1.step(p1, Vec(g.begin(), g.begin() + 6));
    r2.step(p2, Vec(g.begin() + 6, g.end()));
    sgd.step(0, p3_view, grad.narrow(0, 0, 4));
    r3.step(p3, Vec(g.begin(), g.begin() + 4));
    for (int i = 0; i < 11; ++i) {
      const double want = i < 6 ? p1[static_cast<std::size_t>(i)] : p2[static_cast<std::size_t>(i - 6)];
      REQUIRE(flat.data()[i] == Approx(want).epsilon(1e-12));
    }
    for (int i = 0; i < 4; ++i) {
      REQUIRE(p3_view(i) == Approx(p3[static_cast<std::size_t>(i)]).epsilon(1e-12));
      REQUIRE(strided_storage(2 * i + 1) == init3[static_cast<std::size_t>(2 * i + 1)]); // untouched
    }
  }
  CHECK(opt.state(0).exp_avg.shape() == Extents{6});
  CHECK(opt.state(1).max_exp_avg_sq.shape() == Extents{5});
  CHECK(sgd.state(0).momentum_buffer.shape() == Extents{4});
  CHECK_THROWS_WITH(opt.step(1, flat.narrow(0, 0, 6), grad.narrow(0, 0, 6)),
                    Catch::Contains("parameter 1 has 6 local elements, its state 5"));
  CHECK_THROWS_WITH(opt.step(2, flat.narrow(0, 0, 6), grad.narrow(0, 0, 5)),
                    Catch::Contains("its gradient [5]"));
  CHECK_THROWS_WITH(optim::SGD({.lr = 0.1, .dampening = 0.5, .nesterov = true}),
                    Catch::Contains("Nesterov momentum requires a momentum and zero dampening"));
}

TEST_CASE("bfloat16 parameters: AdamW and SGD state in fp32, with master weights the parameter is the fp32 "
          "copy rounded",
          "[parallel]") {
  // (5, 27) over 2 ranks: shards of 81 and 54 elements, whole blocks of 32 and a tail (the host update
  // without master weights runs in blocks).
  constexpr std::int64_t cols = 27;
  constexpr std::int64_t numel = 5 * cols;
  testing::run_ranks(2, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    using B = DTensor<bfloat16, 2, Mesh1, S<0>>;
    auto make_b = [&](int seed, double scale) {
      return from_global_index<bfloat16, S<0>>(mesh, {5, cols}, [&](const auto& idx) {
        return bfloat16(static_cast<float>(scale * value(seed, idx[0] * cols + idx[1])));
      });
    };
    for (bool master : {true, false}) {
      B w = make_b(1, 0.5);
      Vec ref = values(1, numel, 0.5);
      optim::AdamW opt({.lr = 0.01, .weight_decay = 0.1, .master_weights = master});
      AdamWRef r{opt.options()};
      for (int step = 0; step < 5; ++step) {
        const B g = make_b(10 + step, 0.25);
        opt.step(0, w, g);
        r.step(ref, values(10 + step, numel, 0.25));
      }
      const optim::ParamState& st = opt.state(0);
      expect(st.exp_avg.dtype() == DType::float32 && st.exp_avg_sq.dtype() == DType::float32,
             "bf16 AdamW: state in fp32");
      const auto full = w.full_tensor();
      if (master) {
        expect(st.master.dtype() == DType::float32 &&
                   st.master.shape() == detail::to_extents(w.local().shape()),
               "bf16 AdamW: an fp32 master of the shard's shape");
        const auto m = st.master.as<float, 2>();
        const auto off = w.local_offset();
        for (std::int64_t i = 0; i < m.shape()[0]; ++i) {
          for (std::int64_t j = 0; j < cols; ++j) {
            const float mv = m(i, j);
            expect(std::abs(mv - ref[static_cast<std::size_t>((off[0] + i) * cols + j)]) < 1e-5,
                   "bf16 AdamW master: far from the reference");
            expect(float(w.local()(i, j)) == float(bfloat16(mv)), "bf16 AdamW: parameter != master rounded");
          }
        }
      } else {
        expect(!st.master.defined(), "bf16 AdamW without master weights keeps no copy");
        for (std::int64_t e = 0; e < numel; ++e) {
          expect(std::abs(float(full.data()[e]) - ref[static_cast<std::size_t>(e)]) < 2e-2,
                 "bf16 AdamW: far from the reference");
        }
      }
    }
    // SGD with momentum and weight decay on bf16 with master weights: fp32 state, and the master steps
    // from itself. Each update (lr * grad ~ 2.5e-4) is below bfloat16's half ulp at these values (2^-9 at
    // 0.5), so a step taken from the rounded parameter would lose it: the master must follow torch's
    // algorithm in fp32 over 6 steps.
    B w = make_b(1, 0.5);
    Vec ref = values(1, numel, 0.5);
    optim::SGD sgd({.lr = 1e-3, .momentum = 0.9, .weight_decay = 0.01, .master_weights = true});
    SgdRef r{sgd.options()};
    const B w0 = make_b(1, 0.5);
    for (int step = 0; step < 6; ++step) {
      sgd.step(0, w, make_b(20 + step, 0.25));
      r.step(ref, values(20 + step, numel, 0.25));
    }
    expect(sgd.state(0).momentum_buffer.dtype() == DType::float32 &&
               sgd.state(0).master.dtype() == DType::float32,
           "bf16 SGD: fp32 state");
    const auto m = sgd.state(0).master.as<float, 2>();
    const auto off = w.local_offset();
    int moved = 0;
    for (std::int64_t i = 0; i < m.shape()[0]; ++i) {
      for (std::int64_t j = 0; j < cols; ++j) {
        const double want = ref[static_cast<std::size_t>((off[0] + i) * cols + j)];
        expect(std::abs(m(i, j) - want) < 1e-5, "bf16 SGD master: " + std::to_string(m(i, j)) +
                                                    ", the fp32 reference " + std::to_string(want));
        expect(float(w.local()(i, j)) == float(bfloat16(m(i, j))), "bf16 SGD: parameter != master rounded");
        moved += float(w.local()(i, j)) != float(w0.local()(i, j)) ? 1 : 0;
      }
    }
    expect(m.numel() == 0 || moved < m.numel(), "the updates stay below the parameters' bfloat16 precision");
  });
}

// ---- clip_grad_norm ------------------------------------------------------------------------------------

namespace {

// The gradients of the 2-D case and their global sizes: a mix of Shard and Replicate, uneven.
using GA = DTensor<double, 2, Mesh2, S<0>, R>;    // (5, 3)
using GB = DTensor<double, 2, Mesh2, R, S<1>>;    // (4, 7)
using GC = DTensor<double, 1, Mesh2, R, R>;       // (3)
using GD = DTensor<double, 2, Mesh2, S<0>, S<0>>; // (7, 2)
using GE = DTensor<float, 2, Mesh2, S<1>, S<0>>;  // (5, 6)

struct Grads2 {
  GA a;
  GB b;
  GC c;
  GD d;
  GE e;
};
Grads2 grads2(const DeviceMesh<Mesh2>& mesh) {
  auto e = from_global_index<float, S<1>, S<0>>(
      mesh, {5, 6}, [](const auto& i) { return static_cast<float>(value(5, i[0] * 6 + i[1])); });
  return {make<GA>(mesh, {5, 3}, 1), make<GB>(mesh, {4, 7}, 2), make<GC>(mesh, {3}, 3),
          make<GD>(mesh, {7, 2}, 4), e};
}
// Every element of every full gradient, in order.
Vec all_values2() {
  Vec v;
  const std::pair<int, std::int64_t> parts[] = {{1, 15}, {2, 28}, {3, 3}, {4, 14}, {5, 30}};
  for (auto [seed, n] : parts) {
    const Vec p = values(seed, n);
    v.insert(v.end(), p.begin(), p.end());
  }
  return v;
}

} // namespace

TEST_CASE("clip_grad_norm over a mix of Shard and Replicate gradients on a 2-D mesh equals the norm of the "
          "full gradients (replicas counted once), with one all_reduce, clip applied and not applied",
          "[parallel]") {
  const Vec all = all_values2();
  double sum = 0, top = 0;
  for (double x : all) {
    sum += x * x;
    top = std::max(top, std::abs(x));
  }
  const double norm_ref = std::sqrt(sum); // integer squares: exact in any order
  for (auto [dp, tp] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{3, 1}, std::pair{1, 1}}) {
    INFO("mesh (" << dp << ", " << tp << ")");
    testing::run_ranks(dp * tp, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh2>(world, dp, tp);
      // The norm's all_reduce runs over the axes of size above 1 only (none: no communication).
      const std::string over = dp > 1 && tp > 1 ? "dp*tp" : dp > 1 ? "dp" : tp > 1 ? "tp" : "";
      const auto one_over = [&](const CommDebugMode& comm, const std::string& axes) {
        return axes.empty() ? comm.total_count() == 0
                            : comm.total_count() == 1 && comm.count("all_reduce", axes) == 1;
      };
      // The norm only: exact, the same on every rank.
      {
        Grads2 g = grads2(mesh);
        CommDebugMode comm;
        const double norm = total_norm(l2_norm, g.a, g.b, g.c, g.d, g.e);
        expect(norm == norm_ref, "total_norm " + std::to_string(norm) + ", want " + std::to_string(norm_ref));
        expect(one_over(comm, over),
               "total_norm: one all_reduce over '" + over + "', got\n" + comm.to_string());
        comm.reset();
        // Gradients sharded on dp only: the all_reduce is over dp; replicated only: none.
        double ac = 0;
        for (double x : values(1, 15)) {
          ac += x * x;
        }
        for (double x : values(3, 3)) {
          ac += x * x;
        }
        expect(total_norm(l2_norm, g.a, g.c) == std::sqrt(ac), "total_norm of [S(0),R] and [R,R]");
        expect(one_over(comm, dp > 1 ? "dp" : ""),
               "[S(0),R] and [R,R]: one all_reduce over dp, got\n" + comm.to_string());
        comm.reset();
        (void)total_norm(l2_norm, g.c);
        expect(comm.total_count() == 0, "replicated gradients: no communication");
        expect(total_norm(inf_norm, g.a, g.b, g.c, g.d, g.e) == top, "inf norm");
        // Tuples (a layer's gradients) and ranges of tuples (the blocks'), nested: the same sum, one
        // all_reduce.
        comm.reset();
        const std::vector<std::tuple<decltype(g.b), decltype(g.d)>> blocks{{g.b, g.d}};
        expect(total_norm(l2_norm, std::tuple{g.a, std::tuple{g.c}}, blocks, g.e) == norm_ref,
               "total_norm of a tuple, a nested tuple and a vector of tuples");
        expect(one_over(comm, over), "tuples: one all_reduce over '" + over + "', got\n" + comm.to_string());
      }
      // Not clipped: max_norm above the norm leaves every gradient as it was.
      {
        Grads2 g = grads2(mesh);
        const double norm = clip_grad_norm(2 * norm_ref, g.a, g.b, g.c, g.d, g.e);
        expect(norm == norm_ref, "clip_grad_norm returns the norm");
        check_vec(g.a, values(1, 15), 0, "not clipped: a");
        check_vec(g.d, values(4, 14), 0, "not clipped: d");
      }
      // Clipped to half: every element times max_norm / (norm + 1e-6), in the gradient's own type.
      {
        Grads2 g = grads2(mesh);
        const double max_norm = norm_ref / 2;
        const double coef = max_norm / (norm_ref + 1e-6);
        const double norm = clip_grad_norm(max_norm, g.a, g.b, g.c, g.d, g.e);
        expect(norm == norm_ref, "clip_grad_norm returns the norm before clipping");
        const std::pair<int, std::int64_t> parts[] = {{1, 15}, {2, 28}, {3, 3}, {4, 14}};
        Vec want[4];
        for (int k = 0; k < 4; ++k) {
          want[k] = values(parts[k].first, parts[k].second, 1);
          for (double& x : want[k]) {
            x *= coef;
          }
        }
        check_vec(g.a, want[0], 0, "clipped: a");
        check_vec(g.b, want[1], 0, "clipped: b");
        check_vec(g.c, want[2], 0, "clipped: c");
        check_vec(g.d, want[3], 0, "clipped: d");
        const auto e = g.e.full_tensor();
        for (std::int64_t i = 0; i < 30; ++i) {
          const float w = static_cast<float>(value(5, i)) * static_cast<float>(coef);
          expect(e.data()[i] == w, "clipped: e (float) element " + std::to_string(i));
        }
        // The clipped gradients' norm is max_norm (up to the 1e-6 and rounding).
        expect(std::abs(total_norm(l2_norm, g.a, g.b, g.c, g.d, g.e) - max_norm) < 1e-5 * max_norm,
               "clipped norm");
        // The inf norm clips too.
        Grads2 h = grads2(mesh);
        double top_ab = 0;
        for (auto [seed, n] : {std::pair{1, 15}, std::pair{2, 28}}) {
          for (double x : values(seed, n)) {
            top_ab = std::max(top_ab, std::abs(x));
          }
        }
        expect(clip_grad_norm(1.5, inf_norm, h.a, h.b) == top_ab, "inf norm of a, b");
        check_vec(h.a, values(1, 15, 1.5 / (top_ab + 1e-6)), 1e-15, "inf-clipped: a");
      }
    });
  }
}

TEST_CASE("clip_grad_norm on 1-D meshes of 1-4 ranks: Shard and Replicate gradients, uneven and empty shards",
          "[parallel]") {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    INFO("ranks " << ranks);
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      using A = DTensor<double, 2, Mesh1, S<1>>;
      using B = DTensor<double, 1, Mesh1, S<0>>;
      using C = DTensor<double, 2, Mesh1, R>;
      A a = make<A>(mesh, {3, 5}, 1);
      B b = make<B>(mesh, {2}, 2);
      C c = make<C>(mesh, {2, 2}, 3);
      double s = 0;
      for (auto [seed, n] : {std::pair{1, 15}, std::pair{2, 2}, std::pair{3, 4}}) {
        for (double x : values(seed, n)) {
          s += x * x;
        }
      }
      CommDebugMode comm;
      expect(clip_grad_norm(1e9, a, b, c) == std::sqrt(s), "1-D clip_grad_norm");
      const int want = ranks > 1 ? 1 : 0; // none over one rank
      expect(comm.count("all_reduce") == want && comm.total_count() == want, "one all_reduce");
      // Every rank got the same value: all_gather it and compare.
      Tensor<double, 1> mine = Tensor<double, 1>::full({1}, total_norm(NormType{3}, a, b, c));
      Tensor<double, 1> every({ranks});
      all_gather_into_tensor(every, mine, world);
      for (int r = 0; r < ranks; ++r) {
        expect(every.data()[r] == mine.data()[0], "the 3-norm differs between ranks");
      }
    });
  }
}

// ---- init ----------------------------------------------------------------------------------------------

namespace {

// The fills of the init test, applied to five parameters of any placements; each takes the next key.
template <class A, class B, class C, class D, class E>
void init_all(A& a, B& b, C& c, D& d, E& e) {
  init::InitKeys keys(1234);
  init::kaiming_uniform_(a, keys.next(), std::sqrt(5.0)); // float (6, 5): nn.Linear's weight
  init::linear_bias_(b, 5, keys.next());                  // double (6)
  init::normal_(c, 0.5, 0.02, keys.next());               // float (7, 3)
  init::xavier_uniform_(d, keys.next());                  // bf16 (4, 6)
  init::kaiming_normal_(e, keys.next(), 0, init::FanMode::fan_out, init::Nonlinearity::relu); // double (3, 4)
}

struct InitFulls {
  Tensor<float, 2> a;
  Tensor<double, 1> b;
  Tensor<float, 2> c;
  Tensor<bfloat16, 2> d;
  Tensor<double, 2> e;
};

template <class T, int N>
bool same_bits(const Tensor<T, N>& x, const Tensor<T, N>& y) {
  return x.shape() == y.shape() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
}

template <class T, class... Ps, class Mesh, std::size_t N>
auto zeros_as(const DeviceMesh<Mesh>& mesh, const std::int64_t (&shape)[N], Placements<Ps...>) {
  return zeros<T, Ps...>(mesh, shape);
}

template <class PA, class PB, class PC, class PD, class PE, class Mesh>
InitFulls init_on(const DeviceMesh<Mesh>& mesh) {
  auto a = zeros_as<float>(mesh, {6, 5}, PA{});
  auto b = zeros_as<double>(mesh, {6}, PB{});
  auto c = zeros_as<float>(mesh, {7, 3}, PC{});
  auto d = zeros_as<bfloat16>(mesh, {4, 6}, PD{});
  auto e = zeros_as<double>(mesh, {3, 4}, PE{});
  init_all(a, b, c, d, e);
  return {a.full_tensor(), b.full_tensor(), c.full_tensor(), d.full_tensor(), e.full_tensor()};
}

} // namespace

TEST_CASE("parameter init: every fill equals the one-rank fill bit for bit, for several placements on 1-D "
          "meshes of 1-4 ranks and (2,2)",
          "[parallel]") {
  InitFulls want;
  testing::run_ranks(1, [&](ProcessGroup& world) {
    using PR = Placements<R>;
    want = init_on<PR, PR, PR, PR, PR>(init_device_mesh<Mesh1>(world));
  });
  // The values: kaiming_uniform_(a = sqrt(5)) within 1 / sqrt(fan_in) = 1 / sqrt(5); the bias within the
  // same bound; the normal around 0.5.
  for (std::int64_t i = 0; i < want.a.numel(); ++i) {
    REQUIRE(std::abs(want.a.data()[i]) <= 1 / std::sqrt(5.0));
  }
  for (std::int64_t i = 0; i < want.b.numel(); ++i) {
    REQUIRE(std::abs(want.b.data()[i]) <= 1 / std::sqrt(5.0));
  }
  for (std::int64_t i = 0; i < want.c.numel(); ++i) {
    REQUIRE(std::abs(want.c.data()[i] - 0.5f) < 0.2f);
  }
  std::mutex mutex;
  std::vector<std::string> failures;
  auto compare = [&](const InitFulls& got, const std::string& what) {
    std::lock_guard lock(mutex);
    if (!same_bits(got.a, want.a) || !same_bits(got.b, want.b) || !same_bits(got.c, want.c) ||
        !same_bits(got.d, want.d) || !same_bits(got.e, want.e)) {
      failures.push_back(what);
    }
  };
  for (int ranks = 1; ranks <= 4; ++ranks) {
    testing::run_ranks(ranks, [&](ProcessGroup& world) {
      auto mesh = init_device_mesh<Mesh1>(world);
      using P0 = Placements<S<0>>;
      using P1 = Placements<S<1>>;
      using PR = Placements<R>;
      compare(init_on<P0, P0, P1, P1, P0>(mesh), std::to_string(ranks) + " ranks, S(0)/S(1)");
      compare(init_on<P1, PR, P0, P0, P1>(mesh), std::to_string(ranks) + " ranks, S(1)/R");
    });
  }
  testing::run_ranks(4, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh2>(world, 2, 2);
    compare(init_on<Placements<S<0>, S<1>>, Placements<R, S<0>>, Placements<S<1>, S<0>>,
                    Placements<S<0>, S<0>>, Placements<R, S<1>>>(mesh),
            "(2,2)");
  });
  std::string failed;
  for (const auto& f : failures) {
    failed += f + "; ";
  }
  INFO("differs from the one-rank fill: " << failed);
  CHECK(failures.empty());
}

TEST_CASE("init::normal_(0, 1) and uniform_(0, 1) are randn and rand with the same key", "[parallel]") {
  testing::run_ranks(3, [&](ProcessGroup& world) {
    auto mesh = init_device_mesh<Mesh1>(world);
    auto x = zeros<float, S<1>>(mesh, {4, 5});
    init::normal_(x, 0.0, 1.0, {7, 3});
    expect(same_bits(x.full_tensor(), randn<float, R>(mesh, {4, 5}, 7, 3).full_tensor()), "normal_ != randn");
    auto y = zeros<double, S<0>>(mesh, {4, 5});
    init::uniform_(y, 0.0, 1.0, {7, 4});
    expect(same_bits(y.full_tensor(), rand<double, R>(mesh, {4, 5}, 7, 4).full_tensor()), "uniform_ != rand");
    init::ones_(y);
    check_vec(y, Vec(20, 1.0), 0, "ones_");
  });
  CHECK(init::fan_in_and_fan_out(std::array<std::int64_t, 3>{4, 3, 5}).fan_in == 15);
  CHECK(init::fan_in_and_fan_out(std::array<std::int64_t, 3>{4, 3, 5}).fan_out == 20);
  CHECK(init::calculate_gain(init::Nonlinearity::leaky_relu, std::sqrt(5.0)) == Approx(std::sqrt(1.0 / 3)));
  CHECK(init::InitKeys(9, 100).at(2, 100).offset == 102);
}
