#pragma once
// dtensor::autograd: collectives paired with their backward, for writing a backward pass by hand (no
// autograd engine, no tape). Each forward returns its output and a small typed context that keeps what the
// backward needs (group, dim, sizes, src) and nothing more; calling the context on the gradient of the
// output runs the dual collective and returns the gradient of the input.
//
//   auto [y, back] = dtensor::autograd::all_gather(x, /*dim=*/1, /*global_size=*/5, group);
//   Tensor<float, 2> gx = back(gy);                    // reduce_scatter(sum) along dim 1
//   auto pending = back(gy, dtensor::async_op);        // the same, asynchronously
//   gx = pending.wait();
//
//   forward                                 backward
//   all_reduce(sum)                         identity
//   copy (identity)                         all_reduce(sum)
//   all_gather along d                      reduce_scatter(sum) along d
//   reduce_scatter(sum) along d             all_gather along d
//   all_to_all_single (dim-0 splits)        all_to_all_single with the splits swapped
//   broadcast(src)                          reduce(sum) to src; zeros on the other members
//   chunk along d (this member's block)     all_gather along d
//   all_gather_replicated along d           chunk along d
//
// Per member or replicated. Each backward is the adjoint of its forward, <A x, gy> == <x, back(gy)>, for
// the global inner product that sums the members' local products over a per-member tensor (each member
// holds its own value: a shard, a partial sum, an input to a rank-specific computation) and counts a
// replicated tensor (the same on every member, used redundantly) once. The sides of each row:
//
//   all_reduce               x per member    y replicated   (the gradient must be the same on every member)
//   copy                     x replicated    y per member   (the returned gradient is the same everywhere)
//   all_gather               x per member    y per member   (each member uses the whole: FSDP, SP)
//   reduce_scatter           x per member    y per member
//   all_to_all_single        x per member    y per member
//   broadcast                x per member    y per member   (only src's x is read: the others' get 0)
//   chunk                    x replicated    y per member
//   all_gather_replicated    x per member    y replicated
//
// Blocks along d follow torch.chunk of the global size N over the n members (ceil(N/n) each, the last
// ones shorter or empty: 5 over 4 is 2, 2, 1, 0), except in all_gather without a global size, which
// exchanges the members' shapes (one small all_gather) and keeps whatever sizes they have. Every byte
// goes through the collectives of comm/collectives.hpp, so CommDebugMode counts it. Wrong arguments (a dim
// out of range, a block of the wrong size, a gradient that is not shaped like the forward's output) throw
// dtensor::Error naming the op, the rank, the group and the sizes, before any communication.

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/comm/backend_call.hpp"
#include "dtensor/comm/collectives.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/reduce_op.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/layout/algebra.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dtensor::autograd {

/// The result of an asynchronous op: wait() blocks until it is complete and returns it (rethrowing the
/// op's error). Copies share the op.
template <class T, int Rank>
class Pending {
public:
  Pending(Work work, Tensor<T, Rank> result) : work_(std::move(work)), result_(std::move(result)) {}

  Tensor<T, Rank> wait() const {
    work_.wait();
    return result_;
  }
  bool is_completed() const { return work_.is_completed(); }
  const Work& work() const noexcept { return work_; }

private:
  Work work_;
  Tensor<T, Rank> result_;
};

/// A tensor cut along `dim` into one block per group member, in member order: what the backward of a
/// block collective (all_gather, reduce_scatter, chunk) keeps.
template <int Rank>
struct Blocks {
  using Shape = std::array<std::int64_t, Rank>;
  int dim = 0;
  Shape full{};                    ///< the concatenated shape
  std::vector<std::int64_t> sizes; ///< member i's block has sizes[i] entries along dim

  Shape block(int member) const {
    Shape s = full;
    s[dim] = sizes[member];
    return s;
  }
  std::int64_t offset(int member) const {
    std::int64_t o = 0;
    for (int i = 0; i < member; ++i) {
      o += sizes[i];
    }
    return o;
  }
};

namespace detail {

using dtensor::detail::format_list;
using dtensor::detail::shape_to_string;

/// "autograd::all_gather on rank 1 (global 1) of gloo group [0,1]"
inline std::string context(const ProcessGroup& group, const char* op) {
  return std::string("autograd::") + op + " on " + group.to_string();
}

template <int Rank>
int check_dim(int dim, const std::array<std::int64_t, Rank>& shape, const ProcessGroup& group,
              const char* op) {
  DTENSOR_CHECK(dim >= -Rank && dim < Rank,
                context(group, op) + ": dim " + std::to_string(dim) +
                    " is out of range for the input of shape " + shape_to_string(shape) + " (expected " +
                    std::to_string(-Rank) + " <= dim < " + std::to_string(Rank) + ")");
  return dim < 0 ? dim + Rank : dim;
}

template <int Rank>
void check_grad(const std::array<std::int64_t, Rank>& grad, const std::array<std::int64_t, Rank>& expected,
                const ProcessGroup& group, const char* op) {
  DTENSOR_CHECK(grad == expected, context(group, op) + " backward: the gradient has shape " +
                                      shape_to_string(grad) + " but the forward's output had shape " +
                                      shape_to_string(expected));
}

/// torch.chunk's block sizes of `n` entries over `k` members.
inline std::vector<std::int64_t> chunk_sizes(std::int64_t n, int k) {
  std::vector<std::int64_t> sizes(k);
  for (int i = 0; i < k; ++i) {
    sizes[i] = chunk_size(n, k, i);
  }
  return sizes;
}

/// A Work whose wait() also runs `next` once the op is complete (a synchronous op's empty Work: now).
inline Work then(const Work& work, std::function<void()> next) {
  if (!work.impl()) {
    next();
    return work;
  }
  return Work(work.impl(), std::make_shared<Work>(work), [work, next = std::move(next)] {
    work.wait();
    next();
  });
}

/// Synchronous ops return an empty (complete) Work, asynchronous ones theirs.
template <class Op>
Work run(bool async, Op&& op) {
  if (async) {
    return op(async_op);
  }
  op();
  return Work();
}

/// True when every block along `dim` is one contiguous run of a contiguous tensor of shape `shape`.
template <class Shape>
bool blocks_contiguous(const Shape& shape, int dim) {
  std::int64_t outer = 1;
  for (int d = 0; d < dim; ++d) {
    outer *= shape[d];
  }
  return outer <= 1;
}

inline bool all_equal(std::span<const std::int64_t> sizes) {
  for (auto s : sizes) {
    if (s != sizes[0]) {
      return false;
    }
  }
  return true;
}

/// out (shape b.full) = the members' blocks concatenated along b.dim; `block` is this member's. Blocks
/// that are contiguous runs of `out` are received in place; otherwise they are staged and copied.
template <class T, int Rank>
Work gather_blocks(const Tensor<T, Rank>& out, const Tensor<T, Rank>& block, const Blocks<Rank>& b,
                   const ProcessGroup& group, bool async) {
  const auto x = block.contiguous();
  const bool in_place = blocks_contiguous(b.full, b.dim);
  if (in_place && all_equal(b.sizes)) {
    const auto flat_out = out.template view<1>({out.numel()});
    const auto flat_in = x.template view<1>({x.numel()});
    return run(async,
               [&](auto... a) { return dtensor::all_gather_into_tensor(flat_out, flat_in, group, a...); });
  }
  std::vector<Tensor<T, Rank>> parts;
  for (int i = 0; i < group.size(); ++i) {
    auto view = out.narrow(b.dim, b.offset(i), b.sizes[i]);
    parts.push_back(in_place ? view : Tensor<T, Rank>(view.shape(), out.device()));
  }
  Work w = run(async, [&](auto... a) { return dtensor::all_gather(parts, x, group, a...); });
  if (in_place) {
    return w;
  }
  return then(w, [out, parts, b] {
    for (int i = 0; i < static_cast<int>(parts.size()); ++i) {
      out.narrow(b.dim, b.offset(i), b.sizes[i]).copy_from(parts[i]);
    }
  });
}

/// out (this member's block) = the sum over members of block `rank` of their `full` along b.dim.
template <class T, int Rank>
Work reduce_scatter_blocks(const Tensor<T, Rank>& out, const Tensor<T, Rank>& full, const Blocks<Rank>& b,
                           const ProcessGroup& group, bool async) {
  const auto x = full.contiguous();
  const bool in_place = blocks_contiguous(b.full, b.dim);
  if (in_place && all_equal(b.sizes)) {
    const auto flat_out = out.template view<1>({out.numel()});
    const auto flat_in = x.template view<1>({x.numel()});
    return run(async, [&](auto... a) {
      return dtensor::reduce_scatter_tensor(flat_out, flat_in, ReduceOp::sum, group, a...);
    });
  }
  std::vector<Tensor<T, Rank>> parts;
  for (int i = 0; i < group.size(); ++i) {
    auto view = x.narrow(b.dim, b.offset(i), b.sizes[i]);
    parts.push_back(in_place ? view : view.contiguous());
  }
  return run(async,
             [&](auto... a) { return dtensor::reduce_scatter(out, parts, ReduceOp::sum, group, a...); });
}

/// The gradient of a forward whose backward gathers blocks (reduce_scatter, chunk).
template <class T, int Rank>
Pending<T, Rank> gather_backward(const Blocks<Rank>& b, const ProcessGroup& group, const Tensor<T, Rank>& gy,
                                 const char* op, bool async) {
  check_grad<Rank>(gy.shape(), b.block(group.rank()), group, op);
  Tensor<T, Rank> gx(b.full, gy.device());
  return Pending<T, Rank>(gather_blocks(gx, gy, b, group, async), gx);
}

/// The gradient of a forward that gathers blocks (all_gather).
template <class T, int Rank>
Pending<T, Rank> reduce_scatter_backward(const Blocks<Rank>& b, const ProcessGroup& group,
                                         const Tensor<T, Rank>& gy, const char* op, bool async) {
  check_grad<Rank>(gy.shape(), b.full, group, op);
  Tensor<T, Rank> gx(b.block(group.rank()), gy.device());
  return Pending<T, Rank>(reduce_scatter_blocks(gx, gy, b, group, async), gx);
}

/// This member's block of `x` along b.dim (a view when the block is contiguous in x).
template <class T, int Rank>
Tensor<T, Rank> own_block(const Tensor<T, Rank>& x, const Blocks<Rank>& b, int rank) {
  return x.narrow(b.dim, b.offset(rank), b.sizes[rank]).contiguous();
}

/// The blocks of a tensor of `shape` split along `dim` the torch.chunk way.
template <int Rank>
Blocks<Rank> chunked(const std::array<std::int64_t, Rank>& shape, int dim, int members) {
  return Blocks<Rank>{dim, shape, chunk_sizes(shape[dim], members)};
}

/// The blocks of all_gather with a global size: this member's block must be its torch.chunk piece.
template <int Rank>
Blocks<Rank> gathered(const std::array<std::int64_t, Rank>& shape, int dim, std::int64_t global_size,
                      const ProcessGroup& group, const char* op) {
  const int n = group.size(), r = group.rank();
  DTENSOR_CHECK(global_size >= 0, context(group, op) + ": the global size along dim " + std::to_string(dim) +
                                      " is " + std::to_string(global_size) + ", must be >= 0");
  Blocks<Rank> b{dim, shape, chunk_sizes(global_size, n)};
  b.full[dim] = global_size;
  DTENSOR_CHECK(shape[dim] == b.sizes[r],
                context(group, op) + ": this member's block " + shape_to_string(shape) + " has " +
                    std::to_string(shape[dim]) + " entries along dim " + std::to_string(dim) +
                    ", but torch.chunk of the global size " + std::to_string(global_size) + " over " +
                    std::to_string(n) + " members gives member " + std::to_string(r) + " " +
                    std::to_string(b.sizes[r]) + " (sizes " + format_list(b.sizes, ", ") + ")");
  return b;
}

/// The blocks of all_gather without a global size: the members exchange their shapes (one all_gather of
/// Rank integers each, on `device`: NCCL moves device memory only), which must agree outside `dim`.
template <int Rank>
Blocks<Rank> exchanged(const std::array<std::int64_t, Rank>& shape, int dim, const ProcessGroup& group,
                       const char* op, Device device) {
  const int n = group.size();
  auto mine = Tensor<std::int64_t, 1>({Rank});
  for (int d = 0; d < Rank; ++d) {
    mine(d) = shape[d];
  }
  auto received = Tensor<std::int64_t, 1>({static_cast<std::int64_t>(n) * Rank}, device);
  dtensor::all_gather_into_tensor(received, mine.to(device), group);
  const auto all = received.to(Device::cpu());
  Blocks<Rank> b{dim, shape, std::vector<std::int64_t>(n)};
  b.full[dim] = 0;
  for (int i = 0; i < n; ++i) {
    std::array<std::int64_t, Rank> theirs{};
    for (int d = 0; d < Rank; ++d) {
      theirs[d] = all(i * Rank + d);
    }
    for (int d = 0; d < Rank; ++d) {
      DTENSOR_CHECK(d == dim || theirs[d] == shape[d], context(group, op) + ": member " + std::to_string(i) +
                                                           "'s block " + shape_to_string(theirs) +
                                                           " and this member's " + shape_to_string(shape) +
                                                           " differ outside dim " + std::to_string(dim));
    }
    b.sizes[i] = theirs[dim];
    b.full[dim] += theirs[dim];
  }
  return b;
}

/// A copy of x, on which `op` then runs in place.
template <class T, int Rank>
Pending<T, Rank> clone_then(const Tensor<T, Rank>& x, bool async,
                            const std::function<Work(const Tensor<T, Rank>&, bool)>& op) {
  auto y = x.clone();
  return Pending<T, Rank>(op(y, async), y);
}

} // namespace detail

// ---- the backward contexts ------------------------------------------------------------------------------
// Each is called on the gradient of its forward's output: `back(gy)` returns the input's gradient,
// `back(gy, async_op)` a Pending of it. Every member of the group calls it, in the same order as the
// group's other collectives.

/// Backward of all_reduce(sum): the identity (returns gy itself, no communication).
template <class T, int Rank>
struct AllReduceBackward {
  ProcessGroup group;
  std::array<std::int64_t, Rank> shape{};

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const {
    detail::check_grad<Rank>(gy.shape(), shape, group, "all_reduce");
    return gy;
  }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const { return {Work(), (*this)(gy)}; }
};

/// Backward of copy: all_reduce(sum) of the members' gradients.
template <class T, int Rank>
struct CopyBackward {
  ProcessGroup group;
  std::array<std::int64_t, Rank> shape{};

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const { return apply(gy, false).wait(); }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const { return apply(gy, true); }

private:
  Pending<T, Rank> apply(const Tensor<T, Rank>& gy, bool async) const {
    detail::check_grad<Rank>(gy.shape(), shape, group, "copy");
    return detail::clone_then<T, Rank>(gy, async, [&](const Tensor<T, Rank>& g, bool a) {
      return detail::run(a,
                         [&](auto... tag) { return dtensor::all_reduce(g, ReduceOp::sum, group, tag...); });
    });
  }
};

/// Backward of all_gather along a dim: reduce_scatter(sum) of the gradient into the members' blocks.
template <class T, int Rank>
struct AllGatherBackward {
  ProcessGroup group;
  Blocks<Rank> blocks;

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const {
    return detail::reduce_scatter_backward(blocks, group, gy, "all_gather", false).wait();
  }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const {
    return detail::reduce_scatter_backward(blocks, group, gy, "all_gather", true);
  }
};

/// Backward of reduce_scatter(sum) along a dim: all_gather of the members' block gradients.
template <class T, int Rank>
struct ReduceScatterBackward {
  ProcessGroup group;
  Blocks<Rank> blocks;

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const {
    return detail::gather_backward(blocks, group, gy, "reduce_scatter", false).wait();
  }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const {
    return detail::gather_backward(blocks, group, gy, "reduce_scatter", true);
  }
};

/// Backward of chunk along a dim: all_gather of the members' block gradients.
template <class T, int Rank>
struct ChunkBackward {
  ProcessGroup group;
  Blocks<Rank> blocks;

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const {
    return detail::gather_backward(blocks, group, gy, "chunk", false).wait();
  }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const {
    return detail::gather_backward(blocks, group, gy, "chunk", true);
  }
};

/// Backward of all_gather_replicated: this member's chunk of the (replicated) gradient, no communication.
template <class T, int Rank>
struct AllGatherReplicatedBackward {
  ProcessGroup group;
  Blocks<Rank> blocks;

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const {
    detail::check_grad<Rank>(gy.shape(), blocks.full, group, "all_gather_replicated");
    return detail::own_block(gy, blocks, group.rank());
  }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const { return {Work(), (*this)(gy)}; }
};

/// Backward of all_to_all_single: all_to_all_single with the input and output splits swapped.
template <class T, int Rank>
struct AllToAllBackward {
  ProcessGroup group;
  std::vector<std::int64_t> output_split_sizes; ///< the forward's (empty: equal splits)
  std::vector<std::int64_t> input_split_sizes;
  std::array<std::int64_t, Rank> input_shape{};
  std::array<std::int64_t, Rank> output_shape{};

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const { return apply(gy, false).wait(); }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const { return apply(gy, true); }

private:
  Pending<T, Rank> apply(const Tensor<T, Rank>& gy, bool async) const {
    detail::check_grad<Rank>(gy.shape(), output_shape, group, "all_to_all_single");
    Tensor<T, Rank> gx(input_shape, gy.device());
    const auto g = gy.contiguous();
    Work w = detail::run(async, [&](auto... a) {
      return dtensor::all_to_all_single(gx, g, std::span<const std::int64_t>(input_split_sizes),
                                        std::span<const std::int64_t>(output_split_sizes), group, a...);
    });
    return Pending<T, Rank>(std::move(w), gx);
  }
};

/// Backward of broadcast(src): on src the sum of every member's gradient (reduce to src), elsewhere zeros
/// (their input was not read).
template <class T, int Rank>
struct BroadcastBackward {
  ProcessGroup group;
  int src = 0;
  std::array<std::int64_t, Rank> shape{};

  Tensor<T, Rank> operator()(const Tensor<T, Rank>& gy) const { return apply(gy, false).wait(); }
  Pending<T, Rank> operator()(const Tensor<T, Rank>& gy, AsyncOp) const { return apply(gy, true); }

private:
  Pending<T, Rank> apply(const Tensor<T, Rank>& gy, bool async) const {
    detail::check_grad<Rank>(gy.shape(), shape, group, "broadcast");
    if (group.rank() == src) {
      return detail::clone_then<T, Rank>(gy, async, [&](const Tensor<T, Rank>& g, bool a) {
        return detail::run(
            a, [&](auto... tag) { return dtensor::reduce(g, src, ReduceOp::sum, group, tag...); });
      });
    }
    // reduce leaves a non-root's tensor unchanged, so the gradient is sent as it is
    const auto g = gy.contiguous();
    Work w = detail::run(async,
                         [&](auto... tag) { return dtensor::reduce(g, src, ReduceOp::sum, group, tag...); });
    return Pending<T, Rank>(std::move(w), Tensor<T, Rank>::zeros(shape, gy.device()));
  }
};

// ---- the forwards ----------------------------------------------------------------------------------------

/// y = the sum of the members' x (a new tensor); backward: identity.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, AllReduceBackward<T, Rank>> all_reduce(const Tensor<T, Rank>& x,
                                                                      const ProcessGroup& group, AsyncOp) {
  auto y = detail::clone_then<T, Rank>(x, true, [&](const Tensor<T, Rank>& t, bool) {
    return dtensor::all_reduce(t, ReduceOp::sum, group, async_op);
  });
  return {std::move(y), {group, x.shape()}};
}

template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllReduceBackward<T, Rank>> all_reduce(const Tensor<T, Rank>& x,
                                                                     const ProcessGroup& group) {
  auto [y, back] = autograd::all_reduce(x, group, async_op);
  return {y.wait(), std::move(back)};
}
/// y = x (the same tensor: no copy, no communication), entering a computation that differs per member;
/// backward: all_reduce(sum).
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, CopyBackward<T, Rank>> copy(const Tensor<T, Rank>& x,
                                                          const ProcessGroup& group) {
  return {x, {group, x.shape()}};
}

/// y = the members' blocks x concatenated along `dim`, where the blocks are the torch.chunk pieces of
/// `global_size` entries (this member's x must be its piece); backward: reduce_scatter(sum) along `dim`.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, AllGatherBackward<T, Rank>>
all_gather(const Tensor<T, Rank>& x, int dim, std::int64_t global_size, const ProcessGroup& group, AsyncOp) {
  const int d = detail::check_dim<Rank>(dim, x.shape(), group, "all_gather");
  auto b = detail::gathered<Rank>(x.shape(), d, global_size, group, "all_gather");
  Tensor<T, Rank> y(b.full, x.device());
  Work w = detail::gather_blocks(y, x, b, group, true);
  return {Pending<T, Rank>(std::move(w), y), {group, std::move(b)}};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllGatherBackward<T, Rank>>
all_gather(const Tensor<T, Rank>& x, int dim, std::int64_t global_size, const ProcessGroup& group) {
  auto [y, back] = autograd::all_gather(x, dim, global_size, group, async_op);
  return {y.wait(), std::move(back)};
}
/// The same with blocks of any size along `dim`: the members first exchange their shapes (one more, small
/// all_gather), and the backward keeps the sizes.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, AllGatherBackward<T, Rank>> all_gather(const Tensor<T, Rank>& x, int dim,
                                                                      const ProcessGroup& group, AsyncOp) {
  const int d = detail::check_dim<Rank>(dim, x.shape(), group, "all_gather");
  auto b = detail::exchanged<Rank>(x.shape(), d, group, "all_gather", x.device());
  Tensor<T, Rank> y(b.full, x.device());
  Work w = detail::gather_blocks(y, x, b, group, true);
  return {Pending<T, Rank>(std::move(w), y), {group, std::move(b)}};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllGatherBackward<T, Rank>> all_gather(const Tensor<T, Rank>& x, int dim,
                                                                     const ProcessGroup& group) {
  auto [y, back] = autograd::all_gather(x, dim, group, async_op);
  return {y.wait(), std::move(back)};
}

/// y = this member's torch.chunk piece along `dim` of the sum of the members' x; backward: all_gather
/// along `dim`.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, ReduceScatterBackward<T, Rank>>
reduce_scatter(const Tensor<T, Rank>& x, int dim, const ProcessGroup& group, AsyncOp) {
  const int d = detail::check_dim<Rank>(dim, x.shape(), group, "reduce_scatter");
  auto b = detail::chunked<Rank>(x.shape(), d, group.size());
  Tensor<T, Rank> y(b.block(group.rank()), x.device());
  Work w = detail::reduce_scatter_blocks(y, x, b, group, true);
  return {Pending<T, Rank>(std::move(w), y), {group, std::move(b)}};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, ReduceScatterBackward<T, Rank>>
reduce_scatter(const Tensor<T, Rank>& x, int dim, const ProcessGroup& group) {
  auto [y, back] = autograd::reduce_scatter(x, dim, group, async_op);
  return {y.wait(), std::move(back)};
}

/// all_to_all_single along dim 0 with split sizes (rows received from / sent to each member; empty:
/// equal splits); backward: the same with the splits swapped.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, AllToAllBackward<T, Rank>>
all_to_all_single(const Tensor<T, Rank>& x, std::vector<std::int64_t> output_split_sizes,
                  std::vector<std::int64_t> input_split_sizes, const ProcessGroup& group, AsyncOp) {
  static_assert(Rank >= 1, "autograd::all_to_all_single splits dim 0: the tensor needs rank >= 1");
  auto shape = x.shape();
  if (!output_split_sizes.empty()) {
    shape[0] = 0;
    for (auto s : output_split_sizes) {
      DTENSOR_CHECK(s >= 0, detail::context(group, "all_to_all_single") + ": negative output split size in " +
                                dtensor::detail::format_list(output_split_sizes, ", "));
      shape[0] += s;
    }
  }
  Tensor<T, Rank> y(shape, x.device());
  Work w = dtensor::all_to_all_single(y, x.contiguous(), std::span<const std::int64_t>(output_split_sizes),
                                      std::span<const std::int64_t>(input_split_sizes), group, async_op);
  AllToAllBackward<T, Rank> back{group, std::move(output_split_sizes), std::move(input_split_sizes),
                                 x.shape(), shape};
  return {Pending<T, Rank>(std::move(w), y), std::move(back)};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllToAllBackward<T, Rank>>
all_to_all_single(const Tensor<T, Rank>& x, std::vector<std::int64_t> output_split_sizes,
                  std::vector<std::int64_t> input_split_sizes, const ProcessGroup& group) {
  auto [y, back] = autograd::all_to_all_single(x, std::move(output_split_sizes), std::move(input_split_sizes),
                                               group, async_op);
  return {y.wait(), std::move(back)};
}

/// y = x of member `src` (a group rank) on every member (a new tensor); backward: reduce(sum) to src.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, BroadcastBackward<T, Rank>> broadcast(const Tensor<T, Rank>& x, int src,
                                                                     const ProcessGroup& group, AsyncOp) {
  Tensor<T, Rank> y = group.rank() == src ? x.clone() : Tensor<T, Rank>(x.shape(), x.device());
  Work w = dtensor::broadcast(y, src, group, async_op);
  return {Pending<T, Rank>(std::move(w), y), {group, src, x.shape()}};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, BroadcastBackward<T, Rank>> broadcast(const Tensor<T, Rank>& x, int src,
                                                                    const ProcessGroup& group) {
  auto [y, back] = autograd::broadcast(x, src, group, async_op);
  return {y.wait(), std::move(back)};
}

/// y = this member's torch.chunk piece of x along `dim` (no communication; a view of x when the piece is
/// contiguous in it); backward: all_gather along `dim`.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, ChunkBackward<T, Rank>> chunk(const Tensor<T, Rank>& x, int dim,
                                                            const ProcessGroup& group) {
  const int d = detail::check_dim<Rank>(dim, x.shape(), group, "chunk");
  auto b = detail::chunked<Rank>(x.shape(), d, group.size());
  auto y = detail::own_block(x, b, group.rank());
  return {y, {group, std::move(b)}};
}

/// all_gather (with a global size) whose output feeds a computation every member does alike (Megatron's
/// gather_from): the gradient arrives the same on every member, so the backward is this member's chunk of
/// it, with no communication.
template <class T, int Rank>
WithBackward<Pending<T, Rank>, AllGatherReplicatedBackward<T, Rank>>
all_gather_replicated(const Tensor<T, Rank>& x, int dim, std::int64_t global_size, const ProcessGroup& group,
                      AsyncOp) {
  const int d = detail::check_dim<Rank>(dim, x.shape(), group, "all_gather_replicated");
  auto b = detail::gathered<Rank>(x.shape(), d, global_size, group, "all_gather_replicated");
  Tensor<T, Rank> y(b.full, x.device());
  Work w = detail::gather_blocks(y, x, b, group, true);
  return {Pending<T, Rank>(std::move(w), y), {group, std::move(b)}};
}
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllGatherReplicatedBackward<T, Rank>>
all_gather_replicated(const Tensor<T, Rank>& x, int dim, std::int64_t global_size,
                      const ProcessGroup& group) {
  auto [y, back] = autograd::all_gather_replicated(x, dim, global_size, group, async_op);
  return {y.wait(), std::move(back)};
}

// ---- Megatron's regions ----------------------------------------------------------------------------------
// Tensor parallelism: a column-parallel linear enters with copy_to (f) and a row-parallel one leaves with
// reduce_from (g); scatter_to / gather_from move between a replicated activation and its shards along the
// hidden (last) dim. Sequence parallelism: the activation between blocks is sharded along the sequence dim;
// gather_from_sequence on entry, reduce_scatter_to_sequence on exit.

/// Megatron's f: identity forward, all_reduce(sum) backward.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, CopyBackward<T, Rank>> copy_to(const Tensor<T, Rank>& x,
                                                             const ProcessGroup& group) {
  return autograd::copy(x, group);
}

/// Megatron's g: all_reduce(sum) forward, identity backward.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllReduceBackward<T, Rank>> reduce_from(const Tensor<T, Rank>& x,
                                                                      const ProcessGroup& group) {
  return autograd::all_reduce(x, group);
}

/// This member's chunk of a replicated x along `dim`; backward: all_gather.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, ChunkBackward<T, Rank>> scatter_to(const Tensor<T, Rank>& x,
                                                                 const ProcessGroup& group, int dim = -1) {
  return autograd::chunk(x, dim, group);
}

/// The members' chunks gathered along `dim` into a replicated tensor of `global_size` entries there;
/// backward: this member's chunk.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllGatherReplicatedBackward<T, Rank>>
gather_from(const Tensor<T, Rank>& x, std::int64_t global_size, const ProcessGroup& group, int dim = -1) {
  return autograd::all_gather_replicated(x, dim, global_size, group);
}

/// This member's chunk along the sequence dim; backward: all_gather.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, ChunkBackward<T, Rank>>
scatter_to_sequence(const Tensor<T, Rank>& x, const ProcessGroup& group, int dim = 0) {
  return autograd::chunk(x, dim, group);
}

/// The members' sequence chunks gathered (`global_size` entries along `dim`), entering a computation
/// that differs per member; backward: reduce_scatter(sum).
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, AllGatherBackward<T, Rank>>
gather_from_sequence(const Tensor<T, Rank>& x, std::int64_t global_size, const ProcessGroup& group,
                     int dim = 0) {
  return autograd::all_gather(x, dim, global_size, group);
}

/// This member's sequence chunk of the sum of the members' x; backward: all_gather.
template <class T, int Rank>
WithBackward<Tensor<T, Rank>, ReduceScatterBackward<T, Rank>>
reduce_scatter_to_sequence(const Tensor<T, Rank>& x, const ProcessGroup& group, int dim = 0) {
  return autograd::reduce_scatter(x, dim, group);
}

} // namespace dtensor::autograd
