#pragma once
// Fully sharded data parallel: a group of parameters held as one flat buffer, Shard<0> over the
// data-parallel axis, gathered by one all_gather per group and reduced by one reduce_scatter per group.
//
//   using Mesh = MeshShape<Axis<"dp">>;
//   using Mlp1 = FlatParamGroup<float, Mesh, Fsdp<"dp">, Params<Param<2>, Param<1>>>;   // W1 (h, d), b1 (h)
//   Mlp1 g1(scale(randn<float, Replicate>(mesh, {h, d}, seed, 0), 0.1), zeros<float, Replicate>(mesh, {h}));
//   g1.unshard(async_op);                       // the all_gather is in flight
//   ...                                         // the previous group computes
//   auto [w1, b1] = g1.params();                // waits; DTensors [R], views into the gathered buffer
//   auto y = add(linear(x, w1), b1);            // x [S(0)]: the batch over dp
//   g1.reshard();                               // frees the gathered buffer (once the views are dropped)
//   ...                                         // backward: g1.unshard() again, then the ops' backward
//   g1.reduce_gradients(dw1, db1);              // dW [P(sum)] -> one reduce_scatter of the flat gradient
//   sgd(g1.local_param(), g1.local_grad());     // an optimizer steps this rank's shard (Tensor<T, 1>)
//
// Layouts (the `Layout` argument):
//  - `Fsdp<"dp">`: the flat buffer is Shard<0> over axis "dp" of the mesh.
//  - `Hsdp<"replicate", "shard">`: Shard<0> over "shard", Replicate over "replicate". Unsharding gathers
//    over "shard" only; gradients are reduce_scattered over "shard", then all_reduced over "replicate" (one
//    redistribute [P,P] -> [R,S(0)], planned as reduce_scatter then all_reduce on the smaller data).
//  - FSDP x TP: a mesh with more axes, e.g. (dp, tp). Each parameter names its placements when unsharded,
//    `Param<2, Replicate, Shard<0>>` (Replicate on the FSDP axes, its tensor-parallel placements on the
//    others); the flat buffer of a rank holds the local tensor-parallel blocks of the group's parameters,
//    flattened (a parameter's elements are each on one (dp, tp) rank), and is sharded over dp. `Param<2>`
//    means Replicate on every axis.
//
// The flat layout (train/flat_layout.hpp): parameters in order, each its local block flattened; shards
// follow torch.chunk (chunk = ceil(N/n); the last ranks hold fewer elements or none). No padding: the
// all_gather and reduce_scatter are redistributes of the flat DTensor ([S(0)] -> [R], [P] -> [S(0)]), which
// use the backends' variable-size collectives, as every uneven redistribute does.
//
// Unsharding: `unshard()` (blocking) or `unshard(async_op)` (returns an FsdpWork; the all_gather is in
// flight) gathers the flat buffer; `params()` waits for it if needed and returns the parameters as DTensors
// of their declared placements, views into the gathered buffer (no copy, no per-parameter collective).
// `reshard()` drops the group's hold on the gathered buffer; its memory is released when the views handed out
// are gone too (Tensor is reference counted), so a backward that needs the parameters gathers them again
// (reshard_after_forward) and builds its op contexts from them (`ProductBackward<true, X, W>(x, w)(dy)`).
// Prefetch is the order of calls: issue group i+1's `unshard(async_op)` before group i computes, and call
// `params()` (which waits) only when group i+1's compute starts.
//
// Gradients: `reduce_gradients(grads...)` takes the gradients of the group's parameters as the ops'
// backward gives them: Partial<sum> (each rank's contribution) or Replicate on the FSDP axes, any placements
// the planner can bring to the parameter's on the others (a Partial over tp is all_reduced there first). Each
// one is brought to [P(sum) on the FSDP axes, the parameter's placements elsewhere], converted to the reduce
// type ReduceT (e.g. float for bfloat16 parameters) and packed into one flat buffer, which is
// reduce_scattered over the shard axis (and all_reduced over the replicate axis for Hsdp) in ReduceT: the
// gradient shard lines up with the parameter shard element for element. A Replicate gradient counts once (the
// redistribute R -> P(sum) keeps it on coordinate 0). With `FsdpOptions::reduce_op = ReduceOp::sum` (the
// default) the result is the sum of the contributions: the gradient of the loss the DTensors describe (a mean
// over a dp-sharded batch is a Partial<sum> whose sum is the global mean's gradient), so training equals one
// rank's. With `ReduceOp::avg` the sum is then divided by the number of data-parallel ranks (shard x
// replicate), as torch FSDP does by default for a loss that is each rank's own mean. Gradients accumulate
// into the gradient shard until `zero_grad()`. `reduce_gradients(async_op, grads...)` returns an FsdpWork
// with the reduce_scatter in flight (for Hsdp the all_reduce runs in wait()). Gradient accumulation without
// synchronisation: `accumulate_gradients(grads...)` for the first K - 1 micro-batches adds them to an
// unsharded accumulator (no reduction over the FSDP axes), and the last micro-batch's reduce_gradients
// reduces the sum once (FSDP2's set_requires_gradient_sync(False); FsdpSchedule's of the same name).
//
// Mixed precision (FSDP2's MixedPrecisionPolicy): `FlatParamGroup<float, Mesh, Fsdp<"dp">, Params<...>,
// float, bfloat16>` keeps the parameter shard in float (the master weights: the optimizer steps it, its state
// in float), casts the shard to the compute type bfloat16 before gathering (so the all_gather moves
// bfloat16), and gives params() in bfloat16: the forward and backward compute in it. The gradients come back
// in the compute type and are reduced in ReduceT (float, or bfloat16 to halve the reduce_scatter); the
// gradient shard is in ReduceT, and Optimizer::step(index, group) converts it to float when ReduceT is
// narrower.
//
// A group is a handle: copies share the buffers and the pending operations. Every rank of the mesh makes
// the same calls on its groups in the same order, as for any collective.

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/comm/work.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/distribute.hpp"
#include "dtensor/tensor/dtensor.hpp"
#include "dtensor/train/clip.hpp"
#include "dtensor/train/flat_layout.hpp"

namespace dtensor {

/// FSDP over the mesh axis `ShardAxis`.
template <fixed_string ShardAxis>
struct Fsdp {
  static constexpr auto shard_axis = ShardAxis;
  static constexpr bool hybrid = false; // layouts are told apart by this member, not by partial
                                        // specialization (nvcc 13 fails to deduce class-type template
                                        // arguments there)
};

/// HSDP: sharded over `ShardAxis`, replicated over `ReplicateAxis` (torch's 2-D mesh (replicate, shard)).
template <fixed_string ReplicateAxis, fixed_string ShardAxis>
struct Hsdp {
  static_assert(!(ReplicateAxis == ShardAxis), "Hsdp<replicate, shard>: the two axes must differ");
  static constexpr auto replicate_axis = ReplicateAxis;
  static constexpr auto shard_axis = ShardAxis;
  static constexpr bool hybrid = !(ReplicateAxis == ShardAxis); // else (the error above) as Fsdp: no more
};

/// A parameter of rank `Rank` whose unsharded placements on the mesh are P... (Replicate on the FSDP axes,
/// its tensor-parallel placements on the others). No placements: Replicate on every axis.
template <int Rank, PlacementType... P>
struct Param {};

/// The parameters of one group, in flat-buffer order.
template <class... P>
struct Params {};

/// Options of a FlatParamGroup.
struct FsdpOptions {
  /// How the ranks' gradient contributions combine: sum (the gradient of the loss the DTensors describe)
  /// or avg (the sum divided by the number of data-parallel ranks, torch FSDP's default).
  ReduceOp reduce_op = ReduceOp::sum;
};

/// The handle of an asynchronous unshard or gradient reduction. wait() finishes it (later calls do
/// nothing); a default-constructed FsdpWork is complete.
class FsdpWork {
public:
  FsdpWork() = default;
  FsdpWork(std::function<void()> wait, std::function<bool()> done)
      : wait_(std::move(wait)), done_(std::move(done)) {}

  void wait() const {
    if (wait_) {
      wait_();
    }
  }
  /// Non-blocking: true once the collective in flight finished (or nothing was in flight).
  bool is_completed() const { return !done_ || done_(); }

private:
  std::function<void()> wait_;
  std::function<bool()> done_;
};

namespace detail {

template <class M>
struct mesh_shape_of;
template <class S>
struct mesh_shape_of<DeviceMesh<S>> {
  using type = S;
};

/// The FSDP axes of `Layout` (Fsdp or Hsdp) on `Mesh`, the flat buffer's sub-mesh and its DTensor types.
template <class Layout, class Mesh, bool Hybrid = Layout::hybrid>
struct FsdpAxes;

template <class Layout, class Mesh>
struct FsdpAxes<Layout, Mesh, false> {
  static constexpr int shard = Mesh::template index_of<Layout::shard_axis>();
  static constexpr int replicate = -1;
  static auto flat_mesh(const DeviceMesh<Mesh>& m) { return m.template slice<Layout::shard_axis>(); }
  using FlatShape =
      typename mesh_shape_of<decltype(flat_mesh(std::declval<const DeviceMesh<Mesh>&>()))>::type;
  template <class U>
  using sharded = DTensor<U, 1, FlatShape, Shard<0>>;
  template <class U>
  using gathered = DTensor<U, 1, FlatShape, Replicate>;
  template <class U>
  using partial = DTensor<U, 1, FlatShape, Partial<>>;
};

template <class Layout, class Mesh>
struct FsdpAxes<Layout, Mesh, true> {
  static constexpr int shard = Mesh::template index_of<Layout::shard_axis>();
  static constexpr int replicate = Mesh::template index_of<Layout::replicate_axis>();
  static auto flat_mesh(const DeviceMesh<Mesh>& m) {
    return m.template slice<Layout::replicate_axis, Layout::shard_axis>();
  }
  using FlatShape =
      typename mesh_shape_of<decltype(flat_mesh(std::declval<const DeviceMesh<Mesh>&>()))>::type;
  template <class U>
  using sharded = DTensor<U, 1, FlatShape, Replicate, Shard<0>>;
  template <class U>
  using gathered = DTensor<U, 1, FlatShape, Replicate, Replicate>;
  template <class U>
  using partial = DTensor<U, 1, FlatShape, Partial<>, Partial<>>;
};

template <class T, int Rank, class Shape, class List>
struct dtensor_of_list;
template <class T, int Rank, class Shape, class... Q>
struct dtensor_of_list<T, Rank, Shape, Placements<Q...>> {
  using type = DTensor<T, Rank, Shape, Q...>;
};

template <class T, class Mesh, class P>
struct param_traits;
template <class T, class Mesh, int Rank, class... Q>
struct param_traits<T, Mesh, Param<Rank, Q...>> {
  using list =
      std::conditional_t<sizeof...(Q) == 0, typename AllReplicate<Mesh::rank>::type, Placements<Q...>>;
  using type = typename dtensor_of_list<T, Rank, Mesh, list>::type;
};

/// The unsharded DTensor type of parameter spec P.
template <class T, class Mesh, class P>
using param_t = typename param_traits<T, Mesh, P>::type;

/// A tensor brought to the placements of DTensor type D: run(x) redistributes x, start(x) redistributes it
/// asynchronously, from_full(mesh, full) distributes a full (replicated) local tensor.
template <class D>
struct distribute_as;
template <class U, int R, class S, class... Q>
struct distribute_as<DTensor<U, R, S, Q...>> {
  template <class X>
  static auto run(const X& x) {
    return x.template redistribute<Q...>();
  }
  template <class X>
  static auto start(const X& x) {
    return x.template redistribute<Q...>(async_op);
  }
  static DTensor<U, R, S, Q...> from_full(const DeviceMesh<S>& mesh, const Tensor<U, R>& full) {
    return distribute_tensor<Q...>(mesh, full, replicated_source);
  }
};

constexpr bool has_partial(const PlacementList& p) {
  for (int a = 0; a < p.size(); ++a) {
    if (p[a].is_partial()) {
      return true;
    }
  }
  return false;
}

/// @post true: a failed check is its own static_assert (see ops/typed_rules.hpp).
template <class Axes, class D>
consteval bool check_param() {
  constexpr PlacementList p = D::placements;
  constexpr bool replicated =
      p[Axes::shard].is_replicate() && (Axes::replicate < 0 || p[Axes::replicate].is_replicate());
  static_assert(
      replicated,
      "FlatParamGroup: a parameter's placements describe it unsharded, so they must be Replicate on "
      "the FSDP axes (FSDP shards the group's flat buffer there, not the parameter); put its "
      "tensor-parallel Shard on the other axes, e.g. Param<2, Replicate, Shard<0>> on (dp, tp)");
  constexpr bool no_partial = !has_partial(p);
  static_assert(no_partial, "FlatParamGroup: a parameter cannot be Partial: give its placements on the "
                            "non-FSDP axes as Shard or Replicate");
  return true;
}

/// The placements a gradient of parameter D is brought to before packing: Partial<sum> on the FSDP axes,
/// D's placements on the others.
template <class Axes, class D>
struct GradPackTarget {
  static constexpr PlacementList list() {
    PlacementList t;
    for (int a = 0; a < D::placements.size(); ++a) {
      t.push_back(a == Axes::shard || a == Axes::replicate ? Placement::partial(ReduceOp::sum)
                                                           : D::placements[a]);
    }
    return t;
  }
};

/// @post true: a failed check is its own static_assert (see ops/typed_rules.hpp).
template <class Axes, class G>
consteval bool check_gradient() {
  constexpr PlacementList g = G::placements;
  constexpr auto ok = [](Placement x) { return x.is_replicate() || x == Placement::partial(ReduceOp::sum); };
  constexpr bool fits = ok(g[Axes::shard]) && (Axes::replicate < 0 || ok(g[Axes::replicate]));
  static_assert(fits, "FlatParamGroup::reduce_gradients: a gradient must be Partial<sum> (each rank's "
                      "contribution, as the ops' backward gives it for a parameter used on a dp-sharded "
                      "batch) or Replicate on the FSDP axes");
  return true;
}

} // namespace detail

/// One FSDP group: parameters `Ps...` (Param<Rank, P...>) of element type T on a mesh of shape `Mesh`,
/// sharded as `Layout` (Fsdp<"dp"> or Hsdp<"replicate", "shard">), gradients reduced in `ReduceT`, the
/// parameters gathered and computed in `ComputeT` (mixed precision: see the top of the file).
template <class T, class Mesh, class Layout, class ParamList, class ReduceT = T, class ComputeT = T>
class FlatParamGroup;

template <class T, class Mesh, class Layout, class... Ps, class ReduceT, class ComputeT>
class FlatParamGroup<T, Mesh, Layout, Params<Ps...>, ReduceT, ComputeT> {
  using Axes = detail::FsdpAxes<Layout, Mesh>;
  using FlatShape = typename Axes::FlatShape;
  static constexpr std::size_t N = sizeof...(Ps);
  static_assert(N >= 1, "FlatParamGroup: a group holds at least one parameter");
  static_assert((detail::check_param<Axes, detail::param_t<T, Mesh, Ps>>() && ...));

public:
  using mesh_type = DeviceMesh<Mesh>;
  using value_type = T;
  using reduce_type = ReduceT;
  using compute_type = ComputeT;
  /// The unsharded parameters, as params() returns them.
  using params_type = std::tuple<detail::param_t<ComputeT, Mesh, Ps>...>;
  template <std::size_t I>
  using param_type = std::tuple_element_t<I, params_type>;
  /// Parameter I as the constructor takes it: the master element type T.
  template <std::size_t I>
  using master_param_type = detail::param_t<T, Mesh, std::tuple_element_t<I, std::tuple<Ps...>>>;
  /// This rank's shard of the flat buffer: Shard<0> over the shard axis (Replicate over the replicate one).
  using sharded_type = typename Axes::template sharded<T>;
  /// The shard as it is gathered: in ComputeT.
  using compute_shard_type = typename Axes::template sharded<ComputeT>;
  /// The gathered flat buffer: Replicate over the FSDP axes.
  using gathered_type = typename Axes::template gathered<ComputeT>;
  /// The gradient shard, in the reduce type, laid out as the parameter shard.
  using grad_shard_type = typename Axes::template sharded<ReduceT>;
  static constexpr std::size_t num_params = N;

  /// Shards the given unsharded parameters (e.g. from the sharding-invariant randn, or distribute_tensor of
  /// full tensors): every rank keeps its part of the flat buffer. No communication.
  explicit FlatParamGroup(const detail::param_t<T, Mesh, Ps>&... params)
      : FlatParamGroup(FsdpOptions{}, params...) {}
  explicit FlatParamGroup(FsdpOptions options, const detail::param_t<T, Mesh, Ps>&... params)
      : mesh_(std::get<0>(std::tie(params...)).mesh()), options_(options), globals_(params.global_shape()...),
        layout_(std::vector<std::int64_t>{params.local().numel()...}), state_(std::make_shared<State>()) {
    DTENSOR_CHECK(options.reduce_op == ReduceOp::sum || options.reduce_op == ReduceOp::avg,
                  "FlatParamGroup: FsdpOptions::reduce_op must be ReduceOp::sum or ReduceOp::avg");
    const Device device = std::get<0>(std::tie(params...)).local().device();
    DTENSOR_CHECK(((params.local().device() == device) && ...),
                  "FlatParamGroup: the parameters of one group must be on one device");
    const int n = mesh_.size(Axes::shard);
    const int i = mesh_.coordinate()[Axes::shard];
    const MemoryCategoryScope category(MemoryCategory::parameters);
    Tensor<T, 1> shard({layout_.shard_numel(n, i)}, device);
    const std::vector<FlatPiece> pieces = layout_.pieces(n, i);
    int k = 0;
    (copy_into_shard(shard, pieces, k++, params.local()), ...); // left to right: parameter k
    state_->shard = sharded_type(Axes::flat_mesh(mesh_), std::move(shard), {layout_.total()});
  }

  /// From full tensors, the same on every rank (each keeps its blocks; no communication).
  static FlatParamGroup from_full(const mesh_type& mesh, FsdpOptions options,
                                  const Tensor<T, detail::param_t<T, Mesh, Ps>::rank>&... full) {
    return FlatParamGroup(options,
                          detail::distribute_as<detail::param_t<T, Mesh, Ps>>::from_full(mesh, full)...);
  }
  static FlatParamGroup from_full(const mesh_type& mesh,
                                  const Tensor<T, detail::param_t<T, Mesh, Ps>::rank>&... full) {
    return from_full(mesh, FsdpOptions{}, full...);
  }

  const mesh_type& mesh() const noexcept { return mesh_; }
  const FsdpOptions& options() const noexcept { return options_; }
  /// The identity of the group's shared state: equal for copies of one group (handles), unequal otherwise.
  const void* identity() const noexcept { return state_.get(); }
  /// The parameters' places in the flat buffer.
  const FlatLayout& flat_layout() const noexcept { return layout_; }

  // ---- unshard / reshard -------------------------------------------------------------------------------

  /// Gathers the flat buffer (one all_gather over the shard axis), unless it is gathered or in flight (then
  /// this waits for it).
  void unshard() {
    const MemoryCategoryScope category(MemoryCategory::communication);
    if (!state_->gathered && !state_->pending_unshard) {
      state_->gathered = detail::distribute_as<gathered_type>::run(compute_shard());
    }
    state_->wait_unshard();
  }
  /// Starts the all_gather and returns at once (nothing is issued when the buffer is gathered or in
  /// flight). params() and wait() on the handle wait for it.
  FsdpWork unshard(AsyncOp) {
    const MemoryCategoryScope category(MemoryCategory::communication);
    if (!state_->gathered && !state_->pending_unshard) {
      state_->pending_unshard.emplace(detail::distribute_as<gathered_type>::start(compute_shard()));
    }
    auto s = state_;
    return FsdpWork([s] { s->wait_unshard(); },
                    [s] { return !s->pending_unshard || s->pending_unshard->is_completed(); });
  }
  /// True when the flat buffer is gathered or its all_gather is in flight.
  bool is_unsharded() const noexcept { return state_->gathered || state_->pending_unshard; }

  /// The parameters, unsharded, as DTensors of their declared placements: views into the gathered buffer.
  /// Waits for an all_gather in flight; throws when the group is not unsharded.
  params_type params() { return view_params(gathered_local(), std::make_index_sequence<N>{}); }
  /// Parameter I, unsharded (see params()).
  template <std::size_t I>
  param_type<I> param() {
    return view_param<I>(gathered_local());
  }

  /// Drops the gathered buffer (after its all_gather, if one is in flight, finished). The memory is freed
  /// when no view from params() holds it any more.
  void reshard() {
    state_->wait_unshard();
    state_->gathered.reset();
  }

  // ---- gradients -----------------------------------------------------------------------------------------

  /// Reduces the gradients of the group's parameters (in order) into the gradient shard (see the top of
  /// this file): one reduce_scatter of one flat buffer in ReduceT (plus one all_reduce for Hsdp).
  template <AnyDTensor... G>
  void reduce_gradients(const G&... grads) {
    reduce_gradients(async_op, grads...).wait();
  }
  /// As above, returning with the reduce_scatter in flight; local_grad() and wait() on the handle finish
  /// it. A reduction still in flight from an earlier call is finished first.
  template <AnyDTensor... G>
  FsdpWork reduce_gradients(AsyncOp, const G&... grads) {
    static_assert(sizeof...(G) == N, "FlatParamGroup::reduce_gradients: pass one gradient per parameter, "
                                     "in the group's order");
    state_->wait_gradients();
    const MemoryCategoryScope category(MemoryCategory::communication);
    Tensor<ReduceT, 1> flat({layout_.total()}, state_->shard->local().device());
    pack_gradients(flat, std::make_index_sequence<N>{}, grads...);
    if (state_->unsynced) { // the micro-batches accumulated without synchronisation
      local::map_into(flat, local::Add{}, flat, *state_->unsynced);
      state_->unsynced.reset();
    }
    using FlatPartial = typename Axes::template partial<ReduceT>;
    const FlatPartial p(Axes::flat_mesh(mesh_), std::move(flat), {layout_.total()});
    state_->pending_grad.emplace(detail::distribute_as<grad_shard_type>::start(p));
    state_->grad_scale = options_.reduce_op == ReduceOp::avg ? 1.0 / data_parallel_size() : 1.0;
    auto s = state_;
    return FsdpWork([s] { s->wait_gradients(); },
                    [s] { return !s->pending_grad || s->pending_grad->is_completed(); });
  }
  /// Gradient accumulation without synchronisation (FSDP2's set_requires_gradient_sync(false), DDP's
  /// no_sync): adds the gradients, brought to the placements reduce_gradients packs (a Partial over a
  /// non-FSDP axis is all-reduced there), to an unsharded flat accumulator in ReduceT, with no
  /// communication over the FSDP axes. The next reduce_gradients adds the accumulator to its own gradients
  /// before its one reduce_scatter, and empties it: K micro-batches cost one reduction. Memory: one
  /// unsharded flat gradient (unsynced_numel()) until then.
  template <AnyDTensor... G>
  void accumulate_gradients(const G&... grads) {
    static_assert(sizeof...(G) == N, "FlatParamGroup::accumulate_gradients: pass one gradient per parameter, "
                                     "in the group's order");
    const MemoryCategoryScope category(MemoryCategory::gradients);
    Tensor<ReduceT, 1> flat({layout_.total()}, state_->shard->local().device());
    pack_gradients(flat, std::make_index_sequence<N>{}, grads...);
    if (!state_->unsynced) {
      state_->unsynced.emplace(std::move(flat));
    } else {
      local::map_into(*state_->unsynced, local::Add{}, *state_->unsynced, flat);
    }
  }
  /// Elements of the unsynchronised accumulator (0 when there is none).
  std::int64_t unsynced_numel() const noexcept { return state_->unsynced ? state_->unsynced->numel() : 0; }

  /// Forgets the accumulated gradient shard (after finishing a reduction in flight) and the unsynchronised
  /// accumulator.
  void zero_grad() {
    state_->wait_gradients();
    state_->grad.reset();
    state_->unsynced.reset();
  }

  // ---- the local shards, for an optimizer ----------------------------------------------------------------

  /// This rank's shard of the flat parameter buffer (its memory: an optimizer updates it in place).
  Tensor<T, 1> local_param() const { return state_->shard->local(); }
  /// This rank's gradient shard, element for element with local_param() (zeros before any reduction).
  /// Finishes a reduction in flight.
  Tensor<ReduceT, 1> local_grad() const { return grad().local(); }
  /// The parameter shard as a DTensor of the flat buffer.
  const sharded_type& sharded_param() const { return *state_->shard; }
  /// The gradient shard as a DTensor of the flat buffer (zeros before any reduction).
  const grad_shard_type& grad() const {
    state_->wait_gradients();
    if (!state_->grad) {
      const MemoryCategoryScope category(MemoryCategory::gradients);
      state_->grad = grad_shard_type(
          Axes::flat_mesh(mesh_), Tensor<ReduceT, 1>::zeros({local_param().numel()}, local_param().device()),
          {layout_.total()});
    }
    return *state_->grad;
  }

  // ---- the gradients' norm (total_norm and clip_grad_norm take groups, train/clip.hpp)
  // ------------------

  /// The mesh axes where the gradient shards of the group's ranks hold different elements: the shard axis,
  /// and every axis where some parameter is Shard (tensor parallel).
  static constexpr AxisMask grad_norm_axes() {
    AxisMask m = axis_bit(Axes::shard);
    ((m |= detail::shard_axes(detail::param_t<T, Mesh, Ps>::placements)), ...);
    return m;
  }
  /// This rank's share of the gradients' norm: the sum of |x|^p (the largest |x| for the inf norm) over
  /// its gradient shard, where a parameter's piece counts only on coordinate 0 of each axis in
  /// `group_axes` on which that parameter is not Shard (its other coordinates hold the same values), the
  /// shard axis excepted (its ranks hold disjoint pieces). Finishes a reduction in flight.
  double local_grad_norm_sum(NormType type, AxisMask group_axes) const {
    static constexpr std::array<AxisMask, N> sharded{
        detail::shard_axes(detail::param_t<T, Mesh, Ps>::placements)...};
    const Tensor<ReduceT, 1> g = local_grad();
    const auto& c = mesh_.coordinate();
    AxisMask off_zero = 0; // axes of the group, the shard axis excepted, where this rank is not at 0
    for (int a = 0; a < Mesh::rank; ++a) {
      if ((group_axes & axis_bit(a)) && a != Axes::shard && c[a] != 0) {
        off_zero |= axis_bit(a);
      }
    }
    double acc = 0;
    for (const FlatPiece& piece : layout_.pieces(mesh_.size(Axes::shard), c[Axes::shard])) {
      // a replica of the piece lives at coordinate 0 of each axis where its parameter is not sharded
      if (type.is_inf() || (off_zero & ~sharded[static_cast<std::size_t>(piece.param)]) == 0) {
        acc = detail::combine_norm(type, acc,
                                   dtensor::local_norm_sum(g.narrow(0, piece.shard_at, piece.numel), type));
      }
    }
    return acc;
  }

  /// Multiplies the gradient shard by `coef` in place (clip_grads_with_norm).
  void scale_grad(double coef) const { local::scale(local_grad(), coef); }

  // ---- state laid out like the parameter shard (checkpoints) ---------------------------------------------

  /// A flat shard laid out like this rank's parameter shard (the master parameters, local_param(), or an
  /// optimizer's state for the group: exp_avg), gathered over the FSDP axes (one all_gather) and cut into the
  /// group's parameters: DTensors of their unsharded placements, in element type S. What a checkpoint
  /// saves, so that it loads onto any layout.
  template <class S>
  std::tuple<detail::param_t<S, Mesh, Ps>...> unflatten_shard(const Tensor<S, 1>& shard) const {
    DTENSOR_CHECK(shard.numel() == sharded_numel(), "FlatParamGroup::unflatten_shard: a shard of " +
                                                        std::to_string(shard.numel()) +
                                                        " elements where the "
                                                        "group's has " +
                                                        std::to_string(sharded_numel()));
    using Sharded = typename Axes::template sharded<S>;
    using Gathered = typename Axes::template gathered<S>;
    const Gathered full =
        detail::distribute_as<Gathered>::run(Sharded(Axes::flat_mesh(mesh_), shard, {layout_.total()}));
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::tuple<detail::param_t<S, Mesh, Ps>...>(view_param<I, S>(full.local())...);
    }
    (std::make_index_sequence<N>{});
  }
  /// Parameter I's global shape.
  template <std::size_t I>
  const auto& global_shape() const noexcept {
    return std::get<I>(globals_);
  }
  /// The reverse: this rank's flat shard of the given unsharded parameters (or state of their shapes), as
  /// the constructor shards the parameters. No communication.
  template <class S, class... D>
  Tensor<S, 1> flatten_to_shard(const D&... params) const {
    static_assert(sizeof...(D) == N, "FlatParamGroup::flatten_to_shard: one tensor per parameter, in order");
    static_assert(
        (std::is_same_v<D, detail::param_t<S, Mesh, Ps>> && ...),
        "FlatParamGroup::flatten_to_shard: each tensor must have its parameter's unsharded placements "
        "and the element type S");
    const int n = mesh_.size(Axes::shard);
    const int i = mesh_.coordinate()[Axes::shard];
    Tensor<S, 1> shard({layout_.shard_numel(n, i)}, state_->shard->local().device());
    const std::vector<FlatPiece> pieces = layout_.pieces(n, i);
    int k = 0;
    (copy_into_shard(shard, pieces, k++, params.local()), ...);
    return shard;
  }

  // ---- memory --------------------------------------------------------------------------------------------

  /// Elements of the parameter shard this rank holds: about 1/n of unsharded_numel().
  std::int64_t sharded_numel() const noexcept { return state_->shard->local().numel(); }
  /// Elements of the gathered buffer (the group's parameters' local tensor-parallel blocks).
  std::int64_t unsharded_numel() const noexcept { return layout_.total(); }
  /// Elements the group holds now: the shard, plus the gathered buffer while unsharded.
  std::int64_t held_numel() const noexcept {
    return sharded_numel() + (is_unsharded() ? unsharded_numel() : 0);
  }
  /// Data-parallel ranks the gradients are reduced over (shard x replicate axis sizes).
  int data_parallel_size() const noexcept {
    return mesh_.size(Axes::shard) * (Axes::replicate >= 0 ? mesh_.size(Axes::replicate) : 1);
  }

private:
  using PendingGather =
      decltype(detail::distribute_as<gathered_type>::start(std::declval<const compute_shard_type&>()));
  using PendingGrad = decltype(detail::distribute_as<grad_shard_type>::start(
      std::declval<const typename Axes::template partial<ReduceT>&>()));

  /// What copies of a group share: the buffers and the operations in flight.
  struct State {
    std::optional<sharded_type> shard;
    std::optional<gathered_type> gathered;
    std::optional<PendingGather> pending_unshard;
    std::optional<grad_shard_type> grad;
    std::optional<PendingGrad> pending_grad;
    std::optional<Tensor<ReduceT, 1>> unsynced; ///< accumulate_gradients' unsharded sum
    double grad_scale = 1.0;

    void wait_unshard() {
      if (pending_unshard) {
        gathered.emplace(pending_unshard->wait());
        pending_unshard.reset();
      }
    }
    void wait_gradients() {
      if (!pending_grad) {
        return;
      }
      grad_shard_type g = pending_grad->wait();
      pending_grad.reset();
      if (grad_scale != 1.0) {
        local::scale(g.local(), grad_scale);
      }
      if (!grad) {
        set_memory_category(g, MemoryCategory::gradients); // the reduce_scatter's output, kept
        grad.emplace(std::move(g));
      } else {
        local::map_into(grad->local(), local::Add{}, grad->local(), g.local());
      }
    }
  };

  template <class S, class L>
  void copy_into_shard(const Tensor<S, 1>& shard, const std::vector<FlatPiece>& pieces, int param,
                       const L& local) const {
    const Tensor<S, 1> flat = local.contiguous().template view<1>({local.numel()});
    for (const FlatPiece& p : pieces) {
      if (p.param == param) {
        local::copy(shard.narrow(0, p.shard_at, p.numel), flat.narrow(0, p.param_at, p.numel));
      }
    }
  }

  /// The parameter shard in ComputeT: the shard itself, or its conversion (cast on gather: the all_gather
  /// moves ComputeT).
  compute_shard_type compute_shard() const {
    if constexpr (std::is_same_v<T, ComputeT>) {
      return *state_->shard;
    } else {
      const Tensor<T, 1>& master = state_->shard->local();
      Tensor<ComputeT, 1> c({master.numel()}, master.device());
      local::convert(c, master);
      return compute_shard_type(Axes::flat_mesh(mesh_), std::move(c), {layout_.total()});
    }
  }

  const Tensor<ComputeT, 1>& gathered_local() {
    state_->wait_unshard();
    DTENSOR_CHECK(
        state_->gathered.has_value(),
        "FlatParamGroup::params: the group is sharded; call unshard() (or unshard(async_op)) first");
    return state_->gathered->local();
  }

  template <std::size_t I, class S = ComputeT>
  detail::param_t<S, Mesh, std::tuple_element_t<I, std::tuple<Ps...>>>
  view_param(const Tensor<S, 1>& full) const {
    using D = detail::param_t<S, Mesh, std::tuple_element_t<I, std::tuple<Ps...>>>;
    const auto& global = std::get<I>(globals_);
    const Block b = spec_block(detail::to_extents(global), D::spec, mesh_.sizes(), mesh_.coordinate());
    const auto shape = detail::to_array<D::rank>(b.shape);
    const auto piece =
        full.narrow(0, layout_.offset(static_cast<int>(I)), layout_.numel(static_cast<int>(I)));
    return D(mesh_, piece.template view<D::rank>(shape), global);
  }

  template <std::size_t... I>
  params_type view_params(const Tensor<ComputeT, 1>& full, std::index_sequence<I...>) const {
    return params_type(view_param<I>(full)...);
  }

  template <std::size_t... I, class... G>
  void pack_gradients(const Tensor<ReduceT, 1>& flat, std::index_sequence<I...>, const G&... grads) const {
    (pack_gradient<I>(flat, grads), ...);
  }

  template <std::size_t I, class G>
  void pack_gradient(const Tensor<ReduceT, 1>& flat, const G& grad) const {
    using D = param_type<I>;
    static_assert(
        std::is_same_v<typename G::value_type, ComputeT> && G::rank == D::rank,
        "FlatParamGroup::reduce_gradients: a gradient must have its parameter's element type (the compute "
        "type, as params() gives them) and rank");
    static_assert(std::is_same_v<typename detail::dtensor_traits<G>::shape_type, Mesh>,
                  "FlatParamGroup::reduce_gradients: a gradient must live on the group's mesh");
    static_assert(detail::check_gradient<Axes, G>());
    DTENSOR_CHECK(grad.global_shape() == std::get<I>(globals_),
                  "FlatParamGroup::reduce_gradients: gradient " + std::to_string(I) + " has global shape " +
                      detail::shape_string(detail::to_extents(grad.global_shape())) + ", its parameter " +
                      detail::shape_string(detail::to_extents(std::get<I>(globals_))));
    using Target = dtensor_from_t<ComputeT, D::rank, Mesh, &detail::GradPackTarget<Axes, D>::list>;
    const Target g = detail::distribute_as<Target>::run(grad);
    const std::int64_t n = layout_.numel(static_cast<int>(I));
    DTENSOR_CHECK(g.local().numel() == n, "FlatParamGroup::reduce_gradients: gradient " + std::to_string(I) +
                                              " has a local block of " + std::to_string(g.local().numel()) +
                                              " elements where its parameter's has " + std::to_string(n));
    local::convert(flat.narrow(0, layout_.offset(static_cast<int>(I)), n),
                   g.local().contiguous().template view<1>({n}));
  }

  mesh_type mesh_;
  FsdpOptions options_;
  std::tuple<typename detail::param_t<T, Mesh, Ps>::shape_type...> globals_;
  FlatLayout layout_;
  std::shared_ptr<State> state_;
};

namespace nn {

namespace detail {
template <class D>
struct param_of;
template <class T, int R, class Shape, class... Q>
struct param_of<DTensor<T, R, Shape, Q...>> {
  using type = Param<R, Q...>;
};
template <class Tuple>
struct params_of_tuple;
template <class... W>
struct params_of_tuple<std::tuple<W...>> {
  using type = Params<typename param_of<W>::type...>;
};
} // namespace detail

/// The FlatParamGroup spec (Params<Param<...>...>) of a layer's parameters, in the layer's order:
/// `FlatParamGroup<float, Mesh, Fsdp<"dp">, nn::params_of<Block>>`.
template <class Layer>
using params_of = typename detail::params_of_tuple<parameter_types_t<Layer>>::type;
/// The spec of one group holding several layers' parameters, the layers in order (a final norm and the head).
template <class... Layers>
using params_of_layers = typename detail::params_of_tuple<decltype(std::tuple_cat(
    std::declval<parameter_types_t<Layers>>()...))>::type;

} // namespace nn

} // namespace dtensor
