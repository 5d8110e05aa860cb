#pragma once
// The parallel layout of transformer layers as a type: which mesh axes are tensor parallel (tp), whether
// the activations between the tensor-parallel regions are sharded on the sequence there (sp), and which
// axis is context parallel (cp) and in which form. Every other mesh axis is data parallel: it shards the
// batch (dp, an FSDP or HSDP axis, a replicate axis); one of them may also be expert parallel (ep: nn::Moe
// shards its experts over it, nn/moe.hpp).
//
//   using Mesh = MeshShape<Axis<"dp">, Axis<"cp">, Axis<"tp">>;
//   using L = nn::Layout<Mesh, nn::TensorParallel<"tp">, nn::SequenceParallel,
//   nn::ContextParallel<Ring<"cp">>>; nn::TransformerBlock<float, L> block(mesh, config, keys);     // the
//   placements of every tensor follow
//
// What the layout gives each tensor, per mesh axis (batch: an axis that is neither tp nor cp):
//
//   tensor                               batch    cp       tp (sp)   tp (no sp)
//   activation (batch, seq, hidden)      S(0)     S(1)     S(1)      R          (act_t)
//   inside a tp region (batch, seq, .)   S(0)     S(1)     R         R          (gathered_t: before the
//                                                                               column-parallel matmuls)
//   token ids, targets (batch, seq)      S(0)     S(1)     R         R          (ids_t)
//   logits (batch, seq, vocab)           S(0)     S(1)     S(2)      S(2)       (logits_t)
//   column weight (out, in)              R        R        S(0)      S(0)       (column_weight_t)
//   row weight (out, in)                 R        R        S(1)      S(1)       (row_weight_t)
//   norm weight (hidden)                 R        R        R         R          (replicated_t)
//
// So the layers' wiring is checked by the types: an activation of another layout does not convert, and a
// layer fed a tensor of the wrong placements does not compile. The parameters are Replicate on the batch
// axes, as FSDP's and DDP's parameters are before sharding (FlatParamGroup's Param specs: nn::params_of,
// train/fsdp.hpp).

#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "dtensor/core/fixed_string.hpp"
#include "dtensor/layout/placement.hpp"
#include "dtensor/ops/attention.hpp"
#include "dtensor/ops/typed_rules.hpp"

namespace dtensor::nn {

/// Tensor parallelism over mesh axis `Axis` (Megatron): the projections split column- and row-wise, the
/// attention heads and the MLP's hidden units over Axis, the vocabulary of the embedding and the head too.
template <fixed_string Axis>
struct TensorParallel {
  static constexpr auto tensor_parallel_axis = Axis;
};

/// With TensorParallel: between the tensor-parallel regions (norms, residuals) the activations are
/// sharded on the sequence over the tp axis; each region all_gathers on entry and reduce_scatters on exit
/// (instead of an all_reduce on exit).
struct SequenceParallel {
  static constexpr bool sequence_parallel = true;
};

/// With SequenceParallel: each tensor-parallel region's entry all_gather and exit reduce_scatter run as
/// collective matmuls (ops/collective_matmul.hpp), in blocks overlapped with the column-parallel GEMMs that
/// follow and the row-parallel GEMM before; the same results within GEMM rounding.
struct CollectiveMatmul {
  static constexpr bool collective_matmul = true;
};

/// Context parallelism in `Form` (Ring<"cp"> or Ulysses<"cp">, ops/attention.hpp): the sequence sharded over
/// the form's axis everywhere; attention runs in that form.
template <class Form>
struct ContextParallel {
  using context_parallel_form = Form;
};

/// Expert parallelism over mesh axis `Axis` (nn::Moe): the experts' weights sharded over Axis, the tokens
/// exchanged between its ranks by all_to_all. Axis stays a batch axis for every other layer.
template <fixed_string Axis>
struct ExpertParallel {
  static constexpr auto expert_parallel_axis = Axis;
};

namespace detail {

// What one option of Layout sets: the tp axis, sp, the cp axis and form (-1 and void: unset). The options
// carry their axes as members (read here with requires-expressions rather than by partial specializations
// on fixed_string parameters, which nvcc's front end does not match).
template <class O>
concept TensorParallelOption = requires {
  O::tensor_parallel_axis;
};
template <class O>
concept SequenceParallelOption = requires {
  O::sequence_parallel;
};
template <class O>
concept CollectiveMatmulOption = requires {
  O::collective_matmul;
};
template <class O>
concept ContextParallelOption = requires {
  typename O::context_parallel_form;
};
template <class O>
concept ExpertParallelOption = requires {
  O::expert_parallel_axis;
};

template <class Mesh, class O>
struct LayoutOption {
  static_assert(
      TensorParallelOption<O> || SequenceParallelOption<O> || ExpertParallelOption<O> ||
          CollectiveMatmulOption<O> ||
          (ContextParallelOption<O> && requires { O::context_parallel_form::context_parallel_axis; }),
      "nn::Layout: an option is nn::TensorParallel<\"axis\">, nn::SequenceParallel, nn::CollectiveMatmul, "
      "nn::ContextParallel<Ring<\"axis\">> / <Ulysses<\"axis\">> or nn::ExpertParallel<\"axis\">");
  static constexpr int tp = [] {
    if constexpr (TensorParallelOption<O>) {
      return Mesh::template index_of<O::tensor_parallel_axis>();
    } else {
      return -1;
    }
  }();
  static constexpr int cp = [] {
    if constexpr (ContextParallelOption<O> && requires { O::context_parallel_form::context_parallel_axis; }) {
      return Mesh::template index_of<O::context_parallel_form::context_parallel_axis>();
    } else {
      return -1;
    }
  }();
  static constexpr int ep = [] {
    if constexpr (ExpertParallelOption<O>) {
      return Mesh::template index_of<O::expert_parallel_axis>();
    } else {
      return -1;
    }
  }();
  static constexpr bool sp = SequenceParallelOption<O>;
  static constexpr bool cm = CollectiveMatmulOption<O>;
  using form =
      typename std::conditional_t<ContextParallelOption<O>, O, ContextParallel<void>>::context_parallel_form;
};

template <class... F>
struct first_form {
  using type = void;
};
template <class F, class... Rest>
struct first_form<F, Rest...> {
  using type = std::conditional_t<std::is_void_v<F>, typename first_form<Rest...>::type, F>;
};

constexpr int pick_axis(std::initializer_list<int> axes) {
  int found = -1;
  for (int a : axes) {
    found = a >= 0 ? a : found;
  }
  return found;
}
constexpr int count_set(std::initializer_list<int> axes) {
  int n = 0;
  for (int a : axes) {
    n += a >= 0 ? 1 : 0;
  }
  return n;
}

} // namespace detail

/// Where the mesh axes of `Mesh` act in transformer layers (see the top of this file).
template <class Mesh, class... Options>
struct Layout {
  using mesh_shape = Mesh;
  /// The tensor-parallel axis (-1: none), the context-parallel axis (-1: none), sequence parallelism.
  static constexpr int tp = detail::pick_axis({detail::LayoutOption<Mesh, Options>::tp...});
  static constexpr int cp = detail::pick_axis({detail::LayoutOption<Mesh, Options>::cp...});
  /// The expert-parallel axis (-1: none): a batch axis that nn::Moe also shards its experts over.
  static constexpr int ep = detail::pick_axis({detail::LayoutOption<Mesh, Options>::ep...});
  static constexpr bool sp = (detail::LayoutOption<Mesh, Options>::sp || ...);
  /// Whether the sequence-parallel entry and exit run as collective matmuls (nn::CollectiveMatmul).
  static constexpr bool collective_matmul = (detail::LayoutOption<Mesh, Options>::cm || ...);
  /// Ring<"cp"> or Ulysses<"cp">; void without context parallelism.
  using cp_form = typename detail::first_form<typename detail::LayoutOption<Mesh, Options>::form...>::type;

  static_assert(detail::count_set({detail::LayoutOption<Mesh, Options>::tp...}) <= 1,
                "nn::Layout: at most one nn::TensorParallel axis");
  static_assert(detail::count_set({detail::LayoutOption<Mesh, Options>::cp...}) <= 1,
                "nn::Layout: at most one nn::ContextParallel axis");
  static_assert(!sp || tp >= 0,
                "nn::Layout: nn::SequenceParallel shards the sequence over the tensor-parallel "
                "axis: name one with nn::TensorParallel<\"axis\">");
  static_assert(!collective_matmul || sp,
                "nn::Layout: nn::CollectiveMatmul overlaps sequence parallelism's all_gather and "
                "reduce_scatter with the GEMMs: add nn::SequenceParallel");
  static_assert(tp < 0 || tp != cp, "nn::Layout: the tensor- and context-parallel axes must differ");
  static_assert(detail::count_set({detail::LayoutOption<Mesh, Options>::ep...}) <= 1,
                "nn::Layout: at most one nn::ExpertParallel axis");
  static_assert(ep < 0 || (ep != tp && ep != cp),
                "nn::Layout: the expert-parallel axis is a batch axis: it must differ from the tensor- and "
                "context-parallel axes");

  /// The placements of a tensor of rank `rank` whose dims `batch`, `seq` and `on_tp` are sharded over the
  /// batch axes, the cp axis and the tp axis (-1: Replicate there).
  static constexpr PlacementList placements(int batch, int seq, int on_tp) {
    PlacementList l;
    for (int a = 0; a < Mesh::rank; ++a) {
      const int d = a == tp ? on_tp : a == cp ? seq : batch;
      l.push_back(d >= 0 ? Placement::shard(d) : Placement::replicate());
    }
    return l;
  }
};

namespace detail {
template <class L, int Batch, int Seq, int OnTp>
struct Placed {
  static constexpr PlacementList list() { return L::placements(Batch, Seq, OnTp); }
};
} // namespace detail

/// A DTensor of element type T and rank `Rank` on L's mesh, sharded as L::placements(Batch, Seq, OnTp).
template <class L, class T, int Rank, int Batch, int Seq, int OnTp>
using placed_t = dtensor_from_t<T, Rank, typename L::mesh_shape, &detail::Placed<L, Batch, Seq, OnTp>::list>;

/// Activations (batch, seq, hidden) between the tensor-parallel regions.
template <class L, class T>
using act_t = placed_t<L, T, 3, 0, 1, L::sp ? 1 : -1>;
/// Activations (batch, seq, features) inside a tensor-parallel region, before its column-parallel matmuls.
template <class L, class T>
using gathered_t = placed_t<L, T, 3, 0, 1, -1>;
/// Token ids and targets (batch, seq).
template <class L, class I = std::int64_t>
using ids_t = placed_t<L, I, 2, 0, 1, -1>;
/// Logits (batch, seq, vocab), the vocabulary over tp.
template <class L, class T>
using logits_t = placed_t<L, T, 3, 0, 1, 2>;
/// A column-parallel weight (out, in): its output features over tp.
template <class L, class T>
using column_weight_t = placed_t<L, T, 2, -1, -1, 0>;
/// A row-parallel weight (out, in): its input features over tp.
template <class L, class T>
using row_weight_t = placed_t<L, T, 2, -1, -1, 1>;
/// A parameter of rank `Rank` replicated on every axis (norm weights and biases).
template <class L, class T, int Rank = 1>
using replicated_t = placed_t<L, T, Rank, -1, -1, -1>;

} // namespace dtensor::nn
