#pragma once
// DeviceMesh: ranks arranged on a named grid, with one process group per mesh axis.
//
//   using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 2>>;
//   auto mesh = init_device_mesh<Mesh>(world);            // dp = world.size() / 2, checked
//   mesh.group<"tp">();                                    // this rank's tp group
//   auto tp = mesh.slice<"tp">();                          // DeviceMesh<MeshShape<Axis<"tp", 2>>>
//   auto flat = mesh.flatten<"dp", "tp">();                // DeviceMesh<MeshShape<Axis<"dp_tp">>>
//
// Rank order is row-major over the axes (the last axis varies fastest), as in PyTorch: mesh rank r is
// rank r of the process group the mesh was built on. Axis groups are built by `split` once per axis, in
// axis order, on every rank (collective over the world group, in init_device_mesh). `slice` shares them.
// Groups over several axes (`flatten`, and the exchanges of redistribute) are made when first needed, by
// their members only: a sub-mesh never waits on ranks outside it.

#include <array>
#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dtensor/backends/split.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/layout/algebra.hpp"
#include "dtensor/mesh/mesh_shape.hpp"

namespace dtensor {

namespace detail {

/// Resolves a mesh's axis sizes: `static_sizes` (-1 = dynamic), `given` values for the dynamic axes in
/// order; when exactly one dynamic size is not given it is deduced from `world_size`.
inline MeshSizes resolve_mesh_sizes(const MeshSizes& static_sizes, std::span<const int> given, int world_size,
                                    const std::string& mesh_name) {
  MeshSizes sizes = static_sizes;
  int next = 0;
  int unknown = -1;
  std::int64_t known = 1;
  for (int a = 0; a < sizes.size(); ++a) {
    if (sizes[a] == dynamic_size) {
      if (next < static_cast<int>(given.size())) {
        DTENSOR_CHECK(given[next] > 0, "init_device_mesh" + mesh_name + ": dynamic axis size " +
                                           std::to_string(given[next]) + " must be > 0");
        sizes[a] = given[next++];
      } else {
        DTENSOR_CHECK(unknown < 0, "init_device_mesh" + mesh_name +
                                       ": more than one axis size is unknown; pass the sizes of all "
                                       "dynamic axes but one (that one is deduced from the world size)");
        unknown = a;
        continue;
      }
    }
    DTENSOR_CHECK(detail::checked_mul(known, sizes[a], known),
                  "init_device_mesh" + mesh_name + ": the axis sizes multiply to more than int64 holds");
  }
  DTENSOR_CHECK(next == static_cast<int>(given.size()),
                "init_device_mesh" + mesh_name + ": " + std::to_string(given.size()) +
                    " dynamic sizes given, but the mesh has only " + std::to_string(next) + " dynamic axes");
  if (unknown >= 0) {
    DTENSOR_CHECK(known > 0 && world_size % known == 0,
                  "init_device_mesh" + mesh_name + ": cannot deduce the size of axis " +
                      std::to_string(unknown) + ": the world size " + std::to_string(world_size) +
                      " is not a multiple of the product of the other axis sizes (" + std::to_string(known) +
                      ")");
    sizes[unknown] = static_cast<int>(world_size / known);
    known *= sizes[unknown];
  }
  DTENSOR_CHECK(known == world_size, "init_device_mesh" + mesh_name + ": the axis sizes multiply to " +
                                         std::to_string(known) + " but the process group has " +
                                         std::to_string(world_size) + " ranks");
  return sizes;
}

/// "a_b_c": the name PyTorch gives a flattened axis.
template <fixed_string... Names>
struct joined_name {
  static constexpr std::size_t length = ((Names.size() + 1) + ...);
  static constexpr fixed_string<length> value = [] {
    char buf[length]{};
    std::size_t at = 0;
    auto append = [&](std::string_view s) {
      if (at > 0) {
        buf[at++] = '_';
      }
      for (char c : s) {
        buf[at++] = c;
      }
    };
    (append(Names.view()), ...);
    return fixed_string<length>(buf);
  }();
};

/// The root mesh every slice and flattening refers to: the world group and its resolved geometry.
struct MeshRoot {
  ProcessGroup world;
  MeshSizes sizes;
  MeshCoord coord;
  /// Groups over sets of root axes made on demand (flattened axes), keyed by the ordered axes.
  mutable std::mutex mutex;
  mutable std::map<std::vector<int>, ProcessGroup> groups;
};

/// Root axes merged into one mesh axis (one for an axis of the root mesh, several for a flattened one).
using RootAxes = StaticVector<int, max_mesh_rank>;

/// What a mesh is, once its type is erased: shared by every copy of a DeviceMesh.
struct MeshState {
  std::shared_ptr<const MeshRoot> root;
  StaticVector<RootAxes, max_mesh_rank> axes;
  std::vector<ProcessGroup> groups; ///< one per axis, labelled with the axis name
  StaticVector<std::string_view, max_mesh_rank> names;
  MeshSizes sizes;
  MeshCoord coord;
  /// Groups over several of this mesh's axes, labelled, by axis mask (filled on first use; the entries
  /// never move, so references to them stay valid).
  mutable std::mutex over_mutex;
  mutable std::map<AxisMask, ProcessGroup> over;
};

} // namespace detail

/// The part of a DeviceMesh that does not depend on its type: sizes, this rank's coordinate, axis names
/// and groups. The plan executor (exec/) runs on it, so it is compiled once for every mesh type. Copies
/// share the state (copying a mesh is one reference count).
class DeviceMeshBase {
public:
  /// Number of ranks in the mesh.
  int size() const noexcept { return mesh_numel(state_->sizes); }
  int size(int axis) const { return state_->sizes[axis]; }
  /// All axis sizes, in axis order.
  const MeshSizes& sizes() const noexcept { return state_->sizes; }
  /// Number of axes.
  int num_axes() const noexcept { return state_->sizes.size(); }
  /// Axis names, in axis order.
  const StaticVector<std::string_view, max_mesh_rank>& names() const noexcept { return state_->names; }

  /// This rank's coordinate on the mesh (one entry per axis).
  const MeshCoord& coordinate() const noexcept { return state_->coord; }
  /// This rank's position in the mesh (row-major over the coordinate).
  int rank() const noexcept { return coord_to_rank(state_->coord, state_->sizes); }

  /// The axes of size 1: a collective over them moves nothing (exec/execute.hpp skips it).
  AxisMask unit_axes() const noexcept {
    AxisMask m = 0;
    for (int a = 0; a < num_axes(); ++a) {
      m |= state_->sizes[a] == 1 ? axis_bit(a) : AxisMask{0};
    }
    return m;
  }

  /// The process group of this rank along `axis`.
  const ProcessGroup& group(int axis) const { return state_->groups[axis]; }

  /// The group over the axes in `axes` (row-major over them: a flattened group), labelled "dp*tp". Made
  /// on first use by its members only (no other rank of the mesh takes part) and kept; later calls look it
  /// up by mask (no allocation). Axes of size 1 change neither the members nor their order, so they are
  /// left out: over (dp, tp) with tp = 1 it is dp's group itself, no new communicator.
  const ProcessGroup& group_over(AxisMask axes) const {
    const AxisMask wide = axes & ~unit_axes();
    axes = wide != 0 ? wide : axis_bit(first_axis(axes));
    if (axis_count(axes) == 1) {
      return state_->groups[first_axis(axes)];
    }
    std::lock_guard lock(state_->over_mutex);
    auto it = state_->over.find(axes);
    if (it != state_->over.end()) {
      return it->second;
    }
    detail::RootAxes root_axes;
    std::string label;
    for (int a = 0; a < num_axes(); ++a) {
      if (axes & axis_bit(a)) {
        for (int r : state_->axes[a]) {
          root_axes.push_back(r);
        }
        label += (label.empty() ? "" : "*") + std::string(state_->names[a]);
      }
    }
    return state_->over.emplace(axes, root_group(root_axes).with_label(std::move(label))).first->second;
  }

  /// "DeviceMesh(dp=2, tp=2) at (1, 0)".
  std::string to_string() const {
    std::string s = "DeviceMesh" + mesh_to_string(state_->names, state_->sizes) + " at (";
    for (int a = 0; a < num_axes(); ++a) {
      s += (a ? ", " : "") + std::to_string(state_->coord[a]);
    }
    return s + ")";
  }

  /// The root mesh's world group (the group init_device_mesh was given).
  const ProcessGroup& world() const noexcept { return state_->root->world; }

protected:
  DeviceMeshBase() = default;
  explicit DeviceMeshBase(std::shared_ptr<const detail::MeshState> state) : state_(std::move(state)) {}

  /// The group along `root_axes` of the root mesh through this rank, from the root's cache or made by
  /// its members (new_group over their world ranks) and cached.
  ProcessGroup root_group(const detail::RootAxes& root_axes) const {
    const detail::MeshRoot& root = *state_->root;
    const std::vector<int> key(root_axes.begin(), root_axes.end());
    std::lock_guard lock(root.mutex);
    auto it = root.groups.find(key);
    if (it == root.groups.end()) {
      std::vector<int> members; // world ranks, row-major over root_axes
      int n = 1;
      for (int a : root_axes) {
        n *= root.sizes[a];
      }
      for (int q = 0; q < n; ++q) {
        MeshCoord c = root.coord;
        int rest = q;
        for (int i = root_axes.size() - 1; i >= 0; --i) {
          c[root_axes[i]] = rest % root.sizes[root_axes[i]];
          rest /= root.sizes[root_axes[i]];
        }
        members.push_back(root.world.ranks()[coord_to_rank(c, root.sizes)]);
      }
      it = root.groups.emplace(key, root.world.new_group(members)).first;
    }
    return it->second;
  }

  std::shared_ptr<const detail::MeshState> state_;
};

/// A mesh of ranks with one process group per axis. Cheap to copy (the state is shared).
template <class Shape>
class DeviceMesh : public DeviceMeshBase {
public:
  using shape_type = Shape;
  static constexpr int ndim = Shape::rank;

  /// Built by init_device_mesh, slice and flatten: `axes[a]` are the root axes merged into axis a,
  /// `groups[a]` its group.
  DeviceMesh(std::shared_ptr<const detail::MeshRoot> root,
             const std::array<detail::RootAxes, Shape::rank>& axes,
             std::array<ProcessGroup, Shape::rank> groups) {
    auto state = std::make_shared<detail::MeshState>();
    for (int a = 0; a < Shape::rank; ++a) {
      int size = 1;
      int coord = 0;
      for (int r : axes[a]) {
        size *= root->sizes[r];
        coord = coord * root->sizes[r] + root->coord[r];
      }
      if (Shape::static_sizes[a] != dynamic_size) {
        DTENSOR_CHECK(Shape::static_sizes[a] == size, "DeviceMesh" + Shape::to_string() + ": axis " +
                                                          std::string(Shape::names[a]) + " has " +
                                                          std::to_string(size) + " ranks");
      }
      state->axes.push_back(axes[a]);
      state->names.push_back(Shape::names[a]);
      state->sizes.push_back(size);
      state->coord.push_back(coord);
      state->groups.push_back(std::move(groups[a]).with_label(std::string(Shape::names[a])));
    }
    state->root = std::move(root);
    state_ = std::move(state);
  }

  using DeviceMeshBase::group;
  using DeviceMeshBase::size;

  /// Size of the axis called `Name`.
  template <fixed_string Name>
  int size() const noexcept {
    return state_->sizes[Shape::template index_of<Name>()];
  }
  /// This rank's coordinate along `Name` (its rank in group<Name>()).
  template <fixed_string Name>
  int local_rank() const noexcept {
    return state_->coord[Shape::template index_of<Name>()];
  }
  /// The process group of this rank along `Name`: the ranks that differ from it only on that axis,
  /// ordered by their coordinate on it.
  template <fixed_string Name>
  const ProcessGroup& group() const noexcept {
    return state_->groups[Shape::template index_of<Name>()];
  }

  /// The sub-mesh of the named axes (in the order given) through this rank, sharing their groups.
  template <fixed_string... Names>
  auto slice() const {
    static_assert(sizeof...(Names) >= 1, "slice<...>() needs at least one axis name");
    using Sliced = MeshShape<Axis<Names, Shape::static_sizes[Shape::template index_of<Names>()]>...>;
    constexpr std::array<int, sizeof...(Names)> picked{Shape::template index_of<Names>()...};
    std::array<detail::RootAxes, sizeof...(Names)> axes;
    std::array<ProcessGroup, sizeof...(Names)> groups;
    for (std::size_t i = 0; i < picked.size(); ++i) {
      axes[i] = state_->axes[picked[i]];
      groups[i] = state_->groups[picked[i]];
    }
    return DeviceMesh<Sliced>(state_->root, axes, std::move(groups));
  }

  /// A 1-D mesh whose one axis, named "a_b", merges the named axes (row-major in the order given). Its
  /// group is made by its members only, on the first flatten of these axes, and shared after that.
  template <fixed_string... Names>
  auto flatten() const {
    static_assert(sizeof...(Names) >= 1, "flatten<...>() needs at least one axis name");
    constexpr int static_size = [] {
      int s = 1;
      for (int i : {Shape::template index_of<Names>()...}) {
        if (Shape::static_sizes[i] == dynamic_size) {
          return dynamic_size;
        }
        s *= Shape::static_sizes[i];
      }
      return s;
    }();
    using Flat = MeshShape<Axis<detail::joined_name<Names...>::value, static_size>>;
    detail::RootAxes merged;
    for (int i : {Shape::template index_of<Names>()...}) {
      for (int r : state_->axes[i]) {
        merged.push_back(r);
      }
    }
    std::array<detail::RootAxes, 1> axes{merged};
    std::array<ProcessGroup, 1> groups{root_group(merged)};
    return DeviceMesh<Flat>(state_->root, axes, std::move(groups));
  }
};

/// Builds the mesh `Shape` over `world` (every member calls it). `dynamic_sizes` are the sizes of the
/// dynamic axes in order; one of them may be left out and is then deduced from world.size(). Throws
/// dtensor::Error when the sizes cannot multiply to world.size().
template <class Shape, std::convertible_to<int>... Sizes>
DeviceMesh<Shape> init_device_mesh(const ProcessGroup& world, Sizes... dynamic_sizes) {
  static_assert(
      sizeof...(Sizes) <= Shape::num_dynamic,
      "init_device_mesh: more sizes given than the mesh has dynamic axes (Axis<\"name\"> without a size)");
  const std::array<int, sizeof...(Sizes)> given{static_cast<int>(dynamic_sizes)...};
  auto root = std::make_shared<detail::MeshRoot>();
  root->world = world;
  root->sizes = detail::resolve_mesh_sizes(Shape::sizes(), given, world.size(), Shape::to_string());
  root->coord = rank_to_coord(world.rank(), root->sizes);
  std::array<detail::RootAxes, Shape::rank> axes;
  std::array<ProcessGroup, Shape::rank> groups;
  for (int a = 0; a < Shape::rank; ++a) {
    axes[a].push_back(a);
    // Every member's colour and key are functions of its rank, so each computes them all: no exchange.
    std::vector<SplitEntry> every(static_cast<std::size_t>(world.size()));
    for (int r = 0; r < world.size(); ++r) {
      every[static_cast<std::size_t>(r)] = {axis_color(r, a, root->sizes), axis_key(r, a, root->sizes)};
    }
    const SplitEntry& mine = every[static_cast<std::size_t>(world.rank())];
    groups[a] = world.split(mine.color, mine.key, every);
  }
  return DeviceMesh<Shape>(std::move(root), axes, std::move(groups));
}

} // namespace dtensor
