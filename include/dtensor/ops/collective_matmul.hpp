#pragma once
// Collective matmul: a linear whose input must first be all_gathered over one mesh axis, or whose output
// must then be reduce_scattered over one, run in blocks so that the transfer of one block overlaps the
// GEMM of another (the sequence-parallel entry and exit of Megatron's tensor-parallel regions; PyTorch's
// fused_all_gather_matmul and fused_matmul_reduce_scatter, JAX's collective matmul):
//
//   // x (batch, seq, hidden) [S(1)] over tp; w1, w3 (ffn, hidden) [S(0)]: column parallel
//   auto [xg, a, u] = all_gather_linear(x, std::tie(w1, w3));   // xg: x [R] over tp, a = linear(xg, w1), ...
//   // m (batch, seq, ffn) [S(2)]; w2 (hidden, ffn) [S(1)]: linear(m, w2) is Partial over tp
//   auto y = linear_reduce_scatter<Y>(m, w2);   // Y: linear(m, w2)'s type with [S(1)] over tp
//   auto [ys, back] = all_gather_linear(x, std::tie(w1, w3), with_backward);  // ys: {a, u}
//   auto [dx, dws] = back(da, du);                                             // dws: {dw1, dw3}
//
// The results are those of the unfused calls (x.redistribute to the gathered placements, then linear;
// linear, then redistribute to Y) within rounding: the gathered x and the weights' gradients bit for bit,
// the reduction in rank order as gloo's reduce_scatter folds, but a GEMM of a block of rows may round
// otherwise than the GEMM of all rows (OpenBLAS picks its kernel by size; integer values stay exact), and
// MPI's and NCCL's reduce_scatter order their sums otherwise. The gathered axis is the one where x shards a
// dim other than its features and the weights shard their output features; it must be the last axis sharding
// that dim (the default order).
//
// Schedule, n ranks on the axis, this one r. all_gather_linear posts n-1 exchanges before computing
// anything, exchange k sending x's block to r+k and receiving r-k's; it runs the GEMMs of its own block,
// then of each received block as its exchange completes, writing the rows of the outputs (and of the
// gathered x, returned without the backward) in place. linear_reduce_scatter computes the partial block of rank
// r+k and posts its exchange (send it, receive r-k's partial of block r) for k = 1..n-1, then its own
// block, and folds the n partials of block r in rank order. Why exchanges by shift rather than a ring:
// no exchange depends on another, so on gloo the transport thread streams them all while this thread
// multiplies (a ring's hop k+1 waits until hop k arrived and was forwarded by this thread), and on NCCL
// each exchange is one grouped send/recv on the group's stream, which runs beside the GEMMs on the
// tensor's stream (an op waits for the caller's stream when posted: the partials are posted after their
// GEMM, the gather's receives before any). The bytes are an all_gather's and a reduce_scatter's; on a
// ring topology a shift of k crosses k links, on one host or an NVSwitch every pair is one hop.
//
// Backward, the dual schedules: all_gather_linear keeps x, not the gathered copy (activation memory:
// docs/parallel.md), and posts x's gather again before the dx = sum_i dy_i w_i partials' GEMMs; dx is
// reduce_scattered in blocks (each block's partial sums the weights in their order, as the unfused add
// does), with the dW_i = dy_i^T xg GEMMs run on the gathered x while those exchanges are in flight
// (Megatron's overlap). linear_reduce_scatter's dy is all_gathered in blocks, each block's rows of dm = dy w
// computed as it arrives, then dW = dy^T m on the gathered dy. Either backward can keep a function that
// computes its input again instead of the input (`again`, below).

#include <array>
#include <concepts>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/p2p.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/ops/matmul.hpp"

namespace dtensor {

namespace detail {

/// The p2p tag of collective matmul's exchanges: apart from a user's point-to-point streams.
inline constexpr int collective_matmul_tag = (1 << 23) - 16;

/// Where the blocks of an axis' n ranks lie along `dim` of the local tensor gathered over it.
struct AxisBlocks {
  int dim = 0;
  std::vector<std::int64_t> offset, length; ///< per coordinate on the axis

  /// The gathered extent: the lengths' sum.
  std::int64_t total() const { return std::accumulate(length.begin(), length.end(), std::int64_t{0}); }
};

/// The blocks of Sharded (sharded over `axis` on `dim`) within Gathered's block (the same, Replicate there).
template <class Sharded, class Gathered, class Mesh, class GlobalShape>
AxisBlocks axis_blocks(const Mesh& mesh, const GlobalShape& global, int axis, int dim) {
  const Extents ext = to_extents(global);
  MeshCoord c = mesh.coordinate();
  const Block whole = spec_block(ext, Gathered::spec, mesh.sizes(), c);
  AxisBlocks b{dim, {}, {}};
  for (int j = 0; j < mesh.size(axis); ++j) {
    c[axis] = j;
    const Block part = spec_block(ext, Sharded::spec, mesh.sizes(), c);
    b.offset.push_back(part.offset[dim] - whole.offset[dim]);
    b.length.push_back(part.shape[dim]);
  }
  return b;
}

/// gather_blocks in two halves: the constructor posts the exchanges (send `mine` to each other rank of
/// `group`, receive theirs), finish(on_block) calls on_block(j, block) for every rank j, first this rank's
/// own, then each other rank's block (of `blocks.length[j]` along blocks.dim) as it arrives. Between the two
/// the caller computes while the blocks are in flight.
template <class T, int R>
class PostedGather {
public:
  PostedGather(const Tensor<T, R>& mine, const AxisBlocks& blocks, const ProcessGroup& group,
               int tag = collective_matmul_tag)
      : mine_(mine), n_(group.size()), r_(group.rank()), got_(n_) {
    works_.reserve(n_);
    for (int k = 1; k < n_; ++k) {
      const int from = (r_ - k + n_) % n_;
      auto shape = mine.shape();
      shape[blocks.dim] = blocks.length[from];
      got_[k] = Tensor<T, R>::empty(shape, mine.device());
      const std::vector<P2POp> ops{{P2POp::isend, mine, (r_ + k) % n_, group, tag},
                                   {P2POp::irecv, got_[k], from, group, tag}};
      works_.push_back(batch_isend_irecv(ops)[0]);
    }
  }

  template <class F>
  void finish(F on_block) {
    on_block(r_, mine_);
    for (int k = 1; k < n_; ++k) {
      works_[k - 1].wait();
      on_block((r_ - k + n_) % n_, got_[k]);
    }
  }

private:
  Tensor<T, R> mine_;
  int n_, r_;
  std::vector<Tensor<T, R>> got_;
  std::vector<Work> works_;
};

/// on_block(j, block) for every rank j of `group`: first this rank's `mine`, then each other rank's block
/// (of `blocks.length[j]` along blocks.dim) as it arrives; the exchanges are all posted first.
template <class T, int R, class F>
void gather_blocks(const Tensor<T, R>& mine, const AxisBlocks& blocks, const ProcessGroup& group,
                   F on_block) {
  PostedGather<T, R>(mine, blocks, group).finish(on_block);
}

/// The sum over `group`'s ranks, in rank order, of each rank's partial(r) (this rank r's block):
/// partial(j) gives this rank's contribution to rank j's block (a contiguous tensor), between() runs once
/// every exchange is posted, before this rank's own partial.
template <class T, int R, class F, class B>
Tensor<T, R> reduce_scatter_blocks(const AxisBlocks& blocks, const ProcessGroup& group, F partial,
                                   B between) {
  const int n = group.size();
  const int r = group.rank();
  std::vector<Tensor<T, R>> in(n); // in[q]: rank q's partial of this rank's block
  std::vector<Work> works;
  works.reserve(n);
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n;
    const int from = (r - k + n) % n;
    Tensor<T, R> p = partial(to);
    auto shape = p.shape();
    shape[blocks.dim] = blocks.length[r];
    in[from] = Tensor<T, R>::empty(shape, p.device());
    const std::vector<P2POp> ops{{P2POp::isend, p, to, group, collective_matmul_tag},
                                 {P2POp::irecv, in[from], from, group, collective_matmul_tag}};
    works.push_back(batch_isend_irecv(ops)[0]);
  }
  between();
  in[r] = partial(r);
  for (auto& w : works) {
    w.wait();
  }
  if (n == 1) {
    return in[0];
  }
  Tensor<T, R> out = local::map(local::Add{}, in[0], in[1]);
  for (int q = 2; q < n; ++q) {
    local::map_into(out, local::Add{}, out, in[q]);
  }
  return out;
}

/// The axis all_gather_linear gathers x over: where x shards a dim other than its last and the weight its
/// output features (dim 0); -1 when none, -2 when several.
template <class X, class W>
constexpr int gather_axis() {
  int found = -1;
  for (int a = 0; a < X::placements.size(); ++a) {
    const Placement p = X::placements[a];
    if (p.is_shard() && p.dim != X::rank - 1 && W::placements[a] == Placement::shard(0)) {
      found = found == -1 ? a : -2;
    }
  }
  return found;
}

/// Whether `axis` is the last axis sharding `dim` in `l` (so its blocks are contiguous within the others').
constexpr bool innermost(const PlacementList& l, int axis, int dim) {
  for (int a = axis + 1; a < l.size(); ++a) {
    if (l[a] == Placement::shard(dim)) {
      return false;
    }
  }
  return true;
}

/// The types of all_gather_linear(x, {w...}).
template <class X, class W0, class... W>
struct GatherLinearTypes {
  static constexpr int axis = gather_axis<X, W0>();
  static_assert(axis >= 0, "all_gather_linear: x must be sharded on one of its non-feature dims (the "
                           "sequence) over exactly one mesh axis where the weights shard their output "
                           "features (Shard<0>): the sequence-parallel entry of a column-parallel linear");
  static constexpr int ax = axis < 0 ? 0 : axis;
  static constexpr int dim = X::placements[ax].dim;
  static_assert(axis < 0 || innermost(X::placements, ax, dim),
                "all_gather_linear: the gathered axis must be the last mesh axis sharding that dim");
  static_assert(((W::placements == W0::placements) && ...),
                "all_gather_linear: every weight must have the same placements");
  using Xg = with_axis_t<X, ax, Placement::replicate()>;
  using Ps = Products<X::rank, 2, true>;
  template <class Wi>
  using Y = product_result_t<&Ps::forward, Xg, Wi, X::rank>;
};

/// The types of linear_reduce_scatter<Out>(m, w): C = linear(m, w), Partial<sum> over one axis where Out is
/// Shard on a dim other than the last, and equal to Out elsewhere.
template <class Out, class M, class W>
struct LinearScatterTypes {
  using Ps = Products<M::rank, 2, true>;
  using C = product_result_t<&Ps::forward, M, W, M::rank>;
  static constexpr int axis = [] {
    int found = -1;
    for (int a = 0; a < C::placements.size(); ++a) {
      if (C::placements[a] != Out::placements[a]) {
        const bool scatter = C::placements[a] == Placement::partial(ReduceOp::sum) &&
                             Out::placements[a].is_shard() && Out::placements[a].dim != M::rank - 1;
        found = scatter && found == -1 ? a : -2;
      }
    }
    return found;
  }();
  static_assert(std::is_same_v<typename Out::value_type, typename C::value_type> && Out::rank == C::rank &&
                    axis >= 0,
                "linear_reduce_scatter<Out>: Out must be linear(m, w)'s type with one Partial<sum> axis "
                "turned into a Shard of a non-feature dim (the sequence-parallel exit of a row-parallel "
                "linear)");
  static constexpr int ax = axis < 0 ? 0 : axis;
  static constexpr int dim = Out::placements[ax].is_shard() ? Out::placements[ax].dim : 0;
  static_assert(
      axis < 0 || innermost(Out::placements, ax, dim),
      "linear_reduce_scatter<Out>: the scattered axis must be the last mesh axis sharding that dim");
};

/// t's shape with dim `d` set to `n`.
template <class T, int R>
std::array<std::int64_t, R> with_extent(const Tensor<T, R>& t, int d, std::int64_t n) {
  auto s = t.shape();
  s[d] = n;
  return s;
}

/// all_gather_linear's forward: {xg, linear(xg, w)...}.
template <class X, class... W, std::size_t... I>
auto gather_linear(const X& x, const std::tuple<const W&...>& ws, std::index_sequence<I...>) {
  using Ty = GatherLinearTypes<X, W...>;
  using Xg = typename Ty::Xg;
  using T = typename X::value_type;
  constexpr int R = X::rank;
  const std::array<typename X::shape_type, sizeof...(W)> shapes{
      product_shape<true>(x, std::get<I>(ws))...}; // checked before any exchange
  const auto& mesh = x.mesh();
  const AxisBlocks blocks = axis_blocks<X, Xg>(mesh, x.global_shape(), Ty::ax, Ty::dim);
  const Tensor<T, R> xg =
      Tensor<T, R>::empty(with_extent(x.local(), Ty::dim, blocks.total()), x.local().device());
  const std::array<Tensor<T, R>, sizeof...(W)> ys{
      Tensor<T, R>::empty(with_extent(xg, R - 1, std::get<I>(ws).local().shape()[0]), x.local().device())...};
  gather_blocks(x.local(), blocks, mesh.group(Ty::ax), [&](int j, const Tensor<T, R>& b) {
    const std::int64_t off = blocks.offset[j];
    local::copy(xg.narrow(Ty::dim, off, b.shape()[Ty::dim]), b);
    (local::matmul_into(b, std::get<I>(ws).local(), ys[I].narrow(Ty::dim, off, b.shape()[Ty::dim]), false,
                        true),
     ...);
  });
  return std::tuple{Xg(mesh, xg, x.global_shape()), typename Ty::template Y<W>(mesh, ys[I], shapes[I])...};
}

} // namespace detail

/// The backward context of all_gather_linear: keeps x (again() gives it: kept, or computed again) and the
/// weights, not the gathered x. The backward gathers x again, posted before the dx partials' GEMMs and
/// finished while dx is reduce_scattered, where the dW GEMMs run on it (Megatron's schedule).
template <class X, class Again, class... W>
class GatherLinearBackward {
  using Ty = detail::GatherLinearTypes<X, W...>;
  using Xg = typename Ty::Xg;
  using Ps = typename Ty::Ps;
  using T = typename X::value_type;
  static constexpr int R = X::rank;

public:
  GatherLinearBackward(Again again, std::tuple<W...> ws) : again_(std::move(again)), ws_(std::move(ws)) {}

  /// {dx, {dw...}} from the outputs' gradients (any placements), one per weight in order.
  template <AnyDTensor... G>
  auto operator()(const G&... dy) const {
    static_assert(sizeof...(G) == sizeof...(W), "all_gather_linear backward: one gradient per weight");
    return run(std::index_sequence_for<W...>{}, dy...);
  }

private:
  template <class Y, class G>
  using target_t =
      dtensor_from_t<T, R, typename detail::dtensor_traits<X>::shape_type, &detail::GradTarget<Y, G>::list>;

  template <std::size_t... I, class... G>
  auto run(std::index_sequence<I...>, const G&... dy) const {
    std::tuple dc{detail::redistribute_as<target_t<typename Ty::template Y<W>, G>, G>::run(dy)...};
    using DC0 = std::tuple_element_t<0, decltype(dc)>;
    using W0 = std::tuple_element_t<0, std::tuple<W...>>;
    using DXg = detail::product_result_t<&Ps::grad_a, DC0, W0, R>;
    static_assert(DXg::placements[Ty::ax] == Placement::partial(ReduceOp::sum));
    using DX = detail::with_axis_shard_t<DXg, Ty::ax, Ty::dim>;
    const X x = again_();
    const auto x_shape = x.global_shape();
    const auto& mesh = x.mesh();
    const ProcessGroup& group = mesh.group(Ty::ax);
    const detail::AxisBlocks blocks = detail::axis_blocks<DX, DXg>(mesh, x_shape, Ty::ax, Ty::dim);
    const detail::AxisBlocks x_blocks = detail::axis_blocks<X, Xg>(mesh, x_shape, Ty::ax, Ty::dim);
    detail::PostedGather<T, R> gather(x.local(), x_blocks, group, detail::collective_matmul_tag + 1);
    auto partial = [&](int j) {
      Tensor<T, R> p;
      ((p = I == 0
                ? local::matmul(std::get<I>(dc).local().narrow(Ty::dim, blocks.offset[j], blocks.length[j]),
                                std::get<I>(ws_).local())
                : local::map(local::Add{}, p,
                             local::matmul(
                                 std::get<I>(dc).local().narrow(Ty::dim, blocks.offset[j], blocks.length[j]),
                                 std::get<I>(ws_).local()))),
       ...);
      return p;
    };
    using DWs =
        std::tuple<detail::product_result_t<&Ps::grad_b, std::tuple_element_t<I, decltype(dc)>, Xg, 2>...>;
    std::optional<DWs> dws;
    auto weight_grads = [&] {
      const Tensor<T, R> xg =
          Tensor<T, R>::empty(detail::with_extent(x.local(), Ty::dim, x_blocks.total()), x.local().device());
      gather.finish([&](int j, const Tensor<T, R>& b) {
        local::copy(xg.narrow(Ty::dim, x_blocks.offset[j], b.shape()[Ty::dim]), b);
      });
      const Xg g(mesh, xg, x_shape);
      dws.emplace(detail::run_product<std::tuple_element_t<I, DWs>, &Ps::grad_b>(
          std::get<I>(dc), g, std::get<I>(ws_).global_shape())...);
    };
    DX dx(mesh, detail::reduce_scatter_blocks<T, R>(blocks, group, partial, weight_grads), x_shape);
    return std::pair{detail::as_gradient_of<X>(std::move(dx)),
                     std::tuple{detail::as_gradient_of<W>(std::get<I>(std::move(*dws)))...}};
  }

  Again again_;
  std::tuple<W...> ws_;
};

/// The backward context of linear_reduce_scatter<Out>: keeps m (again() gives it: kept, or computed again)
/// and w.
template <class Out, class M, class W, class Again = Kept<M>>
class LinearScatterBackward {
  using Ty = detail::LinearScatterTypes<Out, M, W>;
  using Ps = typename Ty::Ps;
  using T = typename M::value_type;
  static constexpr int R = M::rank;

public:
  LinearScatterBackward(Again again, W w) : again_(std::move(again)), w_(std::move(w)) {}

  /// {dm, dw} from the output's gradient (any placements).
  template <AnyDTensor G>
  auto operator()(const G& dy) const {
    using D = dtensor_from_t<T, R, typename detail::dtensor_traits<M>::shape_type,
                             &detail::GradTarget<Out, G>::list>;
    using Cg = detail::with_axis_t<D, Ty::ax, Placement::replicate()>;
    using DM = detail::product_result_t<&Ps::grad_a, Cg, W, R>;
    using DW = detail::product_result_t<&Ps::grad_b, Cg, M, 2>;
    const M m = again_();
    const auto c_shape = detail::product_shape<true>(m, w_);
    DTENSOR_CHECK(dy.global_shape() == c_shape,
                  "backward of linear_reduce_scatter: the gradient's global shape " +
                      detail::shape_string(detail::to_extents(dy.global_shape())) + " is not the output's " +
                      detail::shape_string(detail::to_extents(c_shape)));
    const D d = detail::redistribute_as<D, G>::run(dy);
    const auto& mesh = m.mesh();
    const detail::AxisBlocks blocks = detail::axis_blocks<D, Cg>(mesh, c_shape, Ty::ax, Ty::dim);
    const auto device = d.local().device();
    const Tensor<T, R> dc =
        Tensor<T, R>::empty(detail::with_extent(d.local(), Ty::dim, blocks.total()), device);
    const Tensor<T, R> dm =
        Tensor<T, R>::empty(detail::with_extent(dc, R - 1, w_.local().shape()[1]), device);
    detail::gather_blocks(d.local(), blocks, mesh.group(Ty::ax), [&](int j, const Tensor<T, R>& b) {
      const std::int64_t off = blocks.offset[j];
      local::copy(dc.narrow(Ty::dim, off, b.shape()[Ty::dim]), b);
      local::matmul_into(b, w_.local(), dm.narrow(Ty::dim, off, b.shape()[Ty::dim]));
    });
    const Cg dcg(mesh, dc, c_shape);
    DW dw = detail::run_product<DW, &Ps::grad_b>(dcg, m, w_.global_shape());
    return std::pair{detail::as_gradient_of<M>(DM(mesh, dm, m.global_shape())),
                     detail::as_gradient_of<W>(std::move(dw))};
  }

private:
  Again again_;
  W w_;
};

/// {x gathered over the axis the weights need it whole on, linear(that, w)...} for the weights of
/// std::tie(w...), the gather overlapped with the GEMMs (see the top of this file).
template <AnyDTensor X, class... W>
auto all_gather_linear(const X& x, const std::tuple<W&...>& ws) {
  const std::tuple<const std::remove_cv_t<W>&...> cws = ws;
  return detail::gather_linear(x, cws, std::index_sequence_for<W...>{});
}
/// With the backward: `auto [ys, back] = all_gather_linear(x, std::tie(w1, w3), with_backward);`, ys the
/// tuple {linear(xg, w1), linear(xg, w3)}, `auto [dx, dws] = back(dy1, dy3)`, dws the tuple {dw1, dw3}. The
/// backward keeps x, not the gathered copy (it gathers again); with `again`, a function returning x, it keeps
/// that instead (x computed again from what an earlier op keeps anyway, as nn::TransformerBlock does with a
/// norm's output).
template <AnyDTensor X, class... W, std::invocable Again>
auto all_gather_linear(const X& x, const std::tuple<W&...>& ws, WithBackwardTag, Again again) {
  static_assert(std::is_same_v<std::remove_cvref_t<std::invoke_result_t<const Again&>>, X>,
                "all_gather_linear: `again` must return the input's type");
  auto all = all_gather_linear(x, ws);
  using Back = GatherLinearBackward<X, Again, std::remove_cv_t<W>...>;
  auto ys = std::apply([](const auto&, const auto&... y) { return std::tuple{y...}; }, all);
  return WithBackward<decltype(ys), Back>{std::move(ys),
                                          Back(std::move(again), std::tuple<std::remove_cv_t<W>...>(ws))};
}
template <AnyDTensor X, class... W>
auto all_gather_linear(const X& x, const std::tuple<W&...>& ws, WithBackwardTag) {
  return all_gather_linear(x, ws, with_backward, Kept<X>{x});
}

/// linear(m, w) reduce-scattered to Out (linear(m, w)'s type with a Partial<sum> axis turned Shard), each
/// block's reduction overlapped with the next block's GEMM (see the top of this file).
template <AnyDTensor Out, AnyDTensor M, AnyDTensor W>
Out linear_reduce_scatter(const M& m, const W& w) {
  using Ty = detail::LinearScatterTypes<Out, M, W>;
  using T = typename M::value_type;
  constexpr int R = M::rank;
  const auto c_shape = detail::product_shape<true>(m, w);
  const auto& mesh = m.mesh();
  const detail::AxisBlocks blocks = detail::axis_blocks<Out, typename Ty::C>(mesh, c_shape, Ty::ax, Ty::dim);
  auto partial = [&](int j) {
    return local::matmul(m.local().narrow(Ty::dim, blocks.offset[j], blocks.length[j]), w.local(), false,
                         true);
  };
  return Out(mesh, detail::reduce_scatter_blocks<T, R>(blocks, mesh.group(Ty::ax), partial, [] {}), c_shape);
}
/// With the backward: `auto [y, back] = linear_reduce_scatter<Out>(m, w, with_backward);`, then
/// `auto [dm, dw] = back(dy);`. With `again`, a function returning m, the backward keeps that instead of m
/// (m computed again from what an earlier op keeps, as nn::Mlp does with its activation).
template <AnyDTensor Out, AnyDTensor M, AnyDTensor W, std::invocable Again>
auto linear_reduce_scatter(const M& m, const W& w, WithBackwardTag, Again again) {
  static_assert(std::is_same_v<std::remove_cvref_t<std::invoke_result_t<const Again&>>, M>,
                "linear_reduce_scatter: `again` must return m's type");
  using Back = LinearScatterBackward<Out, M, W, Again>;
  return WithBackward<Out, Back>{linear_reduce_scatter<Out>(m, w), Back(std::move(again), w)};
}
template <AnyDTensor Out, AnyDTensor M, AnyDTensor W>
auto linear_reduce_scatter(const M& m, const W& w, WithBackwardTag) {
  return linear_reduce_scatter<Out>(m, w, with_backward, Kept<M>{m});
}

} // namespace dtensor
