#pragma once
// What PyTorch DTensor's redistribute would do, as a reference for plans and benchmarks.
//
// A model of torch.distributed.tensor's greedy planner (_gen_transform_infos, PyTorch 2.4-2.11): first
// from the innermost mesh dim to the outermost, a mesh dim whose target is Shard(d) is redistributed to
// Replicate instead when the mesh dims before it shard d differently in the current and target lists
// ("nested sharding"), and any other differing dim goes straight to its target; then, from the
// outermost to the innermost, every dim still differing goes to its target. Each transform runs on one
// mesh dim: S->R all_gather, P->R all_reduce, P->S reduce_scatter, S(i)->S(j) all_to_all, R->S and R->P
// local. Uneven shards are padded to ceil(n/k) for all_gather, reduce_scatter and all_to_all, so
// received bytes count the padding.

#include <cstdint>
#include <string>

#include "dtensor/layout/algebra.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/layout/shard_spec.hpp"
#include "dtensor/plan/cost.hpp"

namespace dtensor {

/// One transform of PyTorch's plan: mesh dim `axis` goes from `from` to `to`.
struct TorchTransform {
  int axis;
  Placement from;
  Placement to;
};

struct TorchPlan {
  StaticVector<TorchTransform, 2 * max_mesh_rank> transforms;

  constexpr int count_collectives() const noexcept {
    int n = 0;
    for (const TorchTransform& t : transforms) {
      n += t.from.is_replicate() ? 0 : 1;
    }
    return n;
  }
  constexpr bool uses_all_gather() const noexcept {
    for (const TorchTransform& t : transforms) {
      if (t.from.is_shard() && t.to.is_replicate()) {
        return true;
      }
    }
    return false;
  }
};

/// PyTorch's transforms for src -> dst (placement lists of a rank-`tensor_rank` tensor).
constexpr TorchPlan torch_greedy_plan(const PlacementList& src_list, const PlacementList& dst_list,
                                      int tensor_rank) {
  TorchPlan plan;
  PlacementList cur = normalize(src_list, tensor_rank);
  const PlacementList dst = normalize(dst_list, tensor_rank);
  const int n = cur.size();
  bool sharded = false;
  for (const Placement& p : cur) {
    sharded = sharded || p.is_shard();
  }
  if (n > 1 && sharded) {
    for (int a = n - 1; a >= 0; --a) {
      Placement target = dst[a];
      if (target.is_shard()) {
        bool same = true;
        for (int i = 0; i < a; ++i) {
          same = same && (cur[i].is_shard(target.dim) == dst[i].is_shard(target.dim));
        }
        if (!same) {
          target = Placement::replicate();
        }
      }
      if (!(cur[a] == target)) {
        plan.transforms.push_back({a, cur[a], target});
        cur[a] = target;
      }
    }
  }
  for (int a = 0; a < n; ++a) {
    if (!(cur[a] == dst[a])) {
      plan.transforms.push_back({a, cur[a], dst[a]});
      cur[a] = dst[a];
    }
  }
  return plan;
}

/// Bytes per rank PyTorch's plan receives (per transform the most any rank receives, summed), padding
/// included, for a tensor of `global` shape on a mesh of `sizes`.
inline std::int64_t torch_greedy_bytes(const PlacementList& src_list, const PlacementList& dst_list,
                                       const Extents& global, const MeshSizes& sizes,
                                       std::int64_t element_size) {
  const int tensor_rank = global.size();
  const TorchPlan plan = torch_greedy_plan(src_list, dst_list, tensor_rank);
  PlacementList cur = normalize(src_list, tensor_rank);
  std::int64_t total = 0;
  for (const TorchTransform& t : plan.transforms) {
    const std::int64_t k = sizes[t.axis];
    std::int64_t most = 0;
    for (int r = 0; r < mesh_numel(sizes); ++r) {
      // The block this mesh dim splits: the current layout without this dim's own split.
      PlacementList parent = cur;
      parent[t.axis] = Placement::replicate();
      const Block b = local_block(global, parent, sizes, r);
      const std::int64_t whole = numel(b.shape);
      auto padded_piece = [&](int d) { // one padded chunk of the block along d
        return b.shape[d] == 0 ? 0 : whole / b.shape[d] * full_chunk_size(b.shape[d], static_cast<int>(k));
      };
      std::int64_t e = 0;
      if (t.from.is_shard() && t.to.is_replicate()) {
        e = (k - 1) * padded_piece(t.from.dim);
      } else if (t.from.is_partial() && t.to.is_replicate()) {
        const Block mine = local_block(global, cur, sizes, r);
        e = (2 * (k - 1) * numel(mine.shape) + k - 1) / k;
      } else if (t.from.is_partial() && t.to.is_shard()) {
        e = (k - 1) * padded_piece(t.to.dim);
      } else if (t.from.is_shard() && t.to.is_shard()) {
        const std::int64_t pi =
            b.shape[t.from.dim] == 0 ? 0 : full_chunk_size(b.shape[t.from.dim], static_cast<int>(k));
        const std::int64_t pj =
            b.shape[t.to.dim] == 0 ? 0 : full_chunk_size(b.shape[t.to.dim], static_cast<int>(k));
        const std::int64_t rest = b.shape[t.from.dim] * b.shape[t.to.dim] == 0
                                      ? 0
                                      : whole / (b.shape[t.from.dim] * b.shape[t.to.dim]);
        e = (k - 1) * pi * pj * rest;
      }
      most = e > most ? e : most;
    }
    total += most * element_size;
    cur[t.axis] = t.to;
  }
  return total;
}

/// "all_gather(1); all_to_all(0)"-style summary of PyTorch's plan, naming axes by `names`.
template <class Names>
std::string to_string(const TorchPlan& plan, const Names& names) {
  std::string s;
  for (const TorchTransform& t : plan.transforms) {
    std::string op = t.from.is_shard() && t.to.is_replicate()     ? "all_gather"
                     : t.from.is_partial() && t.to.is_replicate() ? "all_reduce"
                     : t.from.is_partial() && t.to.is_shard()     ? "reduce_scatter"
                     : t.from.is_shard() && t.to.is_shard()       ? "all_to_all"
                     : t.to.is_shard()                            ? "local_chunk"
                                                                  : "local_partial";
    s += (s.empty() ? "" : "; ") + op + "(" + std::string(names[t.axis]) + ", " + to_string(t.from) + "->" +
         to_string(t.to) + ")";
  }
  return s.empty() ? "nothing to do" : s;
}

} // namespace dtensor
