#pragma once
// The plan executor: runs the steps of a redistribution plan (plan/planner.hpp) on one rank's local block.
// It is plain code over values — a Plan, an AnyTensor (dtype, device, shape, strides), a DeviceMeshBase —
// compiled once for every element type, tensor rank and mesh type; the typed DTensor calls it.
//
// Per step kind: compute the geometry (layout/exchange.hpp), stage what leaves this rank where it is not a
// contiguous range already, submit one op through the ProcessGroup front end (which counts it in
// CommDebugMode) on the step's group, and unpack on completion. Uneven and empty shards use the
// variable-size ops (counts and displacements), never padding: padding would move and reduce the pad
// elements too, and the exact sizes are known on every rank from the plan's geometry.
//
// Errors name the step: "redistribute [S(0),S(1)] -> [S(1),S(0)], step 1 of 1: permute(dp*tp), on mesh
// rank 3 at (1, 1), global (7, 5), local (4, 3): <what the group said>", with the original type
// (dtensor::TimeoutError stays a TimeoutError).

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dtensor/comm/process_group.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/partial_identity.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/plan/cost.hpp"
#include "dtensor/plan/planner.hpp"

namespace dtensor::exec {

/// Tests set this to make every buffer the executor allocates start as all-ones bytes (NaN for floating
/// types, -1 or the maximum for integers), so that elements a step forgets to write show up.
inline std::atomic<bool>& poison_buffers() noexcept {
  static std::atomic<bool> on{false};
  return on;
}

/// Options of an op the caller waits for at once.
inline CommOptions blocking() {
  CommOptions o;
  o.blocking = true;
  return o;
}

/// A new contiguous tensor like `like` (dtype, device, stream) of `shape`, poisoned when asked.
inline AnyTensor fresh(const AnyTensor& like, const Extents& shape) {
  AnyTensor t = like.new_empty(shape);
  if (poison_buffers().load(std::memory_order_relaxed) && t.numel() > 0) {
    unsigned char poison[8];
    std::memset(poison, 0xFF, sizeof poison);
    t.fill_bytes(poison);
  }
  return t;
}

/// A step in flight: `out` holds the result once `work` has been waited on.
struct StepRun {
  AnyTensor out;
  Work work;
};

namespace detail {

/// True when splitting `shape` along `d` gives pieces that are contiguous and in order in memory.
inline bool splits_contiguously(const Extents& shape, int d) {
  for (int k = 0; k < d; ++k) {
    if (shape[k] != 1) {
      return false;
    }
  }
  return true;
}

inline BufferRef buffer_of(const AnyTensor& t) {
  return BufferRef{t.data(), t.numel(), t.dtype(), t.device(), t.stream()};
}

/// A contiguous tensor as one 1-D buffer (a view of its elements, no copy): what a collective sends from or
/// receives into when the pieces lie in the tensor's own memory.
inline AnyTensor as_one_buffer(const AnyTensor& t) {
  return t.view(Extents{t.numel()});
}

/// One side of an exchange: per peer, where its piece moves from (or to). A piece that is a contiguous
/// range of the tensor moves straight from (into) the tensor's memory; the others go through one staging
/// buffer, packed in peer order. The piece a rank keeps is not here (copied region to region); its count
/// is 0.
struct Staged {
  AnyTensor staging;                ///< the packed pieces (undefined when none is)
  std::vector<BufferRef> at;        ///< per peer
  std::vector<Piece> packed;        ///< the pieces that live in `staging`
  AnyTensor base;                   ///< one-buffer form: the buffer every range of `at` lies in
  std::vector<std::int64_t> counts; ///< one-buffer form: element counts per peer
  std::vector<std::int64_t> displs; ///< one-buffer form: displacements in `base` per peer
};

/// Stages the pieces of `t` (holding `whole`) except `me`'s. `one_buffer`: every piece lies in one buffer
/// (a collective's flat send/receive buffer), so one non-contiguous piece stages them all; otherwise
/// (point-to-point) each piece decides alone.
inline Staged stage(const std::vector<Piece>& pieces, int k, int me, const AnyTensor& t, const Block& whole,
                    bool one_buffer) {
  Staged s;
  s.at.assign(k, BufferRef{nullptr, 0, t.dtype(), t.device(), t.stream()});
  std::int64_t staged = 0;
  for (const Piece& p : pieces) {
    if (p.peer == me) {
      continue;
    }
    const AnyTensor r = t.region(whole, p.block);
    if (r.is_contiguous() && r.numel() > 0) {
      s.at[p.peer] = buffer_of(r);
    } else if (r.numel() > 0) {
      s.packed.push_back(p);
      staged += r.numel();
    }
  }
  if (one_buffer && !s.packed.empty()) { // all of them then
    s.packed.clear();
    staged = 0;
    for (const Piece& p : pieces) {
      if (p.peer != me && numel(p.block.shape) > 0) {
        s.packed.push_back(p);
        staged += numel(p.block.shape);
      }
    }
  }
  if (staged > 0) {
    s.staging = fresh(t, Extents{staged});
  }
  const auto es = static_cast<std::int64_t>(t.element_size());
  std::int64_t at = 0;
  for (const Piece& p : s.packed) {
    const std::int64_t n = numel(p.block.shape);
    s.at[p.peer] =
        BufferRef{static_cast<char*>(s.staging.data()) + at * es, n, t.dtype(), t.device(), t.stream()};
    at += n;
  }
  if (one_buffer) {
    s.base = s.packed.empty() ? as_one_buffer(t) : s.staging;
    s.counts.assign(k, 0);
    s.displs.assign(k, 0);
    for (int q = 0; q < k; ++q) {
      if (s.at[q].count > 0) {
        s.counts[q] = s.at[q].count;
        s.displs[q] = (static_cast<char*>(s.at[q].data) - static_cast<char*>(s.base.data())) / es;
      }
    }
  }
  return s;
}

/// The staging view of a packed piece, shaped as its block.
inline AnyTensor staged_view(const Staged& s, const Piece& p) {
  const auto es = static_cast<std::int64_t>(s.staging.element_size());
  const std::int64_t at = (static_cast<char*>(s.at[p.peer].data) - static_cast<char*>(s.staging.data())) / es;
  return s.staging.narrow(0, at, s.at[p.peer].count).view(p.block.shape);
}

/// In place when nothing else holds the memory of `in` (an intermediate of the plan, or the block of a
/// DTensor redistributed as an rvalue); else a copy, leaving `in` as it was.
inline AnyTensor writable(AnyTensor in) {
  const bool sole_owner = in.storage() != nullptr && in.storage().use_count() == 1 && in.is_contiguous();
  return sole_owner ? in : in.clone();
}

/// The pieces of `whole` that the members of a group of `n` hold along dim `d` (torch.chunk), laid out
/// one after the other in member order: counts and displacements in elements.
struct MemberPieces {
  std::vector<std::int64_t> counts;
  std::vector<std::int64_t> displs;
  std::vector<Block> blocks;

  MemberPieces(const Block& whole, int d, int n) : counts(n), displs(n), blocks(n, whole) {
    std::int64_t at = 0;
    for (int m = 0; m < n; ++m) {
      blocks[m].offset[d] += chunk_offset(whole.shape[d], n, m);
      blocks[m].shape[d] = chunk_size(whole.shape[d], n, m);
      counts[m] = numel(blocks[m].shape);
      displs[m] = at;
      at += counts[m];
    }
  }
  /// Member m's piece inside the packed buffer, shaped as its block.
  AnyTensor view(const AnyTensor& packed, int m) const {
    return packed.narrow(0, displs[m], counts[m]).view(blocks[m].shape);
  }
};

inline StepRun gather_or_scatter(const Step& st, AnyTensor in, const Block& before, const Block& after,
                                 const DeviceMeshBase& mesh, const CommOptions& opts) {
  const bool gather = st.kind == StepKind::all_gather;
  const int a = st.axis();
  const int d = gather ? st.src_dim : st.dst_dim;
  const int n = mesh.size(a);
  const ProcessGroup& g = mesh.group(a);
  const Block& whole = gather ? after : before; // the block the group's pieces tile
  MemberPieces pieces(whole, d, n);
  const bool direct = splits_contiguously(whole.shape, d);
  const AnyTensor full_side = gather ? fresh(in, after.shape) : in;
  const AnyTensor packed = direct ? as_one_buffer(full_side) : fresh(in, Extents{numel(whole.shape)});
  if (gather) {
    auto impl = g.all_gather(buffer_of(in), buffer_of(packed), pieces.counts, pieces.displs, opts);
    if (direct) {
      return {full_side, Work(impl, std::make_shared<std::pair<AnyTensor, AnyTensor>>(in, full_side))};
    }
    auto unpack = [full_side, whole, packed, pieces = std::move(pieces), n]() {
      for (int m = 0; m < n; ++m) {
        if (pieces.counts[m] > 0) {
          full_side.region(whole, pieces.blocks[m]).copy_from(pieces.view(packed, m));
        }
      }
    };
    return {full_side, Work(impl, std::make_shared<AnyTensor>(in), std::move(unpack))};
  }
  if (!direct) {
    for (int m = 0; m < n; ++m) {
      if (pieces.counts[m] > 0) {
        pieces.view(packed, m).copy_from(in.region(whole, pieces.blocks[m]));
      }
    }
  }
  AnyTensor out = fresh(in, after.shape);
  auto impl = g.reduce_scatter(buffer_of(packed), buffer_of(out), pieces.counts, pieces.displs, st.op, opts);
  return {out, Work(impl, std::make_shared<std::vector<AnyTensor>>(std::vector<AnyTensor>{in, packed, out}))};
}

inline StepRun exchange(const Step& st, const AnyTensor& in, const Block& before, const Block& after,
                        const Extents& global, const DeviceMeshBase& mesh, const CommOptions& opts) {
  const ProcessGroup& g = mesh.group_over(st.axes);
  const int me = g.rank();
  const int k = g.size();
  std::vector<Piece> sends;
  std::vector<Piece> recvs;
  exchange_pieces(st, global, mesh.sizes(), mesh.coordinate(), sends, recvs);
  AnyTensor out = fresh(in, after.shape);
  // Pieces move straight from `in` / into `out` where they are contiguous ranges there (e.g. the split
  // dim is the leading one); otherwise through staging buffers. The piece this rank keeps is copied
  // directly.
  const bool one_buffer = st.kind == StepKind::all_to_all;
  Staged send = stage(sends, k, me, in, before, one_buffer);
  Staged recv = stage(recvs, k, me, out, after, one_buffer);
  for (const Piece& p : send.packed) {
    staged_view(send, p).copy_from(in.region(before, p.block));
  }
  for (const Piece& s : sends) {
    for (const Piece& r : recvs) {
      if (s.peer == me && r.peer == me) {
        out.region(after, r.block).copy_from(in.region(before, s.block));
      }
    }
  }
  std::shared_ptr<WorkImpl> impl;
  if (one_buffer) {
    impl = g.all_to_all(buffer_of(send.base), send.counts, send.displs, buffer_of(recv.base), recv.counts,
                        recv.displs, opts);
  } else {
    // Only the pairs that exchange data take part.
    std::vector<P2PRequest> requests;
    for (const Piece& p : recvs) {
      if (p.peer != me && recv.at[p.peer].count > 0) {
        requests.push_back({P2PRequest::Kind::recv, recv.at[p.peer], p.peer, 0});
      }
    }
    for (const Piece& p : sends) {
      if (p.peer != me && send.at[p.peer].count > 0) {
        requests.push_back({P2PRequest::Kind::send, send.at[p.peer], p.peer, 0});
      }
    }
    impl = g.p2p(requests, opts, "permute");
  }
  auto keep = std::make_shared<std::pair<AnyTensor, AnyTensor>>(in, send.staging);
  auto unpack = [out, recv = std::move(recv), after]() {
    for (const Piece& p : recv.packed) {
      out.region(after, p.block).copy_from(staged_view(recv, p));
    }
  };
  return {out, Work(std::move(impl), std::move(keep), std::move(unpack))};
}

} // namespace detail

/// "redistribute [S(0),S(1)] -> [S(1),S(0)], step 1 of 1: permute(dp*tp), on mesh rank 3 at (1, 1),
/// global (7, 5), local (4, 3): " — the prefix of an error raised in step `i`.
DTENSOR_COLD inline std::string step_context(const Plan& plan, int i, const DeviceMeshBase& mesh,
                                             const Extents& global, const Extents& local) {
  const std::string coord = dtensor::detail::format_list(mesh.coordinate(), ", ", "(", ")");
  return "redistribute " + to_string(plan.src) + " -> " + to_string(plan.dst) + ", step " +
         std::to_string(i + 1) + " of " + std::to_string(plan.size()) + ": " +
         to_string(plan.steps[i], mesh.names(), plan.src.mesh_rank()) + ", on mesh rank " +
         std::to_string(mesh.rank()) + " at " + coord + ", global " + AnyTensor::to_string(global) +
         ", local " + AnyTensor::to_string(local) + ": ";
}

/// Rethrows the exception in flight with `context` in front of its message, keeping dtensor's types.
[[noreturn]] DTENSOR_COLD inline void rethrow_with(const std::string& context) {
  try {
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(context + e.what());
  } catch (const Error& e) {
    throw Error(context + e.what());
  }
}

/// Submits step `i` of `plan` on this rank's block `in` (contiguous, the step's source block of `global`).
/// Synchronous unless `async`; either way the result is in `out` once `work` was waited on.
inline StepRun submit_step(const Plan& plan, int i, AnyTensor in, const Extents& global,
                           const DeviceMeshBase& mesh, bool async) {
  const Step& st = plan.steps[i];
  try {
    const Block before = spec_block(global, st.before, mesh.sizes(), mesh.coordinate());
    const Block after = spec_block(global, st.after, mesh.sizes(), mesh.coordinate());
    CommOptions opts;
    opts.blocking = !async;
    if ((st.axes & ~mesh.unit_axes()) == 0) {
      // Every axis of the step has size 1, a size its plan did not know (a backward's dual, planned for
      // the nominal sizes): this rank's block is the same before and after, and there is nobody to
      // exchange with. make_plan plans no step over an axis it knows to have size 1.
      return {std::move(in), Work()};
    }
    switch (st.kind) {
    case StepKind::local_partial: {
      if (!holds_value(Placement::partial(st.op), mesh.coordinate()[st.axis()])) {
        AnyTensor out = in.new_empty(after.shape);
        fill_identity(out, st.op);
        return {out, Work()};
      }
      return {std::move(in), Work()};
    }
    case StepKind::local_chunk: {
      const int d = st.dst_dim;
      const AnyTensor chunk = in.narrow(d, after.offset[d] - before.offset[d], after.shape[d]);
      return {chunk.is_contiguous() ? chunk : chunk.clone(), Work()};
    }
    case StepKind::all_reduce: {
      AnyTensor out = detail::writable(std::move(in));
      auto impl = mesh.group_over(st.axes).all_reduce(detail::buffer_of(out), st.op, opts);
      return {out, Work(impl, std::make_shared<AnyTensor>(out))};
    }
    case StepKind::reduce_scatter:
    case StepKind::all_gather:
      return detail::gather_or_scatter(st, std::move(in), before, after, mesh, opts);
    case StepKind::all_to_all:
    case StepKind::permute:
      return detail::exchange(st, in, before, after, global, mesh, opts);
    }
    throw Error("unknown step kind");
  } catch (const Error&) {
    rethrow_with(step_context(plan, i, mesh, global, in.shape()));
  }
}

/// Waits for a step in flight, naming the step in an error.
inline AnyTensor finish_step(const Plan& plan, int i, StepRun run, const Extents& global,
                             const DeviceMeshBase& mesh) {
  try {
    run.work.wait();
  } catch (const Error&) {
    rethrow_with(step_context(plan, i, mesh, global, run.out.shape()));
  }
  return std::move(run.out);
}

/// Runs steps [first, plan.size()) synchronously, starting from `local`.
inline AnyTensor run_steps(const Plan& plan, int first, AnyTensor local, const Extents& global,
                           const DeviceMeshBase& mesh) {
  for (int i = first; i < plan.size(); ++i) {
    local = finish_step(plan, i, submit_step(plan, i, std::move(local), global, mesh, false), global, mesh);
  }
  return local;
}

/// Asynchronous start: runs the local steps before the first communicating one, submits that one
/// asynchronously and returns it with the index of the next step (plan.size() when nothing is in flight).
struct Started {
  StepRun run;
  int in_flight = -1; ///< the index of the step in flight, -1 when none
};
inline Started start_steps(const Plan& plan, AnyTensor local, const Extents& global,
                           const DeviceMeshBase& mesh) {
  int i = 0;
  for (; i < plan.size() && !plan.steps[i].communicates(); ++i) {
    local = finish_step(plan, i, submit_step(plan, i, std::move(local), global, mesh, false), global, mesh);
  }
  if (i == plan.size()) {
    return {{std::move(local), Work()}, -1};
  }
  return {submit_step(plan, i, std::move(local), global, mesh, true), i};
}

/// Finishes what start_steps began: waits for the step in flight and runs the rest.
inline AnyTensor finish_steps(const Plan& plan, Started started, const Extents& global,
                              const DeviceMeshBase& mesh) {
  if (started.in_flight < 0) {
    return std::move(started.run.out);
  }
  AnyTensor local = finish_step(plan, started.in_flight, std::move(started.run), global, mesh);
  return run_steps(plan, started.in_flight + 1, std::move(local), global, mesh);
}

} // namespace dtensor::exec
