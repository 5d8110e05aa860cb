#pragma once
// What makes a layer a unit of a model (nn/contract.hpp), and the base that writes it once:
//
//   template <class T>
//   struct Feedforward : nn::Layer<Feedforward<T>> {          // a user's layer: its parameters, listed
//     Column<T> up;                                           // once, and its forward with its backward
//     Row<T> down;
//     static constexpr auto parameter_members() { return std::tuple{&Feedforward::up, &Feedforward::down}; }
//     static constexpr auto state_members() { return std::tuple{}; }   // optional: see below
//     auto forward(const Rows<T>& x, WithBackwardTag) const;  // WithBackward{y, back}: back(dy) gives
//   };                                                        // nn::Gradients{dx, std::tuple{dup, ddown}}
//
// nn::Layer gives parameters() (std::tie of the members, in the listed order) and with_parameters(w...)
// (a copy of the layer on other handles of its parameters: FSDP's gathered views). The trainers read a
// layer's parameter types from parameters() (nn::parameter_types_t), or from its own `parameter_types`
// where it declares one, and run forward(x) where a layer has it, else forward(x, with_backward).output.
//
// with_parameters in another element type (FSDP's mixed precision: float shards gathered in bfloat16) makes
// the layer of that type: Layer<T, Rest...> becomes Layer<U, Rest...> (or the layer's own
// `template <class U> using rebind`), built from the new parameters and then the members the layer lists in
// state_members() (everything that is not a parameter: a config, an epsilon; `std::tuple{}` for none):
// Other(w..., state...), or Other{{}, w..., state...} for an aggregate whose members are in that order.
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace dtensor::nn {

namespace detail {

template <class Tuple>
struct decayed_tuple;
template <class... W>
struct decayed_tuple<std::tuple<W...>> {
  using type = std::tuple<std::remove_cvref_t<W>...>;
};

template <class U>
struct parameter_types_of {
  using type = typename decayed_tuple<decltype(std::declval<U&>().parameters())>::type;
};
template <class U>
requires requires {
  typename U::parameter_types;
}
struct parameter_types_of<U> {
  using type = typename U::parameter_types;
};

} // namespace detail

/// The DTensor types of a layer's parameters, in order: its parameter_types, or what parameters() ties.
template <class U>
using parameter_types_t = typename detail::parameter_types_of<U>::type;

namespace detail {

/// Layer type D in element type U: D's own rebind<U>, or Tmpl<U, Rest...> for D = Tmpl<T, Rest...>.
template <class D, class U>
struct rebind_layer {};
template <template <class...> class Tmpl, class T, class... Rest, class U>
struct rebind_layer<Tmpl<T, Rest...>, U> {
  using type = Tmpl<U, Rest...>;
};
template <class D, class U>
struct rebind_layer_of : rebind_layer<D, U> {};
template <class D, class U>
requires requires {
  typename D::template rebind<U>;
}
struct rebind_layer_of<D, U> {
  using type = typename D::template rebind<U>;
};

/// Other built from parameters w and state s (see the top of the file).
template <class Other, class... A>
Other build_layer(const A&... a) {
  if constexpr (std::is_constructible_v<Other, const A&...>) {
    return Other(a...);
  } else {
    static_assert(std::is_aggregate_v<Other>,
                  "nn::Layer::with_parameters in another element type: the layer is built from its "
                  "parameters then its state_members(), in order: give it that constructor");
    return Other{{}, a...};
  }
}

} // namespace detail

/// The plumbing of a layer, written once (see the top of the file): Derived lists its parameter members
/// in `static constexpr auto parameter_members()` (and its other members in state_members(), for another
/// element type) and writes forward(x, with_backward).
template <class Derived>
struct Layer {
  /// std::tie of the parameters, in parameter_members()' order.
  auto parameters() {
    return std::apply([&](auto... m) { return std::tie(static_cast<Derived&>(*this).*m...); },
                      Derived::parameter_members());
  }
  /// The same layer on other handles of its parameters, in parameters()' order: of the same types (a copy
  /// of the layer), or of another element type (the layer of that type: see the top of the file).
  template <class... W>
  auto with_parameters(const W&... w) const {
    constexpr auto members = Derived::parameter_members();
    static_assert(sizeof...(W) == std::tuple_size_v<decltype(members)>,
                  "nn::Layer::with_parameters: every parameter of the layer, in parameter_members()' order");
    const Derived& self = static_cast<const Derived&>(*this);
    if constexpr (same_types<W...>(std::make_index_sequence<sizeof...(W)>{})) {
      Derived out = self;
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((out.*std::get<I>(members) = w), ...);
      }
      (std::index_sequence_for<W...>{});
      return out;
    } else {
      using U = typename std::tuple_element_t<0, std::tuple<W...>>::value_type;
      static_assert(
          requires { typename detail::rebind_layer_of<Derived, U>::type; },
          "nn::Layer::with_parameters in another element type: the layer is a template over its "
          "element type first (Layer<T, ...>), or names `template <class U> using rebind`");
      static_assert(
          requires { Derived::state_members(); },
          "nn::Layer::with_parameters in another element type: list the layer's other members in "
          "`static constexpr auto state_members()` (std::tuple{} for none)");
      using Other = typename detail::rebind_layer_of<Derived, U>::type;
      return std::apply([&](auto... m) { return detail::build_layer<Other>(w..., self.*m...); },
                        Derived::state_members());
    }
  }

private:
  /// The W are the parameters' own types.
  template <class... W, std::size_t... I>
  static constexpr bool same_types(std::index_sequence<I...>) {
    return (std::is_same_v<std::remove_cvref_t<decltype(std::declval<const Derived&>().*
                                                        std::get<I>(Derived::parameter_members()))>,
                           W> &&
            ...);
  }
};

} // namespace dtensor::nn
