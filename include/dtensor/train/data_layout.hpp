#pragma once
// The training layouts by name, one table for every program that picks one on its command line (examples
// 06, 09, 10, 11, bench_train): how a layout splits n ranks over the mesh axes (pp, rep, dp, cp, tp) and which
// trainer runs it.
//
//   name         pp  rep  dp     cp  tp   trainer
//   tp           1   1    1      1   n    nn::DdpTrainer over dp: the parameters tensor parallel over tp
//   ddp          1   1    n      1   1    nn::DdpTrainer over dp
//   fsdp         1   1    n      1   1    nn::FsdpTrainer<Fsdp<dp>>
//   hsdp         1   2    n/2    1   1    nn::FsdpTrainer<Hsdp<rep, dp>>: sharded over dp, replicated over rep
//   fsdp_tp      1   1    n/2    1   2    nn::FsdpTrainer<Fsdp<dp>> of tensor-parallel parameters
//   cp_ring      1   1    1      n   1    nn::DdpTrainer; ring context parallelism over cp (the model's)
//   cp_ulysses   1   1    1      n   1    nn::DdpTrainer; Ulysses context parallelism over cp (the model's)
//   fsdp_tp_cp   1   1    n/4    2   2    nn::FsdpTrainer<Fsdp<dp>>; ring context parallelism and tp
//   pp           n   1    1      1   1    nn::PipelineTrainer: a stage per rank
//   pp_fsdp_tp   2   1    n/4    1   2    nn::PipelineTrainer<Fsdp<dp>>, tensor parallel in each stage
//
// The data layouts (the first five) need only (rep, dp, tp) axes; the others name the context parallelism a
// model's layout type must have (nn::ContextParallel) or a pp axis, so a program maps them to its own model
// types (examples/09_gpt.cpp).
//
//   const nn::DataLayout layout = nn::parse_data_layout(flag);        // throws on an unknown name
//   const auto [rep, dp, tp] = nn::data_layout_mesh(layout, world.size());
//   const auto mesh = init_device_mesh<Mesh>(world, rep, dp, tp);
//   Run r = nn::with_trainer(layout, mesh, Model(mesh, ...), options, [&](auto& trainer) { ... });
//
//   const nn::DataLayout layout = nn::parse_layout(flag);             // any layout of the table
//   const nn::LayoutDegrees d = nn::layout_degrees(layout, world.size());   // d.pp, d.rep, d.dp, d.cp, d.tp
//
// with_trainer makes the layout's trainer of the model and calls f with it (f is instantiated once per
// trainer type: a generic lambda; what it returns must not depend on the trainer). The mesh's axes are
// named by the template arguments (default "rep", "dp"); a mesh without a Rep axis takes no hsdp.
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/mesh/device_mesh.hpp"
#include "dtensor/nn/contract.hpp"
#include "dtensor/train/fsdp.hpp"
#include "dtensor/train/trainer.hpp"

namespace dtensor::nn {

enum class DataLayout { tp, ddp, fsdp, hsdp, fsdp_tp, cp_ring, cp_ulysses, fsdp_tp_cp, pp, pp_fsdp_tp };

/// Which trainer runs a layout.
enum class LayoutTrainer { ddp, fsdp, hsdp, pipeline };
/// The context parallelism a layout asks of the model.
enum class LayoutContext { none, ring, ulysses };

/// A layout's degrees over (pp, rep, dp, cp, tp).
struct LayoutDegrees {
  int pp = 1, rep = 1, dp = 1, cp = 1, tp = 1;
};

/// One row of the table (see the top of the file): its degrees, kAllRanks where one takes every rank; dp is
/// what the others leave.
struct LayoutSpec {
  static constexpr int kAllRanks = 0;
  std::string_view name;
  DataLayout layout;
  LayoutDegrees degrees;
  LayoutTrainer trainer;
  LayoutContext context = LayoutContext::none;

  /// Only (rep, dp, tp) axes: no pipeline, no context parallelism.
  constexpr bool data_only() const { return degrees.pp == 1 && degrees.cp == 1; }
};

inline constexpr std::array<LayoutSpec, 10> layout_specs{{
    {"tp", DataLayout::tp, {.tp = LayoutSpec::kAllRanks}, LayoutTrainer::ddp},
    {"ddp", DataLayout::ddp, {}, LayoutTrainer::ddp},
    {"fsdp", DataLayout::fsdp, {}, LayoutTrainer::fsdp},
    {"hsdp", DataLayout::hsdp, {.rep = 2}, LayoutTrainer::hsdp},
    {"fsdp_tp", DataLayout::fsdp_tp, {.tp = 2}, LayoutTrainer::fsdp},
    {"cp_ring", DataLayout::cp_ring, {.cp = LayoutSpec::kAllRanks}, LayoutTrainer::ddp, LayoutContext::ring},
    {"cp_ulysses",
     DataLayout::cp_ulysses,
     {.cp = LayoutSpec::kAllRanks},
     LayoutTrainer::ddp,
     LayoutContext::ulysses},
    {"fsdp_tp_cp", DataLayout::fsdp_tp_cp, {.cp = 2, .tp = 2}, LayoutTrainer::fsdp, LayoutContext::ring},
    {"pp", DataLayout::pp, {.pp = LayoutSpec::kAllRanks}, LayoutTrainer::pipeline},
    {"pp_fsdp_tp", DataLayout::pp_fsdp_tp, {.pp = 2, .tp = 2}, LayoutTrainer::pipeline},
}};

/// The table's row of `layout`.
constexpr const LayoutSpec& layout_spec(DataLayout layout) {
  for (const LayoutSpec& s : layout_specs) {
    if (s.layout == layout) {
      return s;
    }
  }
  return layout_specs.front(); // every enumerator has a row
}

inline std::string_view data_layout_name(DataLayout layout) {
  return layout_spec(layout).name;
}

namespace detail {

/// The layout named `name` among the rows `data_only` allows; an Error listing them otherwise.
inline DataLayout parse_layout_among(std::string_view name, bool data_only) {
  std::string known;
  for (const LayoutSpec& s : layout_specs) {
    if (data_only && !s.data_only()) {
      continue;
    }
    if (s.name == name) {
      return s.layout;
    }
    known += (known.empty() ? "" : ", ") + std::string(s.name);
  }
  throw Error("unknown layout '" + std::string(name) + "': one of " + known);
}

} // namespace detail

/// Any layout of the table by name; an Error listing the names otherwise.
inline DataLayout parse_layout(std::string_view name) {
  return detail::parse_layout_among(name, false);
}
/// A data layout (tp, ddp, fsdp, hsdp, fsdp_tp: a (rep, dp, tp) mesh) by name; an Error listing them
/// otherwise.
inline DataLayout parse_data_layout(std::string_view name) {
  return detail::parse_layout_among(name, true);
}

/// The degrees of `layout` on n ranks (see the top of the file); an Error where n does not fit it.
inline LayoutDegrees layout_degrees(DataLayout layout, int n) {
  const LayoutSpec& s = layout_spec(layout);
  LayoutDegrees d = s.degrees;
  int fixed = 1;
  for (int* degree : {&d.pp, &d.rep, &d.cp, &d.tp}) {
    *degree = *degree == LayoutSpec::kAllRanks ? n : *degree;
    fixed *= *degree;
  }
  DTENSOR_CHECK(n >= 1 && n % fixed == 0, "layout " + std::string(s.name) + " on " + std::to_string(n) +
                                              " ranks: it needs a multiple of " + std::to_string(fixed));
  d.dp = n / fixed;
  return d;
}

/// The (rep, dp, tp) sizes of data layout `layout` on n ranks; an Error where n does not fit it, or where
/// the layout needs a pp or cp axis.
inline std::array<int, 3> data_layout_mesh(DataLayout layout, int n) {
  DTENSOR_CHECK(layout_spec(layout).data_only(), "layout " + std::string(data_layout_name(layout)) +
                                                     " needs a pp or cp axis: not a (rep, dp, tp) layout");
  const LayoutDegrees d = layout_degrees(layout, n);
  return {d.rep, d.dp, d.tp};
}

/// f(trainer) with `layout`'s trainer of `model` on `mesh` (see the top of the file); an Error for a
/// pipeline layout (nn::PipelineTrainer takes a pp group and a stage mesh) and for hsdp on a mesh without
/// a Rep axis.
template <fixed_string Rep = "rep", fixed_string Dp = "dp", class Model, class F>
decltype(auto) with_trainer(DataLayout layout, const DeviceMesh<model_mesh_t<Model>>& mesh, Model model,
                            const TrainerOptions& options, F&& f) {
  const LayoutSpec& spec = layout_spec(layout);
  DTENSOR_CHECK(spec.trainer != LayoutTrainer::pipeline,
                "nn::with_trainer: layout " + std::string(spec.name) +
                    " is pipelined: build nn::PipelineTrainer on a (pp, ...) mesh");
  if constexpr (model_mesh_t<Model>::template has_axis<Rep>) {
    if (spec.trainer == LayoutTrainer::hsdp) {
      FsdpTrainer<Model, Hsdp<Rep, Dp>> trainer(mesh, std::move(model), options);
      return f(trainer);
    }
  } else {
    DTENSOR_CHECK(spec.trainer != LayoutTrainer::hsdp,
                  "nn::with_trainer: hsdp needs a mesh axis named " + std::string(Rep.view()));
  }
  if (spec.trainer == LayoutTrainer::fsdp) {
    FsdpTrainer<Model, Fsdp<Dp>> trainer(mesh, std::move(model), options);
    return f(trainer);
  }
  DdpTrainer<Model, Dp> trainer(mesh, std::move(model), options);
  return f(trainer);
}

} // namespace dtensor::nn
