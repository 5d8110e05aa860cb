#pragma once
// The data-parallel layouts of the trainers by name, one dispatch for every program that picks one on its
// command line (examples/06_train.cpp, 10_own_model.cpp, 11_vision.cpp): on a (rep, dp, tp) mesh,
//
//   tp       (1, 1, n)      nn::DdpTrainer over dp (of one rank): the parameters tensor parallel over tp
//   ddp      (1, n, 1)      nn::DdpTrainer over dp
//   fsdp     (1, n, 1)      nn::FsdpTrainer<Fsdp<dp>>
//   hsdp     (2, n/2, 1)    nn::FsdpTrainer<Hsdp<rep, dp>>: sharded over dp, replicated over rep
//   fsdp_tp  (1, n/2, 2)    nn::FsdpTrainer<Fsdp<dp>> of tensor-parallel parameters
//
//   const nn::DataLayout layout = nn::parse_data_layout(flag);        // throws on an unknown name
//   const auto [rep, dp, tp] = nn::data_layout_mesh(layout, world.size());
//   const auto mesh = init_device_mesh<Mesh>(world, rep, dp, tp);
//   Run r = nn::with_trainer(layout, mesh, Model(mesh, ...), options, [&](auto& trainer) { ... });
//
// with_trainer makes the layout's trainer of the model and calls f with it (f is instantiated once per
// trainer type: a generic lambda; what it returns must not depend on the trainer). The mesh's axes are
// named by the template arguments (default "rep", "dp").
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

enum class DataLayout { tp, ddp, fsdp, hsdp, fsdp_tp };

inline constexpr std::array<std::pair<std::string_view, DataLayout>, 5> data_layout_names{
    {{"tp", DataLayout::tp},
     {"ddp", DataLayout::ddp},
     {"fsdp", DataLayout::fsdp},
     {"hsdp", DataLayout::hsdp},
     {"fsdp_tp", DataLayout::fsdp_tp}}};

/// The layout named `name`; an Error listing the names otherwise.
inline DataLayout parse_data_layout(std::string_view name) {
  std::string known;
  for (const auto& [n, layout] : data_layout_names) {
    if (n == name) {
      return layout;
    }
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw Error("unknown layout '" + std::string(name) + "': one of " + known);
}

inline std::string_view data_layout_name(DataLayout layout) {
  for (const auto& [n, l] : data_layout_names) {
    if (l == layout) {
      return n;
    }
  }
  return "?";
}

/// The (rep, dp, tp) sizes of `layout` on n ranks (see the top of the file); an Error where n does not
/// fit it (hsdp and fsdp_tp need an even n).
inline std::array<int, 3> data_layout_mesh(DataLayout layout, int n) {
  const int rep = layout == DataLayout::hsdp ? 2 : 1;
  const int tp = layout == DataLayout::tp ? n : layout == DataLayout::fsdp_tp ? 2 : 1;
  DTENSOR_CHECK(n >= 1 && n % (rep * tp) == 0, "layout " + std::string(data_layout_name(layout)) + " on " +
                                                   std::to_string(n) + " ranks: it needs a multiple of " +
                                                   std::to_string(rep * tp));
  return {rep, n / (rep * tp), tp};
}

/// f(trainer) with `layout`'s trainer of `model` on `mesh` (see the top of the file).
template <fixed_string Rep = "rep", fixed_string Dp = "dp", class Model, class F>
decltype(auto) with_trainer(DataLayout layout, const DeviceMesh<model_mesh_t<Model>>& mesh, Model model,
                            const TrainerOptions& options, F&& f) {
  switch (layout) {
  case DataLayout::fsdp:
  case DataLayout::fsdp_tp: {
    FsdpTrainer<Model, Fsdp<Dp>> trainer(mesh, std::move(model), options);
    return f(trainer);
  }
  case DataLayout::hsdp: {
    FsdpTrainer<Model, Hsdp<Rep, Dp>> trainer(mesh, std::move(model), options);
    return f(trainer);
  }
  default: {
    DdpTrainer<Model, Dp> trainer(mesh, std::move(model), options);
    return f(trainer);
  }
  }
}

} // namespace dtensor::nn
