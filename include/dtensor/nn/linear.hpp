#pragma once
// Tensor-parallel linear layers with a bias whose wiring is checked by the types (Megatron's column- and
// row-parallel linear, torch's ColwiseParallel / RowwiseParallel), with sequence parallelism as an option, on
// any mesh: layers of dtensor::nn like the others (units of the model contract, nn/contract.hpp), for a
// user's model whose activations are not nn::Layout's (batch, seq, hidden).
//
//   using Mesh = MeshShape<Axis<"dp">, Axis<"tp">>;
//   nn::ColumnParallelLinear<float, Mesh> up(mesh, hidden, ffn, /*seed=*/1);  // W (ffn, hidden): S(0) on tp
//   nn::RowParallelLinear<float, Mesh> down(mesh, ffn, hidden, /*seed=*/2);   // W (hidden, ffn): S(1) on tp
//   auto [h, up_back] = up.forward(x, with_backward);           // x [S(0),R] -> h [S(0),S(1)]: no comm
//   auto [a, act_back] = gelu(h, with_backward);
//   auto [y, down_back] = down.forward(a, with_backward);       // [S(0),P] -> all_reduce -> [S(0),R]
//   auto [da, g2] = down_back(dy);                              // g2: std::tuple{dW2, db2}
//   auto [dx, g1] = up_back(act_back(da));                      // dx [S(0),R], like x
//
// The column layer's output is Shard<last> on the tp axis, which is exactly what the row layer accepts: feed
// it anything else (a Replicate activation, a column output on another axis) and it does not compile, with
// a message naming the placement it needs. With SequenceParallel the column layer takes its input
// Shard<SeqDim> on tp and all_gathers it on entry, and the row layer reduce_scatters its output to
// Shard<SeqDim> instead of all_reducing it, so the activations between blocks (norms, dropout, residuals)
// stay sharded on the sequence. Other mesh axes pass through (a batch Shard<0> on dp stays). Each forward
// returns the context of its backward, which gives the input's gradient in the input's placements
// (Megatron's f and g: the duals of the gather, all_reduce or reduce_scatter) and the weight's and bias's
// gradients, Partial<sum> over the axes that shard the batch (what DDP / FSDP reduce). Weights start from
// the sharding-invariant randn (normal, std 1 / sqrt(in_features)), biases from zeros, so any mesh starts
// from the same numbers as one rank.

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/backward/redistribute.hpp"
#include "dtensor/backward/with_backward.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/init.hpp"
#include "dtensor/nn/module.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/matmul.hpp"
#include "dtensor/ops/pointwise.hpp"
#include "dtensor/ops/random.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

namespace detail {

/// Replicate on every axis of the mesh except `Axis`, which holds Shard<Dim>.
template <class Mesh, int Axis, int Dim>
struct ShardOn {
  static constexpr PlacementList list() {
    PlacementList l(Mesh::rank, Placement::replicate());
    l[Axis] = Placement::shard(Dim);
    return l;
  }
};

/// Replicate on every axis.
template <class Mesh>
struct ReplicatedOn {
  static constexpr PlacementList list() { return PlacementList(Mesh::rank, Placement::replicate()); }
};

/// X's placements with `Axis` replaced: Shard<Dim> (Dim >= 0) or Replicate (Dim < 0).
template <class X, int Axis, int Dim>
struct ReplaceOn {
  static constexpr PlacementList list() {
    PlacementList l = X::placements;
    l[Axis] = Dim >= 0 ? Placement::shard(Dim) : Placement::replicate();
    return l;
  }
};
template <class X, int Axis, int Dim>
using replace_on_t = dtensor_from_t<typename X::value_type, X::rank, typename dtensor_traits<X>::shape_type,
                                    &ReplaceOn<X, Axis, Dim>::list>;

/// A linear layer's weight (out, in) of type W: normal with std 1 / sqrt(in), the same numbers on any mesh.
template <class W, class Mesh>
W linear_weight(const DeviceMesh<Mesh>& mesh, std::int64_t in, std::int64_t out, std::uint64_t seed) {
  return scale(factory_of<W>::randn(mesh, {out, in}, seed), 1.0 / std::sqrt(double(in)));
}

/// A redistribution step of parallel_linear: the tensor brought to its placements with `Axis` replaced by
/// Shard<Dim> (Dim >= 0) or Replicate (Dim < 0), with the backward of that redistribution.
template <int Axis, int Dim>
struct RedistributeOn {
  template <class X>
  static auto run(const X& x) {
    return with_backward_to<replace_on_t<X, Axis, Dim>>::run(x);
  }
};

/// The step of parallel_linear that leaves the tensor as it is (no copy, no communication).
struct NoRedistribute {
  struct PassThrough {
    template <class G>
    const G& operator()(const G& g) const {
      return g;
    }
  };
  template <class X>
  static WithBackward<const X&, PassThrough> run(const X& x) {
    return {x, PassThrough{}};
  }
};

/// The forward both parallel linear layers run: x brought to its placements by `Before`, y = x W^T, y
/// brought to its placements by `After`, out = y + b. The backward runs the duals in reverse and returns
/// nn::Gradients{dx (in X's placements when `Before` moved x), {dW, db}}.
template <class Before, class After, class X, class W, class B>
auto parallel_linear(const X& x, const W& weight, const B& bias) {
  auto [xb, before_back] = Before::run(x);
  auto [y, linear_back] = linear(xb, weight, with_backward);
  auto [ya, after_back] = After::run(y);
  auto [out, bias_back] = add(ya, bias, with_backward);
  auto back = [before_back = std::move(before_back), linear_back = std::move(linear_back),
               after_back = std::move(after_back), bias_back = std::move(bias_back)](const auto& dy) {
    auto [dya, db] = bias_back(dy);
    auto [dxb, dw] = linear_back(after_back(dya));
    if constexpr (std::is_same_v<Before, NoRedistribute>) {
      return nn::Gradients{std::move(dxb), std::tuple{std::move(dw), std::move(db)}};
    } else {
      using G = std::remove_cvref_t<decltype(before_back(dxb))>;
      return nn::Gradients{redistribute_as<X, G>::run(before_back(dxb)),
                           std::tuple{std::move(dw), std::move(db)}};
    }
  };
  return WithBackward<decltype(out), decltype(back)>{std::move(out), std::move(back)};
}

} // namespace detail

namespace nn {

/// y = x W^T + b, W (out, in) sharded on its output features over the tp axis (see the top of this file).
template <class T, class Mesh, fixed_string Tp = "tp", bool SequenceParallel = false, int SeqDim = 0>
class ColumnParallelLinear : public Layer<ColumnParallelLinear<T, Mesh, Tp, SequenceParallel, SeqDim>> {
  static constexpr int tp = Mesh::template index_of<Tp>();

public:
  using weight_type = dtensor_from_t<T, 2, Mesh, &dtensor::detail::ShardOn<Mesh, tp, 0>::list>;
  using bias_type = dtensor_from_t<T, 1, Mesh, &dtensor::detail::ShardOn<Mesh, tp, 0>::list>;
  template <class U>
  using rebind = ColumnParallelLinear<U, Mesh, Tp, SequenceParallel, SeqDim>;

  ColumnParallelLinear(const DeviceMesh<Mesh>& mesh, std::int64_t in, std::int64_t out, std::uint64_t seed)
      : weight(dtensor::detail::linear_weight<weight_type>(mesh, in, out, seed)),
        bias(dtensor::detail::factory_of<bias_type>::zeros(mesh, {out})) {}
  ColumnParallelLinear(weight_type w, bias_type b) : weight(std::move(w)), bias(std::move(b)) {}

  weight_type weight;
  bias_type bias;

  static constexpr auto parameter_members() {
    return std::tuple{&ColumnParallelLinear::weight, &ColumnParallelLinear::bias};
  }
  static constexpr auto state_members() { return std::tuple{}; }

  /// x: Replicate on tp (Shard<SeqDim> with sequence parallelism, gathered on entry). Returns Shard<last>
  /// on tp.
  template <AnyDTensor X>
  auto forward(const X& x) const {
    return forward(x, with_backward).output;
  }

  template <AnyDTensor X>
  auto forward(const X& x, WithBackwardTag) const {
    constexpr Placement on_tp = normalize(placements_of<X>[tp], X::rank);
    constexpr bool wired = SequenceParallel ? on_tp == Placement::shard(SeqDim) : on_tp.is_replicate();
    static_assert(
        wired, "ColumnParallelLinear: the input must be Replicate on the tp axis (Shard<SeqDim> there with "
               "sequence parallelism): redistribute it first, or choose the matching SequenceParallel");
    if constexpr (!wired) { // after that error, x as the layer wants it: no second error
      return forward(
          dtensor::detail::stand_in<dtensor::detail::replace_on_t<X, tp, SequenceParallel ? SeqDim : -1>>(x),
          with_backward);
    } else {
      using Gather =
          dtensor::detail::RedistributeOn<tp, -1>; // to Replicate on tp (a no-op without SequenceParallel)
      return dtensor::detail::parallel_linear<Gather, dtensor::detail::NoRedistribute>(x, weight, bias);
    }
  }
};

/// y = x W^T + b, W (out, in) sharded on its input features over the tp axis: the input is the column
/// layer's output (Shard<last> on tp); the product is Partial on tp until the all_reduce (or, with
/// sequence parallelism, the reduce_scatter to Shard<SeqDim>). The bias is Replicate, added after.
template <class T, class Mesh, fixed_string Tp = "tp", bool SequenceParallel = false, int SeqDim = 0>
class RowParallelLinear : public Layer<RowParallelLinear<T, Mesh, Tp, SequenceParallel, SeqDim>> {
  static constexpr int tp = Mesh::template index_of<Tp>();

public:
  using weight_type = dtensor_from_t<T, 2, Mesh, &dtensor::detail::ShardOn<Mesh, tp, 1>::list>;
  using bias_type = dtensor_from_t<T, 1, Mesh, &dtensor::detail::ReplicatedOn<Mesh>::list>;
  template <class U>
  using rebind = RowParallelLinear<U, Mesh, Tp, SequenceParallel, SeqDim>;

  RowParallelLinear(const DeviceMesh<Mesh>& mesh, std::int64_t in, std::int64_t out, std::uint64_t seed)
      : weight(dtensor::detail::linear_weight<weight_type>(mesh, in, out, seed)),
        bias(dtensor::detail::factory_of<bias_type>::zeros(mesh, {out})) {}
  RowParallelLinear(weight_type w, bias_type b) : weight(std::move(w)), bias(std::move(b)) {}

  weight_type weight;
  bias_type bias;

  static constexpr auto parameter_members() {
    return std::tuple{&RowParallelLinear::weight, &RowParallelLinear::bias};
  }
  static constexpr auto state_members() { return std::tuple{}; }

  /// x: Shard<last> on tp (a ColumnParallelLinear's output). Returns Replicate on tp (Shard<SeqDim> with
  /// sequence parallelism).
  template <AnyDTensor X>
  auto forward(const X& x) const {
    return forward(x, with_backward).output;
  }

  template <AnyDTensor X>
  auto forward(const X& x, WithBackwardTag) const {
    constexpr bool wired = normalize(placements_of<X>[tp], X::rank) == Placement::shard(X::rank - 1);
    static_assert(
        wired, "RowParallelLinear: the input must be Shard<last> on the tp axis, as a ColumnParallelLinear's "
               "output is: wire a column-parallel layer (or redistribute) before it");
    if constexpr (!wired) { // after that error, x as the layer wants it: no second error
      return forward(dtensor::detail::stand_in<dtensor::detail::replace_on_t<X, tp, X::rank - 1>>(x),
                     with_backward);
    } else {
      // all_reduce (reduce_scatter to Shard<SeqDim> with SequenceParallel) on tp
      using Reduce = dtensor::detail::RedistributeOn<tp, SequenceParallel ? SeqDim : -1>;
      return dtensor::detail::parallel_linear<dtensor::detail::NoRedistribute, Reduce>(x, weight, bias);
    }
  }
};

} // namespace nn

} // namespace dtensor
