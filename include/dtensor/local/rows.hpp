#pragma once
// Kernels that move rows of a (rows, width) tensor by an index (nn::Moe's dispatch and combine): gather the
// rows an index names, each scaled by a weight, and add up each token's k weighted rows. Host and CUDA
// (local::launch: the host loop, or one CUDA thread per row under nvcc), as the other local kernels.
//
//   Tensor<float, 2> picked = local::gather_rows(x, {2, 0, 2}, {0.5, 1.0, 0.25});   // rows 2, 0, 2 of x
//   Tensor<float, 2> y = local::combine_rows(picked, {0, 1, 2, -1}, {}, /*tokens=*/2, /*k=*/2);
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "dtensor/core/config.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/tensor.hpp"
#include "dtensor/local/pointwise.hpp"

namespace dtensor {

namespace detail {

/// A host vector as a 1-D tensor on the device of `like`.

template <class V, class T>
Tensor<V, 1> host_values(const std::vector<V>& v, const Tensor<T, 2>& like) {
  Tensor<V, 1> host({static_cast<std::int64_t>(v.size())});
  std::copy(v.begin(), v.end(), host.data());
  return like.device().is_cuda() ? host.to(like.device()) : host;
}

template <class T>
Tensor<T, 1> host_weights(const std::vector<double>& v, const Tensor<T, 2>& like) {
  Tensor<T, 1> host({static_cast<std::int64_t>(v.size())});
  for (std::size_t i = 0; i < v.size(); ++i) {
    host.data()[i] = T(v[i]);
  }
  return like.device().is_cuda() ? host.to(like.device()) : host;
}

} // namespace detail

namespace local {

/// Row i: out[i, :] = in[index[i], :] * (weight ? weight[i] : 1).
template <class T>
struct GatherRows {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const T* in;
  const std::int64_t* index;
  const T* weight;
  std::int64_t width;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t r) const {
    using C = compute_t<T>;
    const T* src = in + index[r] * width;
    T* o = out + r * width;
    if (weight == nullptr) {
      for (std::int64_t c = 0; c < width; ++c) {
        o[c] = src[c];
      }
      return;
    }
    const C w = static_cast<C>(weight[r]);
    for (std::int64_t c = 0; c < width; ++c) {
      o[c] = T(w * static_cast<C>(src[c]));
    }
  }
};

/// Row t: out[t, :] = sum over j < k of (weight ? weight[t, j] : 1) * rows[slot[t, j], :] (slot < 0:
/// nothing).
template <class T>
struct CombineRows {
  struct {
    std::int64_t count;
  } layout;
  T* out;
  const T* rows;
  const std::int64_t* slot;
  const T* weight;
  std::int64_t k;
  std::int64_t width;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t t) const {
    using C = compute_t<T>;
    T* o = out + t * width;
    for (std::int64_t c = 0; c < width; ++c) {
      o[c] = T(0);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = slot[t * k + j];
      if (s < 0) {
        continue;
      }
      const C w = weight == nullptr ? C(1) : static_cast<C>(weight[t * k + j]);
      const T* src = rows + s * width;
      for (std::int64_t c = 0; c < width; ++c) {
        o[c] = T(static_cast<C>(o[c]) + w * static_cast<C>(src[c]));
      }
    }
  }
};

/// The rows of `in` picked by `index`, each scaled by `weight` (empty: 1).
template <class T>
Tensor<T, 2> gather_rows(const Tensor<T, 2>& in, const std::vector<std::int64_t>& index,
                         const std::vector<double>& weight = {}) {
  const std::int64_t width = in.shape()[1];
  Tensor<T, 2> out =
      dtensor::detail::empty_like(std::array<std::int64_t, 2>{std::int64_t(index.size()), width}, in);
  const auto idx = dtensor::detail::host_values(index, in);
  const auto w = dtensor::detail::host_weights<T>(weight, in);
  const Tensor<T, 2> src = in.contiguous();
  local::GatherRows<T> run{
      {out.shape()[0]}, out.data(), src.data(), idx.data(), weight.empty() ? nullptr : w.data(), width};
  local::launch(run, in.device(), in.stream_handle(), "local::gather_rows");
  return out;
}

/// Per token, the (weighted; empty: weight 1) sum of its k rows (slot -1: none).
template <class T>
Tensor<T, 2> combine_rows(const Tensor<T, 2>& rows, const std::vector<std::int64_t>& slot,
                          const std::vector<double>& weight, std::int64_t tokens, std::int64_t k) {
  const std::int64_t width = rows.shape()[1];
  Tensor<T, 2> out = dtensor::detail::empty_like(std::array<std::int64_t, 2>{tokens, width}, rows);
  const auto s = dtensor::detail::host_values(slot, rows);
  const auto w = dtensor::detail::host_weights<T>(weight, rows);
  const Tensor<T, 2> src = rows.contiguous();
  local::CombineRows<T> run{{tokens}, out.data(), src.data(), s.data(), weight.empty() ? nullptr : w.data(),
                            k,        width};
  local::launch(run, rows.device(), rows.stream_handle(), "local::combine_rows");
  return out;
}

} // namespace local
} // namespace dtensor
