#pragma once
// How the typed front ends (comm/collectives.hpp, comm/p2p.hpp, backward/collectives.hpp) call a backend,
// in dtensor::detail: a Tensor becomes a BufferRef after the checks every op makes before any
// communication (comm_buffer), flat staging copies and displacements serve the variable-size ops, and
// launch submits an op and either waits for it or returns its Work.

#include "dtensor/backends/backend.hpp"
#include "dtensor/comm/process_group.hpp"
#include "dtensor/comm/work.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/tensor.hpp"

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace dtensor::detail {

/// "all_reduce on rank 1 (global 1) of gloo group [0,1]"
inline std::string op_context(const ProcessGroup& group, const char* op) {
  return std::string(op) + " on " + group.to_string();
}

/// The buffer of `t`, after checking it is defined and contiguous (the backend checks the device).
template <class T, int Rank>
BufferRef comm_buffer(const Tensor<T, Rank>& t, const ProcessGroup& group, const char* op, const char* what) {
  const std::string name = std::string("the ") + what + (*what ? " " : "") + "tensor";
  DTENSOR_CHECK(t.defined(), op_context(group, op) + ": " + name + " is undefined");
  DTENSOR_CHECK(t.is_contiguous(), op_context(group, op) + ": " + name + " " + shape_to_string(t.shape()) +
                                       " (strides " + shape_to_string(t.strides()) +
                                       ") is not contiguous; pass t.contiguous() (and copy back)");
  return BufferRef{t.data(), t.numel(), dtype_v<T>, t.device(), t.stream_handle()};
}

/// Options of a synchronous op (the caller waits at once).
inline CommOptions blocking_options() {
  CommOptions o;
  o.blocking = true;
  return o;
}

/// Keeps copies of tensors (shared storage) alive until an op completes.
template <class... Ts>
std::shared_ptr<void> keep_alive(Ts... ts) {
  return std::make_shared<std::tuple<Ts...>>(std::move(ts)...);
}

/// staging[at .. at + t.numel()) = t (contiguous `t`; host or device memory, via Tensor::copy_from).
template <class T, int Rank>
void copy_to_flat(const Tensor<T, 1>& staging, std::int64_t at, const Tensor<T, Rank>& t) {
  if (t.numel() > 0) {
    staging.narrow(0, at, t.numel()).copy_from(t.template view<1>({t.numel()}));
  }
}

/// t = staging[at .. at + t.numel()) (contiguous `t`; host or device memory).
template <class T, int Rank>
void copy_from_flat(const Tensor<T, Rank>& t, const Tensor<T, 1>& staging, std::int64_t at) {
  if (t.numel() > 0) {
    t.template view<1>({t.numel()}).copy_from(staging.narrow(0, at, t.numel()));
  }
}

/// Exclusive prefix sums.
inline std::vector<std::int64_t> displacements(std::span<const std::int64_t> counts) {
  std::vector<std::int64_t> d(counts.size());
  std::int64_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    d[i] = at;
    at += counts[i];
  }
  return d;
}

/// Elements per dim-0 row of `shape` (1 for rank 0).
template <std::size_t N>
std::int64_t row_elements(const std::array<std::int64_t, N>& shape) {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < N; ++i) {
    n *= shape[i];
  }
  return n;
}

/// Submits an op (sync: waits, runs `finish`, returns an empty Work; async: returns its Work).
template <class Submit>
Work launch(bool async, Submit&& submit, std::shared_ptr<void> keep = {}, std::function<void()> finish = {}) {
  if (!async) {
    auto impl = submit(blocking_options());
    impl->wait();
    if (finish) {
      finish();
    }
    return Work();
  }
  return Work(submit(CommOptions{}), std::move(keep), std::move(finish));
}

} // namespace dtensor::detail
