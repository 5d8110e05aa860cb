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
// axis order, on every rank (collective over the world group); `slice` shares them and `flatten` builds
// one new group, so every rank must call `flatten` for the same axes in the same order (like PyTorch).

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

#include "dtensor/comm/process_group.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/fixed_string.hpp"
#include "dtensor/core/layout.hpp"
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
    known *= sizes[a];
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
  /// Groups over sets of root axes made on demand (flattened all_to_all), keyed by the ordered axes.
  mutable std::mutex mutex;
  mutable std::map<std::vector<int>, ProcessGroup> groups;
};

} // namespace detail

/// A mesh of ranks with one process group per axis. Cheap to copy (groups are shared handles).
template <class Shape>
class DeviceMesh {
public:
  using shape_type = Shape;
  static constexpr int ndim = Shape::rank;

  /// Built by init_device_mesh, slice and flatten.
  DeviceMesh(std::shared_ptr<const detail::MeshRoot> root,
             std::array<StaticVector<int, max_mesh_rank>, ndim> axes, std::array<ProcessGroup, ndim> groups)
      : root_(std::move(root)), axes_(axes), groups_(std::move(groups)) {
    for (int a = 0; a < ndim; ++a) {
      int size = 1;
      int coord = 0;
      for (int r : axes_[a]) {
        size *= root_->sizes[r];
        coord = coord * root_->sizes[r] + root_->coord[r];
      }
      sizes_.push_back(size);
      coord_.push_back(coord);
      if (Shape::static_sizes[a] != dynamic_size) {
        DTENSOR_CHECK(Shape::static_sizes[a] == size, "DeviceMesh" + Shape::to_string() + ": axis " +
                                                          std::string(Shape::names[a]) + " has " +
                                                          std::to_string(size) + " ranks");
      }
    }
  }

  /// Number of ranks in the mesh.
  int size() const noexcept { return mesh_numel(sizes_); }
  /// Size of the axis called `Name`.
  template <fixed_string Name>
  int size() const noexcept {
    return sizes_[Shape::template index_of<Name>()];
  }
  int size(int axis) const { return sizes_[axis]; }
  /// All axis sizes, in axis order.
  const MeshSizes& sizes() const noexcept { return sizes_; }

  /// This rank's coordinate on the mesh (one entry per axis).
  const MeshCoord& coordinate() const noexcept { return coord_; }
  /// This rank's coordinate along `Name` (its rank in group<Name>()).
  template <fixed_string Name>
  int local_rank() const noexcept {
    return coord_[Shape::template index_of<Name>()];
  }
  /// This rank's position in the mesh (row-major over the coordinate).
  int rank() const noexcept { return coord_to_rank(coord_, sizes_); }

  /// The process group of this rank along `Name`: the ranks that differ from it only on that axis,
  /// ordered by their coordinate on it.
  template <fixed_string Name>
  const ProcessGroup& group() const noexcept {
    return groups_[Shape::template index_of<Name>()];
  }
  const ProcessGroup& group(int axis) const { return groups_[axis]; }

  /// The sub-mesh of the named axes (in the order given) through this rank, sharing their groups.
  template <fixed_string... Names>
  auto slice() const {
    static_assert(sizeof...(Names) >= 1, "slice<...>() needs at least one axis name");
    using Sliced = MeshShape<Axis<Names, Shape::static_sizes[Shape::template index_of<Names>()]>...>;
    constexpr std::array<int, sizeof...(Names)> picked{Shape::template index_of<Names>()...};
    std::array<StaticVector<int, max_mesh_rank>, sizeof...(Names)> axes;
    std::array<ProcessGroup, sizeof...(Names)> groups;
    for (std::size_t i = 0; i < picked.size(); ++i) {
      axes[i] = axes_[picked[i]];
      groups[i] = groups_[picked[i]];
    }
    return DeviceMesh<Sliced>(root_, axes, std::move(groups));
  }

  /// A 1-D mesh whose one axis, named "a_b", merges the named axes (row-major in the order given), with
  /// a new process group. Collective over the whole root mesh: every rank calls it, in the same order.
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
    StaticVector<int, max_mesh_rank> merged;
    for (int i : {Shape::template index_of<Names>()...}) {
      for (int r : axes_[i]) {
        merged.push_back(r);
      }
    }
    std::array<StaticVector<int, max_mesh_rank>, 1> axes{merged};
    std::array<ProcessGroup, 1> groups{root_group(merged)};
    return DeviceMesh<Flat>(root_, axes, std::move(groups));
  }

  /// The group over the axes in `axes` (row-major over them, a flattened group), made on first use and
  /// kept. Collective over the whole root mesh the first time: every rank asks for the same sets in the
  /// same order (as redistribute does).
  ProcessGroup group_over(AxisMask axes) const {
    StaticVector<int, max_mesh_rank> root_axes;
    for (int a = 0; a < ndim; ++a) {
      if (axes & axis_bit(a)) {
        for (int r : axes_[a]) {
          root_axes.push_back(r);
        }
      }
    }
    if (axis_count(axes) == 1) {
      return groups_[first_axis(axes)];
    }
    return root_group(root_axes);
  }

  /// "DeviceMesh(dp=2, tp=2) at (1, 0)".
  std::string to_string() const {
    std::string s = "DeviceMesh" + mesh_to_string(Shape::names, sizes_) + " at (";
    for (int a = 0; a < ndim; ++a) {
      s += (a ? ", " : "") + std::to_string(coord_[a]);
    }
    return s + ")";
  }

  /// The root mesh's world group (the group init_device_mesh was given).
  const ProcessGroup& world() const noexcept { return root_->world; }

  /// The group along the root axes `axes` (row-major over them): every root rank calls it.
  static ProcessGroup split_along(const detail::MeshRoot& root,
                                  const StaticVector<int, max_mesh_rank>& axes) {
    int color = 0;
    int key = 0;
    for (int a = 0; a < root.sizes.size(); ++a) {
      bool merged = false;
      for (int m : axes) {
        merged |= m == a;
      }
      if (!merged) {
        color = color * root.sizes[a] + root.coord[a];
      }
    }
    for (int m : axes) {
      key = key * root.sizes[m] + root.coord[m];
    }
    return root.world.split(color, key);
  }

private:
  /// The group along `root_axes`, from the root's cache or made (collectively) and cached.
  ProcessGroup root_group(const StaticVector<int, max_mesh_rank>& root_axes) const {
    const std::vector<int> key(root_axes.begin(), root_axes.end());
    std::lock_guard lock(root_->mutex);
    auto it = root_->groups.find(key);
    if (it == root_->groups.end()) {
      it = root_->groups.emplace(key, split_along(*root_, root_axes)).first;
    }
    return it->second;
  }

  std::shared_ptr<const detail::MeshRoot> root_;
  std::array<StaticVector<int, max_mesh_rank>, ndim> axes_; ///< root axes merged into each axis
  std::array<ProcessGroup, ndim> groups_;
  MeshSizes sizes_;
  MeshCoord coord_;
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
  std::array<StaticVector<int, max_mesh_rank>, Shape::rank> axes;
  std::array<ProcessGroup, Shape::rank> groups;
  for (int a = 0; a < Shape::rank; ++a) {
    axes[a].push_back(a);
    groups[a] = DeviceMesh<Shape>::split_along(*root, axes[a]);
  }
  return DeviceMesh<Shape>(std::move(root), axes, std::move(groups));
}

} // namespace dtensor
