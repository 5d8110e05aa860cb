#pragma once
// DTensor: a global tensor laid out on a DeviceMesh, its placements part of its type.
//
//   using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
//   auto mesh = init_device_mesh<Mesh>(world);
//   auto x = distribute_tensor<Shard<0>, Replicate>(mesh, full);            // [S(0),R]
//   auto y = x.redistribute<Replicate, Shard<1>>();   // local_chunk(tp, dim 1); all_gather(dp, dim 0)
//   Tensor<float, 2> z = y.full_tensor();
//
// The plan of every redistribute is computed at compile time from the placement values
// (plan/planner.hpp) and run by one non-template executor (exec/execute.hpp): this class is a typed shell
// that erases the element type and rank (AnyTensor) and calls it. Where the plan depends on the size of a
// dynamic mesh axis (whether an all_reduce goes before or after the Shard/Replicate changes), both plans
// are computed at compile time and the real sizes pick one. Transitions that cannot exist (Shard ->
// Partial, Partial<a> -> Partial<b>) do not compile. Local tensors are contiguous; uneven and empty
// shards follow torch.chunk.

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/comm/work.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/exec/blocks.hpp"
#include "dtensor/exec/execute.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/placement_check.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/planner.hpp"

namespace dtensor {

/// A typed placement list, for naming plans: `plan_of<Mesh, 2, Placements<Shard<0>, Replicate>, ...>()`.
template <PlacementType... P>
struct Placements {
  static constexpr PlacementList value = placement_list_v<P...>;

  /// validate_placements for this list.
  template <class Shape, int Rank>
  static consteval bool validate() {
    return validate_placements<Shape, Rank, P...>();
  }
};

/// A plan together with the axis names of its mesh, for printing and costing.
template <class Shape>
struct MeshPlan {
  Plan plan;

  /// e.g. "[S(0),R] -> [R,S(1)]: local_chunk(tp, dim 1); all_gather(dp, dim 0)".
  std::string to_string() const { return dtensor::to_string(plan, Shape::names); }
  /// Bytes per rank (see plan/cost.hpp) for a global shape on a mesh of `sizes`.
  constexpr std::int64_t bytes_per_rank(const Extents& global, const MeshSizes& sizes,
                                        std::int64_t element_size = 4) const {
    return dtensor::bytes_per_rank(plan, global, sizes, element_size);
  }
};

namespace detail {

/// Mesh sizes the planner uses to place all_reduce: the static ones, 2 for dynamic axes.
template <class Shape>
constexpr MeshSizes nominal_sizes() {
  MeshSizes s;
  for (int v : Shape::static_sizes) {
    s.push_back(v > 0 ? v : 2);
  }
  return s;
}

template <class Shape, int Rank, class Src, class Dst>
inline constexpr Plan plan_v = make_plan(Src::value, Dst::value, Rank, nominal_sizes<Shape>());

/// make_plan of one transition for each mesh sizes it meets, made on first use and kept. The sizes met last
/// are read without a lock (a redistribute's host path); other sizes take the lock. One class for every
/// transition, so a DTensor's redistribute adds one static object per transition, not code.
class PlansBySizes {
public:
  PlansBySizes(const PlacementList& src, const PlacementList& dst, int rank)
      : src_(src), dst_(dst), rank_(rank) {}

  const Plan& get(const MeshSizes& sizes) const {
    const Made* last = last_.load(std::memory_order_acquire);
    if (last != nullptr && last->sizes == sizes) {
      return last->plan;
    }
    return find_or_add(sizes);
  }

private:
  struct Made {
    MeshSizes sizes;
    Plan plan;
  };

  /// Other sizes than the last (cold: compiled for size, so the planner's run-time code costs a TU little).
  DTENSOR_COLD const Plan& find_or_add(const MeshSizes& sizes) const {
    std::lock_guard lock(mutex_);
    const Made* found = nullptr;
    for (const auto& m : made_) {
      found = m->sizes == sizes ? m.get() : found;
    }
    if (found == nullptr) {
      made_.push_back(std::make_unique<const Made>(Made{sizes, make_plan(src_, dst_, rank_, sizes)}));
      found = made_.back().get();
    }
    last_.store(found, std::memory_order_release);
    return found->plan;
  }

  PlacementList src_;
  PlacementList dst_;
  int rank_;
  mutable std::atomic<const Made*> last_{nullptr};
  mutable std::mutex mutex_;
  mutable std::vector<std::unique_ptr<const Made>> made_; // never shrinks: references stay valid
};

/// Whether a step of `plan` runs over an axis whose size in `sizes` is 1 (make_plan plans none where it
/// knows the size).
inline bool runs_over_unit_axis(const Plan& plan, const MeshSizes& sizes) {
  AxisMask unit = 0;
  for (int a = 0; a < sizes.size(); ++a) {
    unit |= sizes[a] == 1 ? axis_bit(a) : AxisMask{0};
  }
  for (const Step& st : plan.steps) {
    if ((st.axes & unit) != 0) {
      return true;
    }
  }
  return false;
}

/// The plan Src -> Dst for a mesh of `sizes`: fixed at compile time, or, where the size of a dynamic axis
/// may change it (Plan::sizes_decide, or a dynamic axis of size 1 that a step runs over: make_plan then
/// plans without it), make_plan for the real sizes (PlansBySizes).
template <class Shape, int Rank, class Src, class Dst>
const Plan& select_plan(const MeshSizes& sizes) {
  constexpr const Plan& plan = plan_v<Shape, Rank, Src, Dst>;
  if constexpr (Shape::is_static) {
    return plan;
  } else {
    if (!plan.sizes_decide && !runs_over_unit_axis(plan, sizes)) {
      return plan;
    }
    static const PlansBySizes plans(Src::value, Dst::value, Rank);
    return plans.get(sizes);
  }
}

/// The transition checks of Src -> Dst (invalid lists are validate_placements' to report).
/// @post true: a failed check is its own static_assert (see validate_placements).
template <class Shape, int Rank, class Src, class Dst>
consteval bool check_plan() {
  constexpr PlanError e = plan_v<Shape, Rank, Src, Dst>.error;
  static_assert(e != PlanError::shard_to_partial,
                "redistribute: Shard -> Partial is not a transition: a shard is a piece of the tensor, not a "
                "partial value of all of it. Redistribute to Replicate first, then to Partial");
  static_assert(e != PlanError::partial_op_change,
                "redistribute: Partial<a> -> Partial<b> with a different op is not a transition: reduce the "
                "pending op first (redistribute that axis to Replicate or Shard)");
  return true;
}

/// Placements<Replicate, ..., Replicate> (N of them), built by recursion: nvcc 13's front end drops the
/// pack from an alias like `template <size_t> using R = Replicate; R<I>...`.
template <std::size_t N, class... Acc>
struct AllReplicate : AllReplicate<N - 1, Replicate, Acc...> {};
template <class... Acc>
struct AllReplicate<0, Acc...> {
  using type = Placements<Acc...>;
};

} // namespace detail

/// The plan `Src -> Dst` (both Placements<...>) for a rank-`Rank` tensor on meshes of shape `Shape`.
template <class Shape, int Rank, class Src, class Dst>
constexpr MeshPlan<Shape> plan_of() {
  static_assert(Src::template validate<Shape, Rank>() && Dst::template validate<Shape, Rank>());
  static_assert(detail::check_plan<Shape, Rank, Src, Dst>());
  return {detail::plan_v<Shape, Rank, Src, Dst>};
}

/// Options of DTensor::from_local.
struct FromLocalOptions {
  /// Check across the mesh (one small all_gather) that every rank passed the same global shape and a
  /// local tensor of the shape torch.chunk gives its coordinate; throw naming the offending rank.
  bool verify = false;
};

template <class T, int Rank, class Shape, class... P>
class DTensor;

template <class T, int Rank, class Shape, class... P>
class PendingRedistribute;

namespace detail {

/// Whether one of the placements P is Partial<band/bor/bxor> (false for a list validate_placements refuses).
template <class... P>
consteval bool has_bitwise_partial() {
  if constexpr ((PlacementType<P> && ...)) {
    return ((P::value.is_partial() && is_bitwise(P::value.op)) || ...);
  } else {
    return false;
  }
}

} // namespace detail

template <class T, int Rank, class Shape, class... P>
class DTensor {
  static_assert(validate_placements<Shape, Rank, P...>());
  static_assert(
      std::is_integral_v<T> || !detail::has_bitwise_partial<P...>(),
      "DTensor: Partial<band>, Partial<bor> and Partial<bxor> are bitwise and need an integer element "
      "type (int32, int64, uint8); a floating tensor has no bitwise reduction");

public:
  using value_type = T;
  using mesh_type = DeviceMesh<Shape>;
  using local_type = Tensor<T, Rank>;
  using shape_type = std::array<std::int64_t, Rank>;
  static constexpr int rank = Rank;
  /// The placements, Shard dims made non-negative.
  static constexpr PlacementList placements = normalize(placement_list_v<P...>, Rank);
  static constexpr ShardSpec spec = ShardSpec::from(placement_list_v<P...>, Rank);

  /// Wraps this rank's shard. `global_shape` may be left out for even sharding (it is then the local
  /// shape times the number of shards of each dim); it is required when shards are uneven (left out
  /// there, the ranks infer different global shapes, and the first collective fails on every rank with an
  /// error listing what each member passed).
  static DTensor from_local(const mesh_type& mesh, local_type local,
                            std::optional<shape_type> global_shape = {}, FromLocalOptions options = {}) {
    const shape_type global = global_shape ? *global_shape : infer_global(mesh, local.shape());
    exec::verify_layout(mesh, detail::to_extents(local.shape()), detail::to_extents(global), spec, placements,
                        sizeof(T), local.device(), options.verify);
    return DTensor(mesh, local.contiguous(), global);
  }

  const mesh_type& mesh() const noexcept { return mesh_; }
  /// This rank's shard (contiguous).
  const local_type& local() const noexcept { return local_; }
  local_type to_local() const { return local_; }
  const shape_type& global_shape() const noexcept { return global_; }
  /// Global index of this rank's first local element.
  shape_type local_offset() const {
    return detail::to_array<Rank>(
        spec_block(detail::to_extents(global_), spec, mesh_.sizes(), mesh_.coordinate()).offset);
  }

  /// The whole tensor on every rank (Partial axes reduced).
  local_type full_tensor() const { return local_of(typename detail::AllReplicate<sizeof...(P)>::type{}); }

  /// The same global tensor with placements Q...; the plan is fixed at compile time.
  template <class... Q>
  DTensor<T, Rank, Shape, Q...> redistribute() const& {
    return DTensor(*this).template redistribute<Q...>();
  }

  /// As above, consuming this DTensor: a step that can work in place (an all_reduce, Partial -> Replicate)
  /// reuses its memory when nothing else holds it, e.g. `x.redistribute<Partial<>>().redistribute<R>()`.
  template <class... Q>
  DTensor<T, Rank, Shape, Q...> redistribute() && {
    const Plan& plan = plan_to_run<Q...>();
    AnyTensor out =
        exec::run_steps(plan, 0, AnyTensor(std::move(local_)), detail::to_extents(global_), mesh_);
    return DTensor<T, Rank, Shape, Q...>(mesh_, std::move(out).template as<T, Rank>(), global_);
  }

  /// Asynchronous redistribute: the first communicating step is in flight when this returns; wait() on
  /// the handle finishes it (and runs any later steps) and gives the DTensor. Every rank must make the
  /// same calls on the mesh's groups in the same order, as for any collective.
  template <class... Q>
  PendingRedistribute<T, Rank, Shape, Q...> redistribute(AsyncOp) const {
    const Plan& plan = plan_to_run<Q...>();
    const Extents global = detail::to_extents(global_);
    return PendingRedistribute<T, Rank, Shape, Q...>(
        mesh_, global_, &plan, exec::start_steps(plan, AnyTensor(local_), global, mesh_));
  }

  /// The same result as redistribute<Q...>() through the always-exact fallback: one point-to-point
  /// exchange of block intersections over the whole mesh (no Partial changes). For cross-checking plans.
  template <class... Q>
  DTensor<T, Rank, Shape, Q...> redistribute_by_exchange() const {
    static_assert(validate_placements<Shape, Rank, Q...>());
    static constexpr Plan plan = make_exchange_plan(placement_list_v<P...>, placement_list_v<Q...>, Rank);
    static_assert(
        plan.error == PlanError::none,
        "redistribute_by_exchange: only Shard/Replicate changes (Partial axes must stay as they are)");
    AnyTensor out = exec::run_steps(plan, 0, AnyTensor(local_), detail::to_extents(global_), mesh_);
    return DTensor<T, Rank, Shape, Q...>(mesh_, std::move(out).template as<T, Rank>(), global_);
  }

  /// The plan of redistribute<Q...>() with the mesh sizes known at compile time (2 for dynamic axes).
  template <class... Q>
  static constexpr MeshPlan<Shape> plan_to() {
    return plan_of<Shape, Rank, Placements<P...>, Placements<Q...>>();
  }
  /// The plan redistribute<Q...>() runs on this tensor's mesh.
  template <class... Q>
  MeshPlan<Shape> plan_for() const {
    return {plan_to_run<Q...>()};
  }

  /// "DTensor<float32, 2> on (dp=2, tp=2) [S(0),R], global (8, 6), local (4, 6)".
  std::string to_string() const {
    return "DTensor<" + std::string(dtype_name(dtype_v<T>)) + ", " + std::to_string(Rank) + "> on " +
           mesh_to_string(Shape::names, mesh_.sizes()) + " " + dtensor::to_string(placements) + ", global " +
           detail::shape_string(detail::to_extents(global_)) + ", local " +
           detail::shape_string(detail::to_extents(local_.shape()));
  }
  /// "DTensor<float32, 2, (dp=?, tp=2), [S(0),R]>".
  static std::string type_string() {
    return "DTensor<" + std::string(dtype_name(dtype_v<T>)) + ", " + std::to_string(Rank) + ", " +
           Shape::to_string() + ", " + dtensor::to_string(placements) + ">";
  }

  /// Unchecked: `local` must be this rank's contiguous shard of `global`. Use from_local.
  DTensor(mesh_type mesh, local_type local, shape_type global)
      : mesh_(std::move(mesh)), local_(std::move(local)), global_(global) {}

private:
  template <class... Q>
  const Plan& plan_to_run() const {
    static_assert(validate_placements<Shape, Rank, Q...>());
    if constexpr (!(PlacementType<Q> && ...)) {
      throw Error("unreachable"); // validate_placements said why: nothing more to compile
    } else {
      static_assert(detail::check_plan<Shape, Rank, Placements<P...>, Placements<Q...>>());
      return detail::select_plan<Shape, Rank, Placements<P...>, Placements<Q...>>(mesh_.sizes());
    }
  }

  template <class... Q>
  local_type local_of(Placements<Q...>) const {
    return redistribute<Q...>().local();
  }

  /// The local shape times the number of shards of each dim (exact for even shards only).
  static shape_type infer_global(const mesh_type& mesh, const shape_type& local) {
    shape_type g = local;
    for (int a = 0; a < placements.size(); ++a) {
      if (placements[a].is_shard()) {
        DTENSOR_CHECK(detail::checked_mul(g[placements[a].dim], mesh.size(a), g[placements[a].dim]),
                      "DTensor::from_local on mesh rank " + std::to_string(mesh.rank()) +
                          ": the local shape " + detail::shape_string(detail::to_extents(local)) + " under " +
                          dtensor::to_string(placements) +
                          " gives a global size that does not fit in int64; pass the global shape");
      }
    }
    return g;
  }

  mesh_type mesh_;
  local_type local_;
  shape_type global_;
};

/// The result of an asynchronous redistribute: wait() finishes it and returns the DTensor.
template <class T, int Rank, class Shape, class... P>
class PendingRedistribute {
public:
  using result_type = DTensor<T, Rank, Shape, P...>;

  PendingRedistribute(DeviceMesh<Shape> mesh, std::array<std::int64_t, Rank> global, const Plan* plan,
                      exec::Started started)
      : mesh_(std::move(mesh)), global_(global), plan_(plan), started_(std::move(started)) {}

  /// Non-blocking: true once the step in flight finished (later steps, if any, run in wait()).
  bool is_completed() const { return started_.run.work.is_completed(); }

  /// Waits for the step in flight, runs the remaining steps, and returns the redistributed tensor.
  result_type wait() {
    AnyTensor local = exec::finish_steps(*plan_, std::move(started_), detail::to_extents(global_), mesh_);
    return result_type(mesh_, std::move(local).template as<T, Rank>(), global_);
  }

private:
  DeviceMesh<Shape> mesh_;
  std::array<std::int64_t, Rank> global_;
  const Plan* plan_;
  exec::Started started_;
};

} // namespace dtensor
