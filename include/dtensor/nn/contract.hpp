#pragma once
// The contract between a model and the trainers: what nn::DdpTrainer, nn::FsdpTrainer and
// nn::PipelineTrainer need of any model, stated as the concepts nn::Unit and nn::Model.
//
// A unit is a layer the trainers schedule as one: one FSDP group, one stretch of the optimizer's parameter
// indices, a point where a pipeline may cut. It has
//
//   auto parameters();                              // std::tie of its DTensor parameters, in order
//   auto with_parameters(const W&... w) const;      // the same unit on other handles (FSDP's gathered
//                                                   // views; another element type under mixed precision)
//   auto forward(const X& x, with_backward) const;  // WithBackward{y, back}: auto [dx, grads] = back(dy)
//   auto forward(const X& x) const;                 // optional: y alone (evaluation; else the above's y)
//
// nn::Layer (nn/unit.hpp) writes parameters() and with_parameters() from a list of the layer's parameter
// members. Every layer of dtensor::nn is a unit; nn::Chain makes several layers one unit. A unit may have no
// parameters (std::tuple<>: a pooling, a reshape); the trainers then only run it.
//
// A model is an ordered list of units and a loss:
//
//   auto units();                // std::tie(a, blocks, b): its units in the order of the forward, each a
//                                // unit or a std::vector of units of one type (a run of blocks)
//   auto loss_function() const;  // f(y, target, with_backward) -> WithBackward{loss, back}: loss a rank-0
//                                // DTensor (the mean over the global batch), back(g) y's gradient for a
//                                // loss gradient g; nn::CrossEntropyLoss, nn::MseLoss (nn/losses.hpp)
//
// The input of a step is what the first unit takes (token ids, images, a struct of two tensors), each
// unit's output is the next one's input, and the last unit's output and the target go to the loss:
//
//   struct Regressor {                                     // a user's model: its layers and four lines
//     nn::Linear<float, L> in;  std::vector<MyBlock> blocks;  nn::Linear<float, L> out;
//     auto units() { return std::tie(in, blocks, out); }
//     auto loss_function() const { return nn::MseLoss{}; }
//   };
//   nn::FsdpTrainer<Regressor, Fsdp<"dp">> trainer(mesh, Regressor{...});
//   trainer.step(x, y, opt);
//
// A trainer states the contract with static_assert(nn::check_model<M>()): each missing piece is its own
// compile error saying what to add. nn::Model<M> is the same test as a concept, for requires-clauses.
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtensor/backward/with_backward.hpp"
#include "dtensor/local/copy.hpp"
#include "dtensor/nn/unit.hpp"
#include "dtensor/ops/typed_rules.hpp"
#include "dtensor/tensor/dtensor.hpp"

namespace dtensor::nn {

namespace detail {

template <class U>
concept HasParameters = requires(U& u) {
  std::tuple_size<decltype(u.parameters())>::value;
};
template <class U, class Tuple>
struct rebuildable : std::false_type {};
template <class U, class... W>
    struct rebuildable<U, std::tuple<W...>> : std::bool_constant < requires(const U& u, const W&... w) {
  u.with_parameters(w...);
} > {};

} // namespace detail

/// A layer the trainers can schedule as one (see the top of the file).
template <class U>
concept Unit = detail::HasParameters<U> && detail::rebuildable<U, parameter_types_t<U>>::value;

namespace detail {

/// Whether E is a run of units: a std::vector of one unit type.
template <class E>
struct is_unit_run : std::false_type {};
template <class U, class A>
struct is_unit_run<std::vector<U, A>> : std::true_type {};

/// The unit type of an element of units(): E itself, or a run's value type.
template <class E>
struct unit_of {
  using type = E;
};
template <class U, class A>
struct unit_of<std::vector<U, A>> {
  using type = U;
};
template <class E>
using unit_of_t = typename unit_of<std::remove_cvref_t<E>>::type;

template <class E>
concept UnitElement = Unit<unit_of_t<E>> && std::is_lvalue_reference_v<E>;

template <class Tuple>
struct units_ok : std::false_type {};
template <class... E>
struct units_ok<std::tuple<E...>> : std::bool_constant<(sizeof...(E) >= 1) && (UnitElement<E> && ...)> {};

template <class M>
concept HasUnits = requires(M& m) {
  m.units();
};
template <class M>
concept HasLossFunction = requires(const M& m) {
  m.loss_function();
};

} // namespace detail

/// A model of the contract (see the top of the file).
template <class M>
concept Model = detail::HasUnits<M> && detail::units_ok<decltype(std::declval<M&>().units())>::value &&
    detail::HasLossFunction<M>;

namespace detail {

/// @post true: element I of a model's units() is a unit or a run of units (each failed check is its own
/// static_assert; the element's index and type are in the instantiation that reports it).
template <std::size_t I, class E>
consteval bool check_unit_element() {
  static_assert(std::is_lvalue_reference_v<E>,
                "nn::Model: units() returns std::tie(...) of the model's members (references: the trainers "
                "take the parameters out of them), not copies");
  using U = unit_of_t<E>;
  static_assert(
      HasParameters<U>,
      "nn::Model: a unit gives `auto parameters()`, std::tie of its DTensor parameters (std::tuple<>{} "
      "for none), and with_parameters: derive the layer from nn::Layer and list them in "
      "parameter_members(), or wrap several layers in nn::Chain");
  if constexpr (HasParameters<U>) {
    static_assert(rebuildable<U, parameter_types_t<U>>::value,
                  "nn::Model: a unit gives `with_parameters(const W&... w) const`: the same unit on other "
                  "handles of its parameters, in parameters()' order (FSDP runs it on gathered views)");
  }
  return true;
}

template <class Tuple>
struct check_elements;
template <class... E>
struct check_elements<std::tuple<E...>> {
  static consteval bool run() {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (check_unit_element<I, E>() && ...);
    }
    (std::index_sequence_for<E...>{});
  }
};

template <class T>
struct is_std_tuple : std::false_type {};
template <class... E>
struct is_std_tuple<std::tuple<E...>> : std::true_type {};

} // namespace detail

/// @post true: M is a model of the contract; each missing piece is its own static_assert naming it.
template <class M>
consteval bool check_model() {
  static_assert(
      detail::HasUnits<M>,
      "nn::Model: the model has no units(): give it `auto units() { return std::tie(a, blocks, b); "
      "}`, its units in the order of the forward (a layer, or a std::vector of layers of one type)");
  if constexpr (detail::HasUnits<M>) {
    using Units = decltype(std::declval<M&>().units());
    static_assert(
        detail::is_std_tuple<Units>::value,
        "nn::Model: units() returns a std::tuple of references to the units: std::tie(a, blocks, b)");
    if constexpr (detail::is_std_tuple<Units>::value) {
      static_assert(std::tuple_size_v<Units> >= 1, "nn::Model: units() names at least one unit");
      static_assert(detail::check_elements<Units>::run());
    }
  }
  static_assert(detail::HasLossFunction<M>,
                "nn::Model: the model has no loss_function(): give it `auto loss_function() const { return "
                "nn::MseLoss{}; }` (or nn::CrossEntropyLoss{}, or any f(y, target, with_backward) returning "
                "WithBackward{rank-0 DTensor, back})");
  return true;
}

/// The model's units, as units() ties them.
template <Model M>
using units_t = decltype(std::declval<M&>().units());

namespace detail {

/// The type of a unit's parameter tuple.
template <class U>
using unit_params_t = parameter_types_t<U>;

template <class U>
inline constexpr std::size_t unit_param_count = std::tuple_size_v<unit_params_t<U>>;

/// The first parameter type of the units of a tuple of unit elements (void: none has one).
template <class Tuple>
struct first_param;
template <>
struct first_param<std::tuple<>> {
  using type = void;
};
template <class E, class... Rest>
struct first_param<std::tuple<E, Rest...>> {
  using U = unit_of_t<E>;
  using type = typename std::conditional_t<(unit_param_count<U> > 0), std::tuple_element<0, unit_params_t<U>>,
                                           first_param<std::tuple<Rest...>>>::type;
};

template <class D>
struct mesh_shape_of_dtensor;
template <class T, int R, class S, class... Q>
struct mesh_shape_of_dtensor<DTensor<T, R, S, Q...>> {
  using type = S;
};

} // namespace detail

/// The first parameter's DTensor type of a model: its element type and mesh are the model's.
template <Model M>
using first_parameter_t = typename detail::first_param<units_t<M>>::type;

/// The element type of a model's parameters (nn::LanguageModel<T, ...>: T).
template <Model M>
using model_value_t = typename first_parameter_t<M>::value_type;

namespace detail {

/// model_value_t of M where M is a model, else void: the trainers' default compute type, so that a type
/// that is not a model reaches their check_model (which says what is missing) instead of failing here.
template <class M>
struct value_or_void {
  using type = void;
};
template <Model M>
struct value_or_void<M> {
  using type = model_value_t<M>;
};
template <class M>
using value_or_void_t = typename value_or_void<M>::type;

} // namespace detail

/// The mesh shape of a model's parameters.
template <Model M>
using model_mesh_t = typename detail::mesh_shape_of_dtensor<first_parameter_t<M>>::type;

/// Every parameter of the model, as a nest: a tuple with one entry per element of units(), a unit's
/// parameters() or, for a run, a std::vector of them. The trainers' and the checkpoint's parameter order.
template <Model M>
auto model_parameters(M& m) {
  return std::apply(
      [](auto&... e) {
        return std::tuple{[](auto& x) {
          if constexpr (detail::is_unit_run<std::remove_cvref_t<decltype(x)>>::value) {
            std::vector<decltype(x[0].parameters())> v;
            v.reserve(x.size());
            for (auto& u : x) {
              v.push_back(u.parameters());
            }
            return v;
          } else {
            return x.parameters();
          }
        }(e)...};
      },
      m.units());
}

/// The output of model m's units on `input`, no backward (evaluation: the last unit's output, e.g. logits).
template <Model M, class Input>
auto model_forward(M& m, const Input& input);

namespace detail {

/// f(unit, element I, index) for each unit of element e of units() (a unit, or a run of them).
template <std::size_t I, class E, class F>
void visit_element(E& e, F& f) {
  if constexpr (is_unit_run<std::remove_cvref_t<E>>::value) {
    for (std::size_t j = 0; j < e.size(); ++j) {
      f(e[j], std::integral_constant<std::size_t, I>{}, j);
    }
  } else {
    f(e, std::integral_constant<std::size_t, I>{}, std::size_t(0));
  }
}

template <class Units, class F, std::size_t... I>
void visit_elements(Units& units, F& f, std::index_sequence<I...>) {
  (visit_element<I>(std::get<I>(units), f), ...);
}

} // namespace detail

/// f(unit, element, index) for every unit of the model in the order of the forward: `element` the index of
/// its element of units() (a std::integral_constant), `index` its place in a run (0 for a single unit).
template <class Units, class F>
void for_each_unit(Units&& units, F&& f) {
  detail::visit_elements(units, f, std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<Units>>>{});
}

namespace detail {

/// The DTensor type X with element type C.
template <class C, class X>
struct with_value;
template <class C, class T, int R, class S, class... Q>
struct with_value<C, DTensor<T, R, S, Q...>> {
  using type = DTensor<C, R, S, Q...>;
};

/// x in element type C: a floating DTensor of another element type converted (an input or a target under
/// mixed precision), anything else as it is (token ids, a struct of inputs).
template <class C, class X>
auto in_compute_type(const X& x) {
  if constexpr (AnyDTensor<X>) {
    using V = typename X::value_type;
    if constexpr (!std::is_same_v<V, C> &&
                  (std::is_floating_point_v<V> || dtensor::detail::is_reduced_float_v<V>)) {
      using Y = typename with_value<C, X>::type;
#if DTENSOR_HAS_CUDA
      Tensor<C, X::rank> local(x.local().shape(), x.local().device(), x.local().stream());
#else
      Tensor<C, X::rank> local(x.local().shape(), x.local().device());
#endif
      local::convert(local, x.local().contiguous());
      return Y(x.mesh(), std::move(local), x.global_shape());
    } else {
      return x;
    }
  } else {
    return x;
  }
}

/// u's output on x: forward(x) where u has it, else forward(x, with_backward)'s.
template <class U, class X>
auto forward_only(const U& u, const X& x) {
  if constexpr (requires { u.forward(x); }) {
    return u.forward(x);
  } else {
    return u.forward(x, with_backward).output;
  }
}

/// The output of units I.. of `units` on input x, no backward.
template <std::size_t I, class Units, class X>
auto forward_units(Units& units, const X& x) {
  if constexpr (I == std::tuple_size_v<Units>) {
    return x;
  } else {
    auto& e = std::get<I>(units);
    if constexpr (is_unit_run<std::remove_cvref_t<decltype(e)>>::value) {
      X h = x;
      for (const auto& u : e) {
        h = forward_only(u, h);
      }
      return forward_units<I + 1>(units, h);
    } else {
      return forward_units<I + 1>(units, forward_only(e, x));
    }
  }
}

/// Forward and backward of units I.. from x: `tail(y)` takes the last unit's output and returns its
/// gradient (the loss's forward and backward), `on(element, index, grads)` gets each unit's parameter
/// gradients as the backward makes them (the last unit's first, as DDP's buckets want them). Returns x's
/// gradient. A run's units must map their input type to itself.
template <std::size_t I, class Units, class X, class Tail, class On>
auto backprop_units(Units& units, const X& x, Tail& tail, On& on) {
  if constexpr (I == std::tuple_size_v<Units>) {
    return tail(x);
  } else {
    auto& e = std::get<I>(units);
    const std::integral_constant<std::size_t, I> element;
    if constexpr (is_unit_run<std::remove_cvref_t<decltype(e)>>::value) {
      using U = unit_of_t<decltype(e)>;
      static_assert(
          requires(const U& u) { u.forward(x, with_backward); },
          "nn::Model: a unit of a run cannot take what the unit before it gives");
      using Back = decltype(std::declval<const U&>().forward(x, with_backward).backward);
      static_assert(
          std::is_same_v<decltype(forward_only(std::declval<const U&>(), x)), X>,
          "nn::Model: the units of a run (a std::vector in units()) map their input type to itself");
      std::vector<Back> backs;
      backs.reserve(e.size());
      X h = x;
      for (const auto& u : e) {
        auto [y, back] = u.forward(h, with_backward);
        backs.push_back(std::move(back));
        h = std::move(y);
      }
      auto dy = backprop_units<I + 1>(units, h, tail, on);
      for (std::size_t j = e.size(); j-- > 0;) {
        auto [dx, grads] = backs[j](dy);
        on(element, j, std::move(grads));
        dy = std::move(dx);
      }
      return dy;
    } else {
      static_assert(
          requires { e.forward(x, with_backward); },
          "nn::Model: a unit cannot take what the unit before it gives (or, for the first unit, the "
          "step's input)");
      auto [y, back] = e.forward(x, with_backward);
      auto dy = backprop_units<I + 1>(units, y, tail, on);
      auto [dx, grads] = back(dy);
      on(element, std::size_t(0), std::move(grads));
      return dx;
    }
  }
}

} // namespace detail

template <Model M, class Input>
auto model_forward(M& m, const Input& input) {
  auto units = m.units();
  return detail::forward_units<0>(units, input);
}

} // namespace dtensor::nn
