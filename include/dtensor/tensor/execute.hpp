#pragma once
// The plan executor: runs the steps of a redistribution plan on one rank's local tensor.
//
// One function per step kind, each: compute the geometry (plan/exchange.hpp), pack what leaves this rank
// into contiguous buffers, submit one backend op on the step's group, and unpack on completion. Packing
// is skipped where the layout is already contiguous in member order (the split dim is the leading
// non-trivial dim). Uneven and empty shards use the backends' variable-size ops (counts and
// displacements), never padding: padding would move and reduce the pad elements too, and the exact
// sizes are known on every rank from the plan's geometry.
//
// Every local copy and fill (packing, unpacking, local chunks, Partial identities, poisoned buffers) goes
// through tensor/local_ops.hpp: Thrust kernels on CUDA tensors in nvcc translation units, Thrust's cpp
// system (or a plain loop) on host tensors.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "dtensor/comm/detail.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/layout.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/plan/exchange.hpp"
#include "dtensor/plan/planner.hpp"
#include "dtensor/tensor/comm_debug.hpp"
#include "dtensor/tensor/local_ops.hpp"

namespace dtensor::detail {

/// Tests set this to make every buffer the executor allocates start as all-ones bytes (NaN for floating
/// types, -1 or the maximum for integers), so that elements a step forgets to write show up.
inline std::atomic<bool>& poison_buffers() noexcept {
  static std::atomic<bool> on{false};
  return on;
}

/// A new tensor for a step's output or staging buffer (poisoned when poison_buffers() is set).
template <class T, int R>
Tensor<T, R> fresh(const std::array<std::int64_t, R>& shape, Device dev) {
  Tensor<T, R> t(shape, dev);
  if (poison_buffers().load(std::memory_order_relaxed) && t.numel() > 0) {
    T poison;
    std::memset(static_cast<void*>(&poison), 0xFF, sizeof poison);
    local_ops::fill(t, poison);
  }
  return t;
}

template <int R>
std::array<std::int64_t, R> to_array(const Extents& e) {
  std::array<std::int64_t, R> a{};
  for (int d = 0; d < R; ++d) {
    a[d] = e[d];
  }
  return a;
}

template <std::size_t R>
Extents to_extents(const std::array<std::int64_t, R>& a) {
  Extents e;
  for (std::int64_t v : a) {
    e.push_back(v);
  }
  return e;
}

/// "(7, 5)".
inline std::string shape_string(const Extents& e) {
  std::string s = "(";
  for (int i = 0; i < e.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(e[i]);
  }
  return s + ")";
}

/// The part `part` (global coordinates, inside `whole`) of a tensor holding the block `whole`.
template <class T, int R>
Tensor<T, R> region(const Tensor<T, R>& t, const Block& whole, const Block& part) {
  Tensor<T, R> v = t;
  for (int d = 0; d < R; ++d) {
    v = v.narrow(d, part.offset[d] - whole.offset[d], part.shape[d]);
  }
  return v;
}

/// A contiguous copy of `t` (a new tensor on the same device).
template <class T, int R>
Tensor<T, R> copy_of(const Tensor<T, R>& t) {
  Tensor<T, R> out = fresh<T, R>(t.shape(), t.device());
  local_ops::copy(out, t);
  return out;
}

/// True when splitting `shape` along `d` gives pieces that are contiguous and in order in memory.
template <std::size_t R>
bool splits_contiguously(const std::array<std::int64_t, R>& shape, int d) {
  for (int k = 0; k < d; ++k) {
    if (shape[k] != 1) {
      return false;
    }
  }
  return true;
}

template <class T, int R>
BufferRef buffer_of(const Tensor<T, R>& t) {
  return BufferRef{t.data(), t.numel(), dtype_v<T>, t.device()};
}

/// "dp" or "dp*tp" for the axes of a mask.
template <class Names>
std::string axes_label(const Names& names, AxisMask axes) {
  std::string s;
  for (std::size_t a = 0; a < names.size(); ++a) {
    if (axes & axis_bit(static_cast<int>(a))) {
      s += (s.empty() ? "" : "*") + std::string(names[a]);
    }
  }
  return s;
}

/// A step in flight: `out` holds the result once `work` has been waited on.
template <class T, int R>
struct StepRun {
  Tensor<T, R> out;
  Work work;
};

/// The identity element a Partial coordinate other than 0 holds after R -> P(op).
template <class T>
T partial_identity(ReduceOp op) {
  return op == ReduceOp::product ? T(1.0f) : T(0.0f);
}

/// One side of an exchange: per peer, where its piece moves from (or to). A piece that is a contiguous
/// range of the tensor moves straight from (into) the tensor's memory; the others go through one staging
/// buffer, packed in peer order. The piece a rank keeps is not here (copied region to region); its count
/// is 0.
template <class T>
struct Staged {
  Tensor<T, 1> staging;             ///< the packed pieces (empty when none is)
  std::vector<BufferRef> at;        ///< per peer
  std::vector<Piece> packed;        ///< the pieces that live in `staging`
  Tensor<T, 1> base;                ///< one-buffer form: the buffer every range of `at` lies in
  std::vector<std::int64_t> counts; ///< one-buffer form: element counts per peer
  std::vector<std::int64_t> displs; ///< one-buffer form: displacements in `base` per peer
};

/// Stages the pieces of `t` (holding `whole`) except `me`'s. `one_buffer`: every piece lies in one buffer
/// (a collective's flat send/receive buffer), so one non-contiguous piece stages them all; otherwise
/// (point-to-point) each piece decides alone.
template <class T, int R>
Staged<T> stage(const std::vector<Piece>& pieces, int k, int me, const Tensor<T, R>& t, const Block& whole,
                Device dev, bool one_buffer) {
  Staged<T> s;
  s.at.assign(k, BufferRef{nullptr, 0, dtype_v<T>, dev});
  std::int64_t staged = 0;
  for (const Piece& p : pieces) {
    if (p.peer == me) {
      continue;
    }
    const Tensor<T, R> r = region(t, whole, p.block);
    if (r.is_contiguous() && r.numel() > 0) {
      s.at[p.peer] = BufferRef{r.data(), r.numel(), dtype_v<T>, dev};
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
    s.staging = fresh<T, 1>({staged}, dev);
  }
  std::int64_t at = 0;
  for (const Piece& p : s.packed) {
    const std::int64_t n = numel(p.block.shape);
    s.at[p.peer] = BufferRef{s.staging.data() + at, n, dtype_v<T>, dev};
    at += n;
  }
  if (one_buffer) {
    s.base = s.packed.empty() ? Tensor<T, 1>::from_blob(t.data(), {t.numel()}, dev) : s.staging;
    s.counts.assign(k, 0);
    s.displs.assign(k, 0);
    for (int q = 0; q < k; ++q) {
      if (s.at[q].count > 0) {
        s.counts[q] = s.at[q].count;
        s.displs[q] = static_cast<T*>(s.at[q].data) - s.base.data();
      }
    }
  }
  return s;
}

/// The staging view of a packed piece, shaped as its block.
template <class T, int R>
Tensor<T, R> staged_view(const Staged<T>& s, const Piece& p) {
  return Tensor<T, R>::from_blob(static_cast<T*>(s.at[p.peer].data), to_array<R>(p.block.shape),
                                 s.staging.device());
}

/// Submits step `st` on this rank's local block `in` (contiguous, shape = the step's source block).
template <class T, int R, class Mesh>
StepRun<T, R> submit_step(const Step& st, const Tensor<T, R>& in, const Extents& global, const Mesh& mesh,
                          bool async) {
  const MeshSizes& sizes = mesh.sizes();
  const MeshCoord& coord = mesh.coordinate();
  const Block before = spec_block(global, st.before, sizes, coord);
  const Block after = spec_block(global, st.after, sizes, coord);
  const auto out_shape = to_array<R>(after.shape);
  const Device dev = in.device();
  CommOptions opts;
  opts.blocking = !async;
  const bool record = CommDebugMode::any_active();
  auto label = [&] { return axes_label(Mesh::shape_type::names, st.axes); };
  const auto elem = static_cast<std::int64_t>(sizeof(T));

  switch (st.kind) {
  case StepKind::local_partial: {
    const int a = st.axis();
    if (coord[a] != 0 && (st.op == ReduceOp::sum || st.op == ReduceOp::product)) {
      Tensor<T, R> out(out_shape, dev);
      local_ops::fill(out, partial_identity<T>(st.op));
      return {out, Work()};
    }
    return {in, Work()};
  }
  case StepKind::local_chunk: {
    const int d = st.dst_dim;
    const Tensor<T, R> chunk = in.narrow(d, after.offset[d] - before.offset[d], after.shape[d]);
    return {chunk.is_contiguous() ? chunk : copy_of(chunk), Work()};
  }
  case StepKind::all_reduce: {
    ProcessGroup g = mesh.group(st.axis());
    // In place when nothing else holds the input's memory (an intermediate of this plan, or the block of
    // a DTensor redistributed as an rvalue); else on a copy, leaving the input as it was.
    const bool sole_owner = in.storage() != nullptr && in.storage().use_count() == 1 && in.is_contiguous();
    Tensor<T, R> out = sole_owner ? in : copy_of(in);
    if (record) {
      CommDebugMode::record("all_reduce", label(), step_elements_received(st, global, sizes, coord) * elem);
    }
    return {out, Work(g.impl("redistribute").all_reduce(buffer_of(out), st.op, opts), keep_alive(out))};
  }
  case StepKind::reduce_scatter:
  case StepKind::all_gather: {
    const bool gather = st.kind == StepKind::all_gather;
    const int a = st.axis();
    const int d = gather ? st.src_dim : st.dst_dim;
    const int n = sizes[a];
    ProcessGroup g = mesh.group(a);
    const Block& whole = gather ? after : before; // the block the group's pieces tile
    const auto whole_shape = to_array<R>(whole.shape);
    std::vector<std::int64_t> counts(n);
    std::vector<std::int64_t> displs(n);
    std::vector<Block> pieces(n);
    std::int64_t at = 0;
    for (int m = 0; m < n; ++m) {
      pieces[m] = whole;
      pieces[m].offset[d] += chunk_offset(whole.shape[d], n, m);
      pieces[m].shape[d] = chunk_size(whole.shape[d], n, m);
      counts[m] = numel(pieces[m].shape);
      displs[m] = at;
      at += counts[m];
    }
    const bool direct = splits_contiguously(whole_shape, d);
    const Tensor<T, R>& full_side = gather ? fresh<T, R>(out_shape, dev) : in;
    Tensor<T, 1> packed =
        direct ? full_side.template view<1>({full_side.numel()}) : fresh<T, 1>({numel(whole.shape)}, dev);
    auto piece_view = [&](int m) {
      return packed.narrow(0, displs[m], counts[m]).template view<R>(to_array<R>(pieces[m].shape));
    };
    if (record) {
      CommDebugMode::record(gather ? "all_gather" : "reduce_scatter", label(),
                            step_elements_received(st, global, sizes, coord) * elem);
    }
    if (gather) {
      auto impl = g.impl("redistribute").all_gather(buffer_of(in), buffer_of(packed), counts, displs, opts);
      if (direct) {
        return {full_side, Work(impl, keep_alive(in, full_side))};
      }
      Tensor<T, R> out = full_side;
      auto unpack = [out, packed, pieces, whole, counts, displs, n]() {
        for (int m = 0; m < n; ++m) {
          if (counts[m] > 0) {
            local_ops::copy(
                region(out, whole, pieces[m]),
                packed.narrow(0, displs[m], counts[m]).template view<R>(to_array<R>(pieces[m].shape)));
          }
        }
      };
      return {out, Work(impl, keep_alive(in, packed), unpack)};
    }
    if (!direct) {
      for (int m = 0; m < n; ++m) {
        if (counts[m] > 0) {
          local_ops::copy(piece_view(m), region(in, whole, pieces[m]));
        }
      }
    }
    Tensor<T, R> out = fresh<T, R>(out_shape, dev);
    auto impl =
        g.impl("redistribute").reduce_scatter(buffer_of(packed), buffer_of(out), counts, displs, st.op, opts);
    return {out, Work(impl, keep_alive(in, packed, out))};
  }
  case StepKind::all_to_all:
  case StepKind::permute: {
    ProcessGroup g = mesh.group_over(st.axes);
    const int me = g.rank();
    const int k = g.size();
    std::vector<Piece> sends;
    std::vector<Piece> recvs;
    exchange_pieces(st, global, sizes, coord, sends, recvs);
    Tensor<T, R> out = fresh<T, R>(out_shape, dev);
    std::int64_t received = 0;
    for (const Piece& p : recvs) {
      received += p.peer == me ? 0 : numel(p.block.shape);
    }
    if (record) {
      CommDebugMode::record(st.kind == StepKind::all_to_all ? "all_to_all" : "permute", label(),
                            received * elem);
    }
    // Pieces move straight from `in` / into `out` where they are contiguous ranges there (e.g. the split
    // dim is the leading one); otherwise through staging buffers. The piece this rank keeps is copied
    // directly.
    const bool one_buffer = st.kind == StepKind::all_to_all;
    Staged<T> send = stage(sends, k, me, in, before, dev, one_buffer);
    Staged<T> recv = stage(recvs, k, me, out, after, dev, one_buffer);
    for (const Piece& p : send.packed) {
      local_ops::copy(staged_view<T, R>(send, p), region(in, before, p.block));
    }
    for (const Piece& s : sends) {
      for (const Piece& r : recvs) {
        if (s.peer == me && r.peer == me) {
          local_ops::copy(region(out, after, r.block), region(in, before, s.block));
        }
      }
    }
    auto unpack = [out, recv, after]() {
      for (const Piece& p : recv.packed) {
        local_ops::copy(region(out, after, p.block), staged_view<T, R>(recv, p));
      }
    };
    std::shared_ptr<WorkImpl> impl;
    if (one_buffer) {
      impl = g.impl("redistribute")
                 .all_to_all(buffer_of(send.base), send.counts, send.displs, buffer_of(recv.base),
                             recv.counts, recv.displs, opts);
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
      if (requests.empty()) {
        unpack();
        return {out, Work()};
      }
      impl = g.impl("redistribute").p2p(requests, opts);
    }
    return {out, Work(impl, keep_alive(in, send.staging, recv.staging, out), unpack)};
  }
  }
  DTENSOR_CHECK(false, "redistribute: unknown step kind");
  return {};
}

/// Runs steps [first, plan.size()) synchronously, starting from `local`.
template <class T, int R, class Mesh>
Tensor<T, R> run_steps(const Plan& plan, int first, Tensor<T, R> local, const Extents& global,
                       const Mesh& mesh) {
  for (int i = first; i < plan.size(); ++i) {
    StepRun<T, R> s = submit_step(plan.steps[i], local, global, mesh, false);
    s.work.wait();
    local = std::move(s.out);
  }
  return local;
}

} // namespace dtensor::detail
