#pragma once
// Axis and MeshShape: the compile-time description of a device mesh.
//
//   using Mesh = MeshShape<Axis<"dp">, Axis<"tp", 4>>;   // dp known at run time, tp = 4
//   static_assert(Mesh::index_of<"tp">() == 1);
//
// Like std::extents, each axis size is either static (in the type) or dynamic (`Axis<"dp">`, known once
// the mesh is built from a process group). The rank order is row-major: the last axis varies fastest.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "dtensor/core/fixed_string.hpp"
#include "dtensor/layout/algebra.hpp"

namespace dtensor {

/// Size of an axis known only at run time.
inline constexpr int dynamic_size = -1;

/// One named mesh axis: `Axis<"tp", 4>` (static size) or `Axis<"dp">` (size known at run time).
template <fixed_string Name, int Size = dynamic_size>
struct Axis {
  static_assert(Name.size() > 0, "Axis<\"\">: a mesh axis needs a non-empty name, e.g. Axis<\"tp\", 4>");
  static_assert(Size > 0 || Size == dynamic_size,
                "Axis<name, Size>: Size must be > 0; write Axis<\"name\"> for a size known only at run time");
  static constexpr std::string_view name = Name.view();
  static constexpr int size = Size;
  using dtensor_axis_tag = void; // recognised by a member, not by partial specialization (nvcc 13 fails
                                 // to deduce class-type template arguments there)
  static constexpr bool is_static = Size != dynamic_size;
};

namespace detail {
template <class A>
inline constexpr bool is_axis = requires {
  typename A::dtensor_axis_tag;
};

/// A MeshShape argument as an Axis: the axis itself, or for anything else (which MeshShape's static_assert
/// rejects) a nameless static axis of size 1, so that MeshShape's members add no error of their own.
template <class A>
struct axis_of {
  static constexpr std::string_view name{};
  static constexpr int size = 1;
  static constexpr bool is_static = true;
};
template <class A>
requires is_axis<A>
struct axis_of<A> : A {
};

template <std::size_t N>
constexpr bool names_unique(const std::array<std::string_view, N>& names) noexcept {
  for (std::size_t i = 0; i < N; ++i) {
    for (std::size_t j = i + 1; j < N; ++j) {
      if (names[i] == names[j]) {
        return false;
      }
    }
  }
  return true;
}

template <std::size_t N>
constexpr int find_name(const std::array<std::string_view, N>& names, std::string_view name) noexcept {
  for (std::size_t i = 0; i < N; ++i) {
    if (names[i] == name) {
      return static_cast<int>(i);
    }
  }
  return -1;
}
} // namespace detail

/// The axes of a device mesh, in rank order (row-major: the last axis varies fastest).
template <class... Axes>
struct MeshShape {
  static_assert((detail::is_axis<Axes> && ...),
                "MeshShape<...> takes Axis<\"name\", size> or Axis<\"name\"> arguments only");
  static_assert(sizeof...(Axes) >= 1, "MeshShape<> needs at least one Axis");
  static_assert(sizeof...(Axes) <= max_mesh_rank, "MeshShape: at most 8 axes are supported");

  static constexpr int rank = static_cast<int>(sizeof...(Axes));
  static constexpr std::array<std::string_view, sizeof...(Axes)> names{detail::axis_of<Axes>::name...};
  /// Axis sizes; dynamic_size (-1) where the size is known only at run time.
  static constexpr std::array<int, sizeof...(Axes)> static_sizes{detail::axis_of<Axes>::size...};

  static_assert(!(detail::is_axis<Axes> && ...) || detail::names_unique(names),
                "MeshShape: two axes have the same name; give every axis a unique name");

  /// Number of axes whose size is dynamic.
  static constexpr int num_dynamic = ((detail::axis_of<Axes>::is_static ? 0 : 1) + ...);
  /// True when every axis size is in the type.
  static constexpr bool is_static = num_dynamic == 0;
  /// Product of the static axis sizes (dynamic axes count as 1).
  static constexpr std::int64_t static_product =
      (std::int64_t{1} * ... * (detail::axis_of<Axes>::is_static ? detail::axis_of<Axes>::size : 1));

  /// True when an axis is called `Name`.
  template <fixed_string Name>
  static constexpr bool has_axis = detail::find_name(names, Name.view()) >= 0;

  /// Position of the axis called `Name`.
  template <fixed_string Name>
  static consteval int index_of() {
    static_assert(has_axis<Name>, "MeshShape::index_of<\"name\">: no mesh axis has this name; use one of "
                                  "the names given to Axis<...> in this MeshShape");
    return detail::find_name(names, Name.view());
  }

  /// The static sizes as a MeshSizes value (-1 for dynamic axes).
  static constexpr MeshSizes sizes() noexcept {
    MeshSizes s;
    for (int v : static_sizes) {
      s.push_back(v);
    }
    return s;
  }

  /// "(dp=?, tp=4)": dynamic sizes print as '?'.
  static std::string to_string() { return mesh_to_string(names, sizes()); }
};

} // namespace dtensor
