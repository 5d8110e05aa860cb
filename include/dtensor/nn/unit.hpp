#pragma once
// What makes a layer a unit of a model (nn/contract.hpp), and the base that writes it once:
//
//   template <class T>
//   struct Feedforward : nn::Layer<Feedforward<T>> {          // a user's layer: its parameters, listed
//     Column<T> up;                                           // once, and its forward with its backward
//     Row<T> down;
//     static constexpr auto parameter_members() { return std::tuple{&Feedforward::up, &Feedforward::down}; }
//     auto forward(const Rows<T>& x, WithBackwardTag) const;  // WithBackward{y, back}: back(dy) gives
//   };                                                        // nn::Gradients{dx, std::tuple{dup, ddown}}
//
// nn::Layer gives parameters() (std::tie of the members, in the listed order) and with_parameters(w...)
// (a copy of the layer on other handles of its parameters: FSDP's gathered views). The trainers read a
// layer's parameter types from parameters() (nn::parameter_types_t), or from its own `parameter_types`
// where it declares one, and run forward(x) where a layer has it, else forward(x, with_backward).output.
// with_parameters of nn::Layer keeps the element type; a layer trained under FSDP in another compute type
// (mixed precision) writes its own, as the layers of dtensor::nn do.
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

/// The plumbing of a layer, written once (see the top of the file): Derived lists its parameter members
/// in `static constexpr auto parameter_members()` and writes forward(x, with_backward).
template <class Derived>
struct Layer {
  /// std::tie of the parameters, in parameter_members()' order.
  auto parameters() {
    return std::apply([&](auto... m) { return std::tie(static_cast<Derived&>(*this).*m...); },
                      Derived::parameter_members());
  }
  /// The same layer on other handles of its parameters (of the same types), in parameters()' order.
  template <class... W>
  Derived with_parameters(const W&... w) const {
    constexpr auto members = Derived::parameter_members();
    static_assert(sizeof...(W) == std::tuple_size_v<decltype(members)>,
                  "nn::Layer::with_parameters: every parameter of the layer, in parameter_members()' order");
    Derived out = static_cast<const Derived&>(*this);
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      static_assert((std::is_same_v<std::remove_cvref_t<decltype(out.*std::get<I>(members))>, W> && ...),
                    "nn::Layer::with_parameters keeps the element type: a layer trained in another compute "
                    "type (FSDP's mixed precision) writes its own with_parameters");
      ((out.*std::get<I>(members) = w), ...);
    }
    (std::index_sequence_for<W...>{});
    return out;
  }
};

} // namespace dtensor::nn
