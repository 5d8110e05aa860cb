#pragma once
// Collectives with torch.distributed's names, argument order and semantics: in place and synchronous by
// default; pass `dtensor::async_op` last to get a Work instead (results are in the tensors after
// work.wait()). Every member of `group` calls each collective in the same order with matching shapes.
// Tensors must be contiguous and, on gloo, on the host. Arguments one rank can check (sizes for the group,
// ranks in range, split sizes) are checked before any communication: dtensor::Error naming the op, the
// group and the sizes. Communication failures (a member that never arrives: dtensor::TimeoutError after
// group.timeout(); a member that failed: dtensor::Error within seconds) are thrown by the call, or by
// wait() for async ops.
//
//   dtensor::all_reduce(grad, dtensor::ReduceOp::avg, dp);                 // in place
//   dtensor::all_gather_into_tensor(full, shard, tp);                      // [tp*k, n] <- [k, n]
//   auto w = dtensor::reduce_scatter_tensor(shard, full, dtensor::ReduceOp::sum, tp, dtensor::async_op);
//   w.wait();
//
// ReduceOp::avg is sum then division by the group size; integer types divide with truncation toward zero
// (as NCCL's integer ncclAvg does).

#include "dtensor/comm/backend_call.hpp"

#include <chrono>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

namespace dtensor {

// ---- all_reduce / reduce / broadcast ------------------------------------------------------------------

/// In place: tensor = op over every member's tensor.
template <class T, int Rank>
Work all_reduce(const Tensor<T, Rank>& tensor, ReduceOp op, const ProcessGroup& group, AsyncOp) {
  auto buf = detail::comm_buffer(tensor, group, "all_reduce", "");
  const ProcessGroup& b = group;
  return detail::launch(
      true, [&](const CommOptions& o) { return b.all_reduce(buf, op, o); }, detail::keep_alive(tensor));
}
template <class T, int Rank>
void all_reduce(const Tensor<T, Rank>& tensor, ReduceOp op, const ProcessGroup& group) {
  auto buf = detail::comm_buffer(tensor, group, "all_reduce", "");
  const ProcessGroup& b = group;
  detail::launch(false, [&](const CommOptions& o) { return b.all_reduce(buf, op, o); });
}

/// In place on `dst` (a group rank): tensor = op over every member's tensor; other members' tensors are
/// left unchanged.
template <class T, int Rank>
Work reduce(const Tensor<T, Rank>& tensor, int dst, ReduceOp op, const ProcessGroup& group, AsyncOp) {
  auto buf = detail::comm_buffer(tensor, group, "reduce", "");
  const ProcessGroup& b = group;
  return detail::launch(
      true, [&](const CommOptions& o) { return b.reduce(buf, dst, op, o); }, detail::keep_alive(tensor));
}
template <class T, int Rank>
void reduce(const Tensor<T, Rank>& tensor, int dst, ReduceOp op, const ProcessGroup& group) {
  auto buf = detail::comm_buffer(tensor, group, "reduce", "");
  const ProcessGroup& b = group;
  detail::launch(false, [&](const CommOptions& o) { return b.reduce(buf, dst, op, o); });
}

/// In place: tensor = tensor of `src` (a group rank).
template <class T, int Rank>
Work broadcast(const Tensor<T, Rank>& tensor, int src, const ProcessGroup& group, AsyncOp) {
  auto buf = detail::comm_buffer(tensor, group, "broadcast", "");
  const ProcessGroup& b = group;
  return detail::launch(
      true, [&](const CommOptions& o) { return b.broadcast(buf, src, o); }, detail::keep_alive(tensor));
}
template <class T, int Rank>
void broadcast(const Tensor<T, Rank>& tensor, int src, const ProcessGroup& group) {
  auto buf = detail::comm_buffer(tensor, group, "broadcast", "");
  const ProcessGroup& b = group;
  detail::launch(false, [&](const CommOptions& o) { return b.broadcast(buf, src, o); });
}

// ---- all_gather_into_tensor / reduce_scatter_tensor ---------------------------------------------------

namespace detail {

/// `big` is [size * k, ...rest] (same rank as `small`, concatenated) or [size, k, ...rest] (one more dim,
/// stacked) for `small` = [k, ...rest].
template <class T, int RBig, int RSmall>
void check_blocks(const Tensor<T, RBig>& big, const Tensor<T, RSmall>& small, const ProcessGroup& group,
                  const char* op, const char* big_name, const char* small_name) {
  const int n = group.size();
  bool ok = big.numel() == small.numel() * n;
  if constexpr (RBig == RSmall && RBig > 0) {
    ok = ok && big.shape(0) == small.shape(0) * n;
    for (int d = 1; d < RBig; ++d) {
      ok = ok && big.shape(d) == small.shape(d);
    }
  } else if constexpr (RBig == RSmall + 1) {
    ok = ok && big.shape(0) == n;
    for (int d = 0; d < RSmall; ++d) {
      ok = ok && big.shape(d + 1) == small.shape(d);
    }
  } else {
    static_assert(
        RBig == RSmall || RBig == RSmall + 1,
        "the gathered tensor must have the rank of the shard (concatenated along dim 0) or one more "
        "(stacked along a new dim 0)");
  }
  DTENSOR_CHECK(ok, op_context(group, op) + ": the " + big_name + " has shape " +
                        shape_to_string(big.shape()) + " but the " + small_name + " has shape " +
                        shape_to_string(small.shape()) + "; for a group of " + std::to_string(n) + " the " +
                        big_name + " must be [" + std::to_string(n) + " * dim 0, ...] or [" +
                        std::to_string(n) + ", ...shape]");
}

template <class T, int RO, int RI>
Work all_gather_into_tensor_impl(const Tensor<T, RO>& output, const Tensor<T, RI>& input,
                                 const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  auto out = comm_buffer(output, group, "all_gather_into_tensor", "output");
  auto in = comm_buffer(input, group, "all_gather_into_tensor", "input");
  check_blocks(output, input, group, "all_gather_into_tensor", "output", "input");
  std::vector<std::int64_t> counts(group.size(), input.numel());
  auto displs = displacements(counts);
  return launch(
      async, [&](const CommOptions& o) { return b.all_gather(in, out, counts, displs, o); },
      async ? keep_alive(output, input) : nullptr);
}

template <class T, int RO, int RI>
Work reduce_scatter_tensor_impl(const Tensor<T, RO>& output, const Tensor<T, RI>& input, ReduceOp op,
                                const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  auto out = comm_buffer(output, group, "reduce_scatter_tensor", "output");
  auto in = comm_buffer(input, group, "reduce_scatter_tensor", "input");
  check_blocks(input, output, group, "reduce_scatter_tensor", "input", "output");
  std::vector<std::int64_t> counts(group.size(), output.numel());
  auto displs = displacements(counts);
  return launch(
      async, [&](const CommOptions& o) { return b.reduce_scatter(in, out, counts, displs, op, o); },
      async ? keep_alive(output, input) : nullptr);
}

} // namespace detail

/// output = the inputs of members 0..n-1 concatenated along dim 0 ([n*k, ...] from [k, ...]) or stacked
/// ([n, k, ...]).
template <class T, int RO, int RI>
void all_gather_into_tensor(const Tensor<T, RO>& output, const Tensor<T, RI>& input,
                            const ProcessGroup& group) {
  detail::all_gather_into_tensor_impl(output, input, group, false);
}
template <class T, int RO, int RI>
Work all_gather_into_tensor(const Tensor<T, RO>& output, const Tensor<T, RI>& input,
                            const ProcessGroup& group, AsyncOp) {
  return detail::all_gather_into_tensor_impl(output, input, group, true);
}

/// output ([k, ...]) = op over members of block `rank` of their input ([n*k, ...] or [n, k, ...]).
template <class T, int RO, int RI>
void reduce_scatter_tensor(const Tensor<T, RO>& output, const Tensor<T, RI>& input, ReduceOp op,
                           const ProcessGroup& group) {
  detail::reduce_scatter_tensor_impl(output, input, op, group, false);
}
template <class T, int RO, int RI>
Work reduce_scatter_tensor(const Tensor<T, RO>& output, const Tensor<T, RI>& input, ReduceOp op,
                           const ProcessGroup& group, AsyncOp) {
  return detail::reduce_scatter_tensor_impl(output, input, op, group, true);
}

// ---- list forms: all_gather / reduce_scatter ----------------------------------------------------------

namespace detail {

template <class T, int Rank>
Work all_gather_impl(const std::vector<Tensor<T, Rank>>& outputs, const Tensor<T, Rank>& input,
                     const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  const int n = group.size();
  DTENSOR_CHECK(outputs.size() == static_cast<std::size_t>(n),
                op_context(group, "all_gather") + ": " + std::to_string(outputs.size()) +
                    " output tensors for a group of " + std::to_string(n));
  auto in = comm_buffer(input, group, "all_gather", "input");
  std::vector<std::int64_t> counts(n);
  for (int i = 0; i < n; ++i) {
    comm_buffer(outputs[i], group, "all_gather", "output");
    counts[i] = outputs[i].numel();
  }
  DTENSOR_CHECK(counts[group.rank()] == input.numel(),
                op_context(group, "all_gather") + ": output " + std::to_string(group.rank()) + " has " +
                    std::to_string(counts[group.rank()]) + " elements but the input " +
                    shape_to_string(input.shape()) + " has " + std::to_string(input.numel()));
  auto displs = displacements(counts);
  auto staging = Tensor<T, 1>({displs.back() + counts.back()}, input.device());
  auto out = comm_buffer(staging, group, "all_gather", "staging");
  auto finish = [outputs, staging, displs] {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      copy_from_flat(outputs[i], staging, displs[i]);
    }
  };
  return launch(
      async, [&](const CommOptions& o) { return b.all_gather(in, out, counts, displs, o); },
      keep_alive(input, staging), finish);
}

template <class T, int Rank>
Work reduce_scatter_impl(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& inputs,
                         ReduceOp op, const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  const int n = group.size();
  DTENSOR_CHECK(inputs.size() == static_cast<std::size_t>(n),
                op_context(group, "reduce_scatter") + ": " + std::to_string(inputs.size()) +
                    " input tensors for a group of " + std::to_string(n));
  auto out = comm_buffer(output, group, "reduce_scatter", "output");
  std::vector<std::int64_t> counts(n);
  for (int i = 0; i < n; ++i) {
    comm_buffer(inputs[i], group, "reduce_scatter", "input");
    counts[i] = inputs[i].numel();
  }
  DTENSOR_CHECK(counts[group.rank()] == output.numel(),
                op_context(group, "reduce_scatter") + ": input " + std::to_string(group.rank()) + " has " +
                    std::to_string(counts[group.rank()]) + " elements but the output " +
                    shape_to_string(output.shape()) + " has " + std::to_string(output.numel()));
  auto displs = displacements(counts);
  auto staging = Tensor<T, 1>({displs.back() + counts.back()}, output.device());
  for (int i = 0; i < n; ++i) {
    copy_to_flat(staging, displs[i], inputs[i]);
  }
  auto in = comm_buffer(staging, group, "reduce_scatter", "staging");
  return launch(
      async, [&](const CommOptions& o) { return b.reduce_scatter(in, out, counts, displs, op, o); },
      keep_alive(output, staging));
}

} // namespace detail

/// outputs[i] = input of member i. Sizes may differ per member (outputs[i] sized for member i).
template <class T, int Rank>
void all_gather(const std::vector<Tensor<T, Rank>>& outputs, const Tensor<T, Rank>& input,
                const ProcessGroup& group) {
  detail::all_gather_impl(outputs, input, group, false);
}
template <class T, int Rank>
Work all_gather(const std::vector<Tensor<T, Rank>>& outputs, const Tensor<T, Rank>& input,
                const ProcessGroup& group, AsyncOp) {
  return detail::all_gather_impl(outputs, input, group, true);
}

/// output = op over members m of their inputs[rank]. Sizes may differ per block.
template <class T, int Rank>
void reduce_scatter(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& inputs, ReduceOp op,
                    const ProcessGroup& group) {
  detail::reduce_scatter_impl(output, inputs, op, group, false);
}
template <class T, int Rank>
Work reduce_scatter(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& inputs, ReduceOp op,
                    const ProcessGroup& group, AsyncOp) {
  return detail::reduce_scatter_impl(output, inputs, op, group, true);
}

// ---- all_to_all_single / all_to_all ----------------------------------------------------------------------

namespace detail {

/// Dim-0 split sizes -> element counts; empty = equal splits of `rows`.
inline std::vector<std::int64_t> split_counts(std::span<const std::int64_t> splits, std::int64_t rows,
                                              std::int64_t row, const ProcessGroup& group,
                                              const char* which) {
  const int n = group.size();
  std::vector<std::int64_t> counts(n);
  if (splits.empty()) {
    DTENSOR_CHECK(rows % n == 0, op_context(group, "all_to_all_single") + ": the " + which + " has " +
                                     std::to_string(rows) +
                                     " rows in dim 0, not divisible by the group size " + std::to_string(n) +
                                     "; pass split sizes");
    for (auto& c : counts) {
      c = rows / n * row;
    }
    return counts;
  }
  DTENSOR_CHECK(splits.size() == static_cast<std::size_t>(n),
                op_context(group, "all_to_all_single") + ": " + which + " split sizes " +
                    format_list(splits, ", ") + " have " + std::to_string(splits.size()) +
                    " entries for a group of " + std::to_string(n));
  std::int64_t total = 0;
  for (std::size_t i = 0; i < splits.size(); ++i) {
    DTENSOR_CHECK(splits[i] >= 0, op_context(group, "all_to_all_single") + ": negative " + which +
                                      " split size in " + format_list(splits, ", "));
    total += splits[i];
    counts[i] = splits[i] * row;
  }
  DTENSOR_CHECK(total == rows, op_context(group, "all_to_all_single") + ": " + which + " split sizes " +
                                   format_list(splits, ", ") + " sum to " + std::to_string(total) +
                                   " but the " + which + " has " + std::to_string(rows) + " rows in dim 0");
  return counts;
}

template <class T, int Rank>
Work all_to_all_single_impl(const Tensor<T, Rank>& output, const Tensor<T, Rank>& input,
                            std::span<const std::int64_t> output_split_sizes,
                            std::span<const std::int64_t> input_split_sizes, const ProcessGroup& group,
                            bool async) {
  static_assert(Rank >= 1, "all_to_all_single splits dim 0: the tensors need rank >= 1");
  const ProcessGroup& b = group;
  auto out = comm_buffer(output, group, "all_to_all_single", "output");
  auto in = comm_buffer(input, group, "all_to_all_single", "input");
  const auto row = row_elements(input.shape());
  DTENSOR_CHECK(row_elements(output.shape()) == row,
                op_context(group, "all_to_all_single") + ": output " + shape_to_string(output.shape()) +
                    " and input " + shape_to_string(input.shape()) + " differ beyond dim 0");
  auto sc = split_counts(input_split_sizes, input.shape(0), row, group, "input");
  auto rc = split_counts(output_split_sizes, output.shape(0), row, group, "output");
  auto sd = displacements(sc), rd = displacements(rc);
  return launch(
      async, [&](const CommOptions& o) { return b.all_to_all(in, sc, sd, out, rc, rd, o); },
      async ? keep_alive(output, input) : nullptr);
}

template <class T, int Rank>
Work all_to_all_impl(const std::vector<Tensor<T, Rank>>& outputs, const std::vector<Tensor<T, Rank>>& inputs,
                     const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  const int n = group.size();
  DTENSOR_CHECK(outputs.size() == static_cast<std::size_t>(n) && inputs.size() == static_cast<std::size_t>(n),
                op_context(group, "all_to_all") + ": " + std::to_string(outputs.size()) + " outputs and " +
                    std::to_string(inputs.size()) + " inputs for a group of " + std::to_string(n));
  std::vector<std::int64_t> sc(n), rc(n);
  for (int i = 0; i < n; ++i) {
    comm_buffer(inputs[i], group, "all_to_all", "input");
    comm_buffer(outputs[i], group, "all_to_all", "output");
    sc[i] = inputs[i].numel();
    rc[i] = outputs[i].numel();
  }
  auto sd = displacements(sc), rd = displacements(rc);
  auto device = inputs[0].device();
  auto send = Tensor<T, 1>({sd.back() + sc.back()}, device);
  auto recv = Tensor<T, 1>({rd.back() + rc.back()}, device);
  for (int i = 0; i < n; ++i) {
    copy_to_flat(send, sd[i], inputs[i]);
  }
  auto in = comm_buffer(send, group, "all_to_all", "staging");
  auto out = comm_buffer(recv, group, "all_to_all", "staging");
  auto finish = [outputs, recv, rd] {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      copy_from_flat(outputs[i], recv, rd[i]);
    }
  };
  return launch(
      async, [&](const CommOptions& o) { return b.all_to_all(in, sc, sd, out, rc, rd, o); },
      keep_alive(send, recv), finish);
}

} // namespace detail

/// Splits input along dim 0 into group-size equal parts, sends part i to member i, and concatenates the
/// parts received (in rank order) into output.
template <class T, int Rank>
void all_to_all_single(const Tensor<T, Rank>& output, const Tensor<T, Rank>& input,
                       const ProcessGroup& group) {
  detail::all_to_all_single_impl(output, input, {}, {}, group, false);
}
template <class T, int Rank>
Work all_to_all_single(const Tensor<T, Rank>& output, const Tensor<T, Rank>& input, const ProcessGroup& group,
                       AsyncOp) {
  return detail::all_to_all_single_impl(output, input, {}, {}, group, true);
}
/// With explicit dim-0 split sizes (rows to receive from / send to each member; empty = equal).
template <class T, int Rank>
void all_to_all_single(const Tensor<T, Rank>& output, const Tensor<T, Rank>& input,
                       std::span<const std::int64_t> output_split_sizes,
                       std::span<const std::int64_t> input_split_sizes, const ProcessGroup& group) {
  detail::all_to_all_single_impl(output, input, output_split_sizes, input_split_sizes, group, false);
}
template <class T, int Rank>
Work all_to_all_single(const Tensor<T, Rank>& output, const Tensor<T, Rank>& input,
                       std::span<const std::int64_t> output_split_sizes,
                       std::span<const std::int64_t> input_split_sizes, const ProcessGroup& group, AsyncOp) {
  return detail::all_to_all_single_impl(output, input, output_split_sizes, input_split_sizes, group, true);
}

/// outputs[i] = inputs[rank] of member i. Sizes may differ per pair.
template <class T, int Rank>
void all_to_all(const std::vector<Tensor<T, Rank>>& outputs, const std::vector<Tensor<T, Rank>>& inputs,
                const ProcessGroup& group) {
  detail::all_to_all_impl(outputs, inputs, group, false);
}
template <class T, int Rank>
Work all_to_all(const std::vector<Tensor<T, Rank>>& outputs, const std::vector<Tensor<T, Rank>>& inputs,
                const ProcessGroup& group, AsyncOp) {
  return detail::all_to_all_impl(outputs, inputs, group, true);
}

// ---- gather / scatter / barrier ---------------------------------------------------------------------------

namespace detail {

template <class T, int Rank>
Work gather_impl(const Tensor<T, Rank>& input,
                 std::type_identity_t<const std::vector<Tensor<T, Rank>>*> gather_list, int dst,
                 const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  const int n = group.size();
  auto in = comm_buffer(input, group, "gather", "input");
  DTENSOR_CHECK(dst >= 0 && dst < n, op_context(group, "gather") + ": dst " + std::to_string(dst) +
                                         " is out of range for a group of " + std::to_string(n));
  if (group.rank() != dst) {
    return launch(
        async, [&](const CommOptions& o) { return b.gather(in, {}, dst, o); }, keep_alive(input));
  }
  DTENSOR_CHECK(gather_list != nullptr && gather_list->size() == static_cast<std::size_t>(n),
                op_context(group, "gather") + ": dst " + std::to_string(dst) + " needs a gather list of " +
                    std::to_string(n) + " tensors, got " +
                    (gather_list ? std::to_string(gather_list->size()) : std::string("none")));
  std::vector<BufferRef> blocks(n);
  for (int i = 0; i < n; ++i) { // received in place: the list's tensors are the receive buffers
    blocks[i] = comm_buffer((*gather_list)[i], group, "gather", "output");
  }
  return launch(
      async, [&](const CommOptions& o) { return b.gather(in, blocks, dst, o); },
      async ? keep_alive(input, *gather_list) : nullptr);
}

template <class T, int Rank>
Work scatter_impl(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& scatter_list, int src,
                  const ProcessGroup& group, bool async) {
  const ProcessGroup& b = group;
  const int n = group.size();
  auto out = comm_buffer(output, group, "scatter", "output");
  DTENSOR_CHECK(src >= 0 && src < n, op_context(group, "scatter") + ": src " + std::to_string(src) +
                                         " is out of range for a group of " + std::to_string(n));
  if (group.rank() != src) {
    return launch(
        async, [&](const CommOptions& o) { return b.scatter({}, out, src, o); }, keep_alive(output));
  }
  DTENSOR_CHECK(scatter_list.size() == static_cast<std::size_t>(n),
                op_context(group, "scatter") + ": src " + std::to_string(src) + " needs a scatter list of " +
                    std::to_string(n) + " tensors, got " + std::to_string(scatter_list.size()));
  std::vector<BufferRef> blocks(n);
  for (int i = 0; i < n; ++i) { // sent in place: no staging copy
    blocks[i] = comm_buffer(scatter_list[i], group, "scatter", "input");
  }
  return launch(
      async, [&](const CommOptions& o) { return b.scatter(blocks, out, src, o); },
      async ? keep_alive(output, scatter_list) : nullptr);
}

} // namespace detail

/// On `dst`: (*gather_list)[i] = input of member i. Other members pass nullptr (or anything: ignored).
template <class T, int Rank>
void gather(const Tensor<T, Rank>& input,
            std::type_identity_t<const std::vector<Tensor<T, Rank>>*> gather_list, int dst,
            const ProcessGroup& group) {
  detail::gather_impl(input, gather_list, dst, group, false);
}
template <class T, int Rank>
Work gather(const Tensor<T, Rank>& input,
            std::type_identity_t<const std::vector<Tensor<T, Rank>>*> gather_list, int dst,
            const ProcessGroup& group, AsyncOp) {
  return detail::gather_impl(input, gather_list, dst, group, true);
}

/// output = scatter_list[rank] of `src`. Other members pass an empty list (ignored).
template <class T, int Rank>
void scatter(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& scatter_list, int src,
             const ProcessGroup& group) {
  detail::scatter_impl(output, scatter_list, src, group, false);
}
template <class T, int Rank>
Work scatter(const Tensor<T, Rank>& output, const std::vector<Tensor<T, Rank>>& scatter_list, int src,
             const ProcessGroup& group, AsyncOp) {
  return detail::scatter_impl(output, scatter_list, src, group, true);
}

/// Returns once every member called it.
inline void barrier(const ProcessGroup& group) {
  const ProcessGroup& b = group;
  detail::launch(false, [&](const CommOptions& o) { return b.barrier(o); });
}
/// A barrier that names the members that did not arrive within `timeout` (zero: the group's timeout):
/// TimeoutError "monitored_barrier #0: rank 2 (global 2) did not arrive within 500 ms" on every member that
/// came (torch's monitored_barrier with wait_all_ranks=True). Meets through the group's store, so it works
/// even when the backend's communicator is stuck; slower than barrier(), for debugging.
inline void monitored_barrier(const ProcessGroup& group,
                              std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
  group.monitored_barrier(timeout);
}

inline Work barrier(const ProcessGroup& group, AsyncOp) {
  const ProcessGroup& b = group;
  return detail::launch(true, [&](const CommOptions& o) { return b.barrier(o); });
}

} // namespace dtensor
