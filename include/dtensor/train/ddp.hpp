#pragma once
// Data parallelism (torch's DistributedDataParallel reducer) on one mesh axis: parameters replicated over
// it, each rank's gradient of its own part of the batch all-reduced in buckets while the backward still
// runs, averaged over the axis. On a (dp, tp) mesh it reduces over dp and leaves tp as it is, so it
// composes with tensor parallelism.
//
//   auto reducer = ddp_reducer<"dp">({.bucket_cap_bytes = 25 << 20}, w1, b1, w2);  // parameters 0, 1, 2
//   ... forward; backward in reverse, handing each gradient over as soon as it is produced:
//   auto [da, dw2] = mm2_back(dy);                // dw2 [P(sum) over dp, S(0) over tp]
//   auto gw2 = reducer.ready(2, dw2);             // gw2 [R, S(0)]: filled by finish()
//   ...
//   reducer.finish();                             // waits for every bucket; gw2 holds the reduced value
//   opt.step(2, w2, gw2);
//
// The typing: a gradient of a parameter replicated over dp, computed from a dp-sharded batch, is Partial
// over dp (the ops' backward gives Partial<sum>); ready() takes only such a gradient and returns the same
// DTensor type with dp made Replicate (the other axes unchanged), holding the gradient's own global value,
// as redistribute<Replicate> would, but bucketed and asynchronous:
//  - Partial<sum> (the ranks' gradients add up): the sum over dp. That is the gradient of a loss
//    normalized over the *global* batch, which the library's losses compute (cross_entropy over a
//    dp-sharded batch is the mean over all of it), so training equals one rank's, uneven shards included.
//  - Partial<avg> (the ranks' gradients are to be averaged): the mean over dp, torch DDP's convention,
//    where each rank's loss is the mean over its own part of the batch. `as_partial_avg<"dp">(g)` says so
//    for a gradient the ops typed Partial<sum>. It equals one rank's training when the parts are equal, as
//    in torch.
// As torch's default hook does, a gradient to average is multiplied by 1 / dp while it is copied into its
// bucket, and each bucket is all-reduced with sum. The result shares the gradient's memory (its Partial
// values are consumed) and holds the reduced value once finish() returned.
//
// Buckets: the parameters are walked from the last registered to the first (the order a backward that
// runs the layers in reverse produces their gradients), closing a bucket once its bytes reach the cap:
// `first_bucket_cap_bytes` for the first bucket, `bucket_cap_bytes` after it (torch's buckets after its
// first iteration, which it rebuilds in gradient-ready order with dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB
// for the first; torch's own first iteration uses one bucket). When every gradient of a bucket is ready
// its flat buffer's all_reduce is issued asynchronously (one collective per bucket), in bucket order (a
// bucket whose gradients are ready before an earlier one's waits for it, so every rank issues the same
// sequence); finish() waits for them in order and copies the results back. One element type per reducer.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/memory_tracker.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/local/pointwise.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor {

/// The reducer's bucket sizes (torch DDP's bucket_cap_mb, in bytes, and its first-bucket cap).
struct DDPOptions {
  std::int64_t bucket_cap_bytes = std::int64_t{25} << 20;
  std::int64_t first_bucket_cap_bytes = std::int64_t{1} << 20;
  /// false: each bucket's all_reduce is waited for as soon as it is issued (the same collectives in the
  /// same order, numerically the same step, no overlap with the backward: measures the whole
  /// communication, as FsdpScheduleOptions::overlap does).
  bool overlap = true;
};

/// The buckets of parameters whose gradients have `bytes[i]` bytes (i in registration order): walked from
/// the last parameter to the first, a bucket closes once its bytes reach its cap (`first_cap` for bucket
/// 0, `cap` after). Returns the parameter indices of each bucket, in the order the buckets are reduced and,
/// within one, the order the gradients are expected.
/// @post every index in exactly one bucket; a bucket exceeds its cap only by its last parameter.
inline std::vector<std::vector<int>> assign_buckets(const std::vector<std::int64_t>& bytes,
                                                    std::int64_t first_cap, std::int64_t cap) {
  std::vector<std::vector<int>> buckets;
  std::vector<int> open;
  std::int64_t size = 0;
  for (int i = static_cast<int>(bytes.size()) - 1; i >= 0; --i) {
    open.push_back(i);
    size += bytes[static_cast<std::size_t>(i)];
    if (size >= (buckets.empty() ? first_cap : cap)) {
      buckets.push_back(std::move(open));
      open.clear();
      size = 0;
    }
  }
  if (!open.empty()) {
    buckets.push_back(std::move(open));
  }
  return buckets;
}

namespace detail {

/// The untyped part of DDPReducer: buckets of flat gradient shards of T on one process group.
template <class T>
class BucketReducer {
public:
  BucketReducer(ProcessGroup group, std::vector<std::int64_t> numels, DDPOptions options)
      : group_(std::move(group)), numels_(std::move(numels)), overlap_(options.overlap),
        grads_(numels_.size()), bucket_of_(numels_.size()), offset_(numels_.size()),
        done_(numels_.size(), false) {
    DTENSOR_CHECK(options.bucket_cap_bytes > 0 && options.first_bucket_cap_bytes > 0,
                  "DDPReducer: bucket caps must be positive");
    std::vector<std::int64_t> bytes;
    for (std::int64_t n : numels_) {
      DTENSOR_CHECK(n >= 0, "DDPReducer: negative parameter size");
      bytes.push_back(n * static_cast<std::int64_t>(sizeof(T)));
    }
    layout_ = assign_buckets(bytes, options.first_bucket_cap_bytes, options.bucket_cap_bytes);
    for (std::size_t b = 0; b < layout_.size(); ++b) {
      Bucket bucket;
      for (int i : layout_[b]) {
        bucket_of_[static_cast<std::size_t>(i)] = static_cast<int>(b);
        offset_[static_cast<std::size_t>(i)] = bucket.numel;
        bucket.numel += numels_[static_cast<std::size_t>(i)];
      }
      bucket.pending = static_cast<int>(layout_[b].size());
      buckets_.push_back(std::move(bucket));
    }
  }

  /// Takes parameter `index`'s gradient shard (contiguous, flat): copies it into its bucket (divided by
  /// the group size when `average`), and issues every bucket that is now complete, in order.
  void ready(int index, const Tensor<T, 1>& grad, bool average) {
    const auto i = check_gradient("DDPReducer::ready", index, grad);
    Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[i])];
    if (!b.buffer.defined() || b.buffer.device() != grad.device()) {
      const MemoryCategoryScope category(MemoryCategory::communication);
#if DTENSOR_HAS_CUDA
      b.buffer = Tensor<T, 1>({b.numel}, grad.device(), grad.stream());
#else
      b.buffer = Tensor<T, 1>({b.numel}, grad.device());
#endif
    }
    if (grad.numel() > 0) {
      const Tensor<T, 1> region = b.buffer.narrow(0, offset_[i], numels_[i]);
      const double scale = average ? 1.0 / static_cast<double>(group_.size()) : 1.0;
      if (b.unsynced.defined()) { // the micro-batches accumulated without synchronisation
        local::map_into(region, local::Axpy{scale}, grad, b.unsynced.narrow(0, offset_[i], numels_[i]));
      } else {
        local::map_into(region, local::Scale{scale}, grad);
      }
    }
    set_memory_category(grad, MemoryCategory::gradients); // kept until finish() writes the result into it
    grads_[i] = grad;
    done_[i] = true;
    --b.pending;
    while (next_ < static_cast<int>(buckets_.size()) &&
           buckets_[static_cast<std::size_t>(next_)].pending == 0) {
      Bucket& ready_bucket = buckets_[static_cast<std::size_t>(next_)];
      if (!ready_bucket.buffer.defined()) { // a bucket of empty shards only
        ready_bucket.buffer = Tensor<T, 1>({0});
      }
      if (group_.size() > 1) { // a group of one: the sum is the bucket (a size-1 axis costs nothing)
        ready_bucket.work = all_reduce(ready_bucket.buffer, ReduceOp::sum, group_, async_op);
      }
      if (!overlap_) {
        ready_bucket.work.wait();
      }
      ready_bucket.unsynced = Tensor<T, 1>(); // added into the buffer: freed
      ++next_;
    }
  }

  /// Gradient accumulation without synchronisation (torch DDP's no_sync): adds parameter `index`'s gradient
  /// (divided by the group size when `average`) to its bucket's accumulator, with no communication. The
  /// next ready() of the parameter adds the accumulator to the gradient it hands over, so the step's one
  /// all_reduce per bucket carries every micro-batch. Memory: the buckets' size once more, until then.
  void accumulate(int index, const Tensor<T, 1>& grad, bool average) {
    const auto i = check_gradient("DDPReducer::accumulate", index, grad);
    Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[i])];
    if (!b.unsynced.defined() || b.unsynced.device() != grad.device()) {
      const MemoryCategoryScope category(MemoryCategory::gradients);
      b.unsynced = Tensor<T, 1>::zeros({b.numel}, grad.device());
    }
    if (grad.numel() > 0) {
      const Tensor<T, 1> region = b.unsynced.narrow(0, offset_[i], numels_[i]);
      const double scale = average ? 1.0 / static_cast<double>(group_.size()) : 1.0;
      local::map_into(region, local::Axpy{scale}, grad, region);
    }
  }

  /// Waits for every bucket's all_reduce (in order) and copies the results into the gradients handed over;
  /// then the reducer is ready for the next step. Throws, naming them, when some gradients never came.
  void finish() {
    std::string missing;
    for (std::size_t i = 0; i < done_.size(); ++i) {
      if (!done_[i]) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(i);
      }
    }
    DTENSOR_CHECK(missing.empty(), "DDPReducer::finish: no gradient was handed over for parameter(s) " +
                                       missing + " in this step (every rank must call ready() for each)");
    for (Bucket& b : buckets_) {
      b.work.wait();
      b.work = Work();
      b.pending = 0;
    }
    for (std::size_t i = 0; i < grads_.size(); ++i) {
      if (numels_[i] > 0) {
        const Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[i])];
        local::copy(grads_[i], b.buffer.narrow(0, offset_[i], numels_[i]));
      }
      grads_[i] = Tensor<T, 1>();
      done_[i] = false;
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].pending = static_cast<int>(layout_[b].size());
    }
    next_ = 0;
  }

  int num_params() const noexcept {
    return static_cast<int>(numels_.size());
  }
  const std::vector<std::vector<int>>& buckets() const noexcept {
    return layout_;
  }
  int bucket_of(int index) const {
    return bucket_of_.at(static_cast<std::size_t>(index));
  }
  /// Buckets whose all_reduce has been issued in this step.
  int buckets_issued() const noexcept {
    return next_;
  }
  const ProcessGroup& group() const noexcept {
    return group_;
  }

private:
  /// Parameter `index` exists, its gradient has its size and was not handed over yet in this step.
  std::size_t check_gradient(const char* what, int index, const Tensor<T, 1>& grad) const {
    DTENSOR_CHECK(index >= 0 && index < num_params(), std::string(what) + ": parameter index " +
                                                          std::to_string(index) + " not in [0, " +
                                                          std::to_string(num_params()) + ")");
    const auto i = static_cast<std::size_t>(index);
    DTENSOR_CHECK(!done_[i], std::string(what) + ": parameter " + std::to_string(index) +
                                 "'s gradient was already handed over in this step (call finish() first)");
    DTENSOR_CHECK(grad.numel() == numels_[i], std::string(what) + ": parameter " + std::to_string(index) +
                                                  " has " + std::to_string(numels_[i]) +
                                                  " local elements, its gradient " +
                                                  std::to_string(grad.numel()));
    return i;
  }

  struct Bucket {
    std::int64_t numel = 0;
    Tensor<T, 1> buffer;
    Tensor<T, 1> unsynced; ///< accumulate()'s sum, until the bucket's all_reduce
    int pending = 0;
    Work work;
  };

  ProcessGroup group_;
  std::vector<std::int64_t> numels_;
  bool overlap_;
  std::vector<Tensor<T, 1>> grads_;
  std::vector<int> bucket_of_;
  std::vector<std::int64_t> offset_;
  std::vector<bool> done_;
  std::vector<std::vector<int>> layout_;
  std::vector<Bucket> buckets_;
  int next_ = 0;
};

/// G's placements with the one of mesh axis `Axis` made Replicate.
template <class G, int Axis>
struct ReplicatedOver {
  static constexpr PlacementList list() {
    PlacementList l = G::placements;
    l[Axis] = Placement::replicate();
    return l;
  }
};

/// G's placements with the one of mesh axis `Axis` made Partial<avg>.
template <class G, int Axis>
struct AveragedOver {
  static constexpr PlacementList list() {
    PlacementList l = G::placements;
    l[Axis] = Placement::partial(ReduceOp::avg);
    return l;
  }
};

} // namespace detail

/// DDP's gradient reducer over the mesh axis `Axis` for parameters of element type T (see the header
/// comment). Every rank of the axis makes the same calls in the same order.
template <fixed_string Axis, class T, class Shape>
class DDPReducer {
public:
  static constexpr int axis = Shape::template index_of<Axis>();

  /// Parameters 0 .. n-1 with `numels[i]` local elements each (the shard a rank holds).
  DDPReducer(const DeviceMesh<Shape>& mesh, std::vector<std::int64_t> numels, DDPOptions options = {})
      : core_(mesh.template group<Axis>(), std::move(numels), options) {}

  /// Hands over parameter `index`'s gradient, Partial<sum> or Partial<avg> over Axis; returns the same
  /// gradient Replicate over Axis, sharing its memory, which holds its value (the sum, or the mean, over
  /// Axis) once finish() returned. Issues the all_reduce of every bucket this completes.
  template <AnyDTensor G>
  auto ready(int index, G grad) {
    using GT = detail::dtensor_traits<G>;
    static_assert(std::is_same_v<typename GT::value_type, T> &&
                      std::is_same_v<typename GT::shape_type, Shape>,
                  "DDPReducer::ready: the gradient must have the reducer's element type and mesh shape");
    static_assert(GT::placements[axis] == Placement::partial(ReduceOp::sum) ||
                      GT::placements[axis] == Placement::partial(ReduceOp::avg),
                  "DDPReducer::ready: the gradient must be Partial<sum> (or Partial<avg>) over the reducer's "
                  "axis: each rank's gradient of its part of the batch, as the ops' backward gives it for a "
                  "batch sharded over that axis; a gradient already reduced over it needs no DDP");
    using Out = dtensor_from_t<T, GT::rank, Shape, &detail::ReplicatedOver<G, axis>::list>;
    core_.ready(index, grad.local().template view<1>({grad.local().numel()}),
                GT::placements[axis].op == ReduceOp::avg);
    return Out(grad.mesh(), grad.local(), grad.global_shape());
  }

  /// Gradient accumulation without synchronisation (torch DDP's no_sync): for the first K - 1 micro-batches
  /// hand each gradient (Partial over Axis, as for ready) to accumulate(); the last micro-batch's ready()
  /// adds the sum in, and the step's bucket all_reduces carry all K. No communication here.
  template <AnyDTensor G>
  void accumulate(int index, const G& grad) {
    using GT = detail::dtensor_traits<G>;
    static_assert(std::is_same_v<typename GT::value_type, T> &&
                      std::is_same_v<typename GT::shape_type, Shape>,
                  "DDPReducer::accumulate: the gradient must have the reducer's element type and mesh shape");
    static_assert(GT::placements[axis] == Placement::partial(ReduceOp::sum) ||
                      GT::placements[axis] == Placement::partial(ReduceOp::avg),
                  "DDPReducer::accumulate: the gradient must be Partial<sum> (or Partial<avg>) over the "
                  "reducer's axis, as for ready()");
    core_.accumulate(index, grad.local().contiguous().template view<1>({grad.local().numel()}),
                     GT::placements[axis].op == ReduceOp::avg);
  }

  /// Waits for every bucket and writes the reduced values into the gradients ready() returned.
  void finish() { core_.finish(); }

  int num_params() const noexcept { return core_.num_params(); }
  /// The parameter indices of each bucket, in the order they are reduced.
  const std::vector<std::vector<int>>& buckets() const noexcept { return core_.buckets(); }
  int bucket_of(int index) const { return core_.bucket_of(index); }
  /// Buckets whose all_reduce has been issued in the current step.
  int buckets_issued() const noexcept { return core_.buckets_issued(); }

private:
  detail::BucketReducer<T> core_;
};

/// `g`, Partial<sum> over `Axis`, with the ranks' values declared values to average (Partial<avg>): the
/// gradient of each rank's loss normalized by its own part of the batch (torch DDP's convention), which
/// DDPReducer then averages. The same memory; no communication.
template <fixed_string Axis, AnyDTensor G>
auto as_partial_avg(G g) {
  using GT = detail::dtensor_traits<G>;
  using Shape = typename GT::shape_type;
  constexpr int axis = Shape::template index_of<Axis>();
  static_assert(GT::placements[axis] == Placement::partial(ReduceOp::sum),
                "as_partial_avg: the gradient must be Partial<sum> over the axis");
  using Out = dtensor_from_t<typename GT::value_type, GT::rank, Shape, &detail::AveragedOver<G, axis>::list>;
  return Out(g.mesh(), g.local(), g.global_shape());
}

/// A reducer over axis `Axis` for `params` (parameter i = params[i], in registration order): their local
/// shards' sizes, element type and mesh.
template <fixed_string Axis, AnyDTensor P0, AnyDTensor... P>
auto ddp_reducer(DDPOptions options, const P0& p0, const P&... params) {
  using T = typename P0::value_type;
  using Shape = typename detail::dtensor_traits<P0>::shape_type;
  static_assert((std::is_same_v<typename P::value_type, T> && ...),
                "ddp_reducer: every parameter must have the same element type (one reducer per type)");
  static_assert((std::is_same_v<typename detail::dtensor_traits<P>::shape_type, Shape> && ...),
                "ddp_reducer: every parameter must be on the same mesh");
  static_assert(!P0::placements[Shape::template index_of<Axis>()].is_shard() &&
                    (!P::placements[Shape::template index_of<Axis>()].is_shard() && ...),
                "ddp_reducer: DDP's parameters are replicated over its axis (shard them with FSDP instead)");
  return DDPReducer<Axis, T, Shape>(p0.mesh(), {p0.local().numel(), params.local().numel()...}, options);
}

} // namespace dtensor
