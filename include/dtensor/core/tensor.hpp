#pragma once
// Tensor<T, Rank>: a local, strided, reference-counted n-d array on the host or one CUDA GPU.
//
//   auto a = dtensor::Tensor<float, 2>::zeros({4, 6});        // host, contiguous row-major
//   auto b = a.narrow(1, 2, 3);                                // (4, 3) view, shares a's memory
//   b.fill(1.0f);                                              // writes into a
//   auto c = b.contiguous();                                   // (4, 3) copy, strides (3, 1)
//   auto d = c.view<1>({-1});                                  // (12), shares c's memory
//   auto g = a.to(dtensor::Device::cuda(0));                   // device copy (needs CUDA)
//   auto m = a.to(dtensor::Device::meta());                    // shape and dtype only (core/device.hpp)
//
// Semantics follow torch.Tensor: copying a Tensor copies the handle (the memory is shared), views
// (narrow, view) share memory with their source, clone/to/contiguous-of-a-strided-tensor copy.
// Host memory is 64-byte aligned (core/host_memory.hpp, which also says how freed memory is kept for
// reuse). Device memory is stream ordered (cudaMallocAsync/cudaFreeAsync on the tensor's stream, the
// legacy default stream unless one is given), and so is device work, as in torch: copy_from, fill, clone,
// to, zeros and full enqueue on the tensor's stream and return; the host waits only where it reads the
// result (a copy to host memory, item()) or copies out of pinned host memory (core/cuda_sync.hpp). On the
// host they are synchronous.
// Printing and comparison live in tensor_io.hpp, so this header stays cheap to include.

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "dtensor/core/checked_int.hpp"
#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/host_memory.hpp"

#if DTENSOR_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

// cudaStream_t is `CUstream_st*`; declaring the struct lets every build carry a stream handle without
// including a CUDA header.
struct CUstream_st;

namespace dtensor {

inline namespace DTENSOR_CONFIG_NS {
class AnyTensor;
} // namespace DTENSOR_CONFIG_NS

namespace detail {

template <std::size_t N>
std::string shape_to_string(const std::array<std::int64_t, N>& s) {
  return format_list(s, ", ");
}

/// True when `rank` dims of `shape`/`strides` lay out `numel` elements row-major without gaps (size-1 dims
/// may have any stride).
template <class Shape>
constexpr bool is_contiguous_layout(const Shape& shape, const Shape& strides, int rank,
                                    std::int64_t numel) noexcept {
  std::int64_t expected = 1;
  for (int d = rank - 1; d >= 0 && numel > 0; --d) {
    if (shape[d] != 1) {
      if (strides[d] != expected) {
        return false;
      }
      expected *= shape[d];
    }
  }
  return true;
}

/// Row-major strides of `shape` (the last dim has stride 1; a stride is the product of the sizes after its
/// dim, 0 after a zero size). Throws when a stride does not fit in int64 (checked_numel rejects such
/// shapes first, with their sizes).
template <std::size_t N>
constexpr std::array<std::int64_t, N> contiguous_strides(const std::array<std::int64_t, N>& shape) {
  std::array<std::int64_t, N> strides{};
  std::int64_t step = 1;
  for (std::size_t i = N; i-- > 0;) {
    strides[i] = step;
    if (i > 0 && !checked_mul(step, shape[i], step)) {
      throw_error("Tensor: the strides of shape " + shape_to_string(shape) + " do not fit in int64");
    }
  }
  return strides;
}

/// Number of elements of `shape`; throws when a size is negative, or when the tensor is not representable:
/// the product of its non-zero sizes times `element_size` (its byte count, and every byte stride, also of
/// an empty tensor) must fit in int64.
template <std::size_t N>
std::int64_t checked_numel(const std::array<std::int64_t, N>& shape, std::size_t element_size,
                           const char* what) {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    DTENSOR_CHECK(shape[i] >= 0, std::string(what) + ": negative size " + std::to_string(shape[i]) +
                                     " in dim " + std::to_string(i) + " of shape " + shape_to_string(shape));
  }
  DTENSOR_CHECK(representable_extent(shape, element_size),
                std::string(what) + ": shape " + shape_to_string(shape) + " is too large (" +
                    std::to_string(element_size) + "-byte elements: the product of its non-zero sizes, in " +
                    "bytes, does not fit in int64)");
  for (std::int64_t s : shape) {
    n *= s; // fits: a product of non-zero sizes checked above, or 0
  }
  return n;
}

/// `dim` in [-rank, rank) made non-negative; throws otherwise.
inline int normalize_dim(int dim, int rank, const char* what) {
  DTENSOR_CHECK(dim >= -rank && dim < rank, std::string(what) + ": dim " + std::to_string(dim) +
                                                " is out of range for a rank-" + std::to_string(rank) +
                                                " tensor (expected " + std::to_string(-rank) + " <= dim < " +
                                                std::to_string(rank) + ")");
  return dim < 0 ? dim + rank : dim;
}

/// The one strided loop: calls f(offsets) for every index of `shape` in row-major order, where
/// offsets[k] is the element offset of that index under strides[k]. Nothing is called when a size is 0;
/// a rank-0 shape has one index.
template <std::size_t Rank, std::size_t N, class F>
constexpr void strided_for_each(const std::array<std::int64_t, Rank>& shape,
                                const std::array<std::array<std::int64_t, Rank>, N>& strides, F&& f) {
  std::array<std::int64_t, N> offsets{};
  if constexpr (Rank == 0) {
    f(std::as_const(offsets));
  } else {
    for (std::size_t d = 0; d < Rank; ++d) {
      if (shape[d] <= 0) {
        return;
      }
    }
    constexpr std::size_t last = Rank - 1;
    std::array<std::int64_t, Rank> index{};
    for (;;) {
      for (std::int64_t i = 0; i < shape[last]; ++i) {
        std::array<std::int64_t, N> at;
        for (std::size_t k = 0; k < N; ++k) {
          at[k] = offsets[k] + i * strides[k][last];
        }
        f(std::as_const(at));
      }
      int d = static_cast<int>(last) - 1; // odometer over the outer dims
      for (; d >= 0; --d) {
        for (std::size_t k = 0; k < N; ++k) {
          offsets[k] += strides[k][d];
        }
        if (++index[d] < shape[d]) {
          break;
        }
        for (std::size_t k = 0; k < N; ++k) {
          offsets[k] -= strides[k][d] * shape[d];
        }
        index[d] = 0;
      }
      if (d < 0) {
        return;
      }
    }
  }
}

/// How a strided copy splits into contiguous runs: for every index of `outer` (offsets from the two
/// stride arrays), `rows` rows `pitch` elements apart, each `run` contiguous elements in both tensors.
template <std::size_t Rank>
struct RunSplit {
  std::array<std::int64_t, Rank> outer{};
  std::int64_t run = 1;
  std::int64_t rows = 1;
  std::int64_t dst_pitch = 0;
  std::int64_t src_pitch = 0;
};

template <std::size_t Rank>
constexpr RunSplit<Rank> plan_copy(const std::array<std::int64_t, Rank>& shape,
                                   const std::array<std::int64_t, Rank>& dst_strides,
                                   const std::array<std::int64_t, Rank>& src_strides) noexcept {
  RunSplit<Rank> p;
  p.outer = shape;
  int d = static_cast<int>(Rank) - 1;
  for (; d >= 0; --d) { // merge trailing dims that are contiguous in both tensors into one run
    if (shape[d] != 1) {
      if (dst_strides[d] != p.run || src_strides[d] != p.run) {
        break;
      }
      p.run *= shape[d];
    }
    p.outer[d] = 1;
  }
  if (d >= 0) { // the next dim out becomes the rows of a 2-d copy
    p.rows = shape[d];
    p.dst_pitch = dst_strides[d];
    p.src_pitch = src_strides[d];
    p.outer[d] = 1;
  }
  return p;
}

/// Host strided copy of `shape` elements of `element_size` bytes.
template <std::size_t Rank>
void copy_host(void* dst, const std::array<std::int64_t, Rank>& dst_strides, const void* src,
               const std::array<std::int64_t, Rank>& src_strides, const std::array<std::int64_t, Rank>& shape,
               std::size_t element_size) {
  const RunSplit<Rank> p = plan_copy(shape, dst_strides, src_strides);
  const auto es = static_cast<std::int64_t>(element_size);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const auto bytes = static_cast<std::size_t>(p.run * es);
  strided_for_each(p.outer, std::array<std::array<std::int64_t, Rank>, 2>{dst_strides, src_strides},
                   [&](const std::array<std::int64_t, 2>& off) {
                     for (std::int64_t r = 0; r < p.rows; ++r) {
                       std::memmove(d + (off[0] + r * p.dst_pitch) * es, s + (off[1] + r * p.src_pitch) * es,
                                    bytes);
                     }
                   });
}

/// Throws when `device` is meta: `what` reads the elements of a tensor of `shape` that has none.
template <std::size_t N>
void check_not_meta(Device device, const char* what, const std::array<std::int64_t, N>& shape) {
  DTENSOR_CHECK(!device.is_meta(), std::string(what) + ": the tensor (shape " + shape_to_string(shape) +
                                       ") is a meta tensor: it has a shape and no data to read");
}

[[noreturn]] inline void throw_no_cuda(const char* what, Device device) {
  throw_error(std::string(what) + " on " + device.to_string() +
              ": dtensor was compiled without CUDA (compile this translation unit with nvcc, or define "
              "DTENSOR_HAS_CUDA=1 and link CUDA::cudart)");
}

#if DTENSOR_HAS_CUDA

inline void check_tensor_cuda(cudaError_t err, const char* call, const std::string& context) {
  if (err != cudaSuccess) [[unlikely]] {
    throw_error(std::string(call) + " failed (" + context + "): " + cudaGetErrorName(err) + ": " +
                cudaGetErrorString(err));
  }
}

/// Makes `index` the current CUDA device for its lifetime.
class TensorDeviceGuard {
public:
  explicit TensorDeviceGuard(int index) {
    check_tensor_cuda(cudaGetDevice(&previous_), "cudaGetDevice", "cuda:" + std::to_string(index));
    if (previous_ != index) {
      check_tensor_cuda(cudaSetDevice(index), "cudaSetDevice", "cuda:" + std::to_string(index));
    } else {
      previous_ = -1;
    }
  }
  ~TensorDeviceGuard() {
    if (previous_ >= 0) {
      (void)cudaSetDevice(previous_);
    }
  }
  TensorDeviceGuard(const TensorDeviceGuard&) = delete;
  TensorDeviceGuard& operator=(const TensorDeviceGuard&) = delete;

private:
  int previous_ = -1;
};

/// Stream-ordered device memory, freed on the same stream. Zero bytes allocate nothing (nullptr).
inline std::shared_ptr<void> allocate_cuda(std::size_t nbytes, Device device, cudaStream_t stream) {
  if (nbytes == 0) {
    return {};
  }
  TensorDeviceGuard guard(device.index);
  void* p = nullptr;
  check_tensor_cuda(cudaMallocAsync(&p, nbytes, stream), "cudaMallocAsync",
                    std::to_string(nbytes) + " bytes on " + device.to_string());
  const int index = device.index;
  return std::shared_ptr<void>(p, [index, stream](void* q) {
    int previous = -1;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != index && cudaSetDevice(index) == cudaSuccess;
    (void)cudaFreeAsync(q, stream); // errors (e.g. at process exit) cannot be reported from a deleter
    if (switched) {
      (void)cudaSetDevice(previous);
    }
  });
}

/// Strided copy between any two of host and device memory, enqueued on `stream` (not synchronised).
template <std::size_t Rank>
void copy_cuda(void* dst, const std::array<std::int64_t, Rank>& dst_strides, const void* src,
               const std::array<std::int64_t, Rank>& src_strides, const std::array<std::int64_t, Rank>& shape,
               std::size_t element_size, cudaStream_t stream) {
  const RunSplit<Rank> p = plan_copy(shape, dst_strides, src_strides);
  const auto es = static_cast<std::int64_t>(element_size);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const auto width = static_cast<std::size_t>(p.run * es);
  const bool pitched = p.rows > 1 && p.dst_pitch * es >= p.run * es && p.src_pitch * es >= p.run * es;
  strided_for_each(
      p.outer, std::array<std::array<std::int64_t, Rank>, 2>{dst_strides, src_strides},
      [&](const std::array<std::int64_t, 2>& off) {
        unsigned char* to = d + off[0] * es;
        const unsigned char* from = s + off[1] * es;
        if (pitched) {
          const cudaError_t err =
              cudaMemcpy2DAsync(to, static_cast<std::size_t>(p.dst_pitch * es), from,
                                static_cast<std::size_t>(p.src_pitch * es), width,
                                static_cast<std::size_t>(p.rows), cudaMemcpyDefault, stream);
          if (err != cudaErrorInvalidPitchValue) { // pitches beyond the device limit: row by row below
            check_tensor_cuda(err, "cudaMemcpy2DAsync", "Tensor copy");
            return;
          }
          (void)cudaGetLastError();
        }
        for (std::int64_t r = 0; r < p.rows; ++r) {
          check_tensor_cuda(cudaMemcpyAsync(to + r * p.dst_pitch * es, from + r * p.src_pitch * es, width,
                                            cudaMemcpyDefault, stream),
                            "cudaMemcpyAsync", "Tensor copy");
        }
      });
}

/// Fills `count` contiguous device elements with the `element_size`-byte `pattern`, enqueued on
/// `stream`: cudaMemsetAsync when one byte repeats, else a host seed grown by doubling device copies.
inline void fill_cuda(void* dst, const void* pattern, std::size_t element_size, std::int64_t count,
                      cudaStream_t stream) {
  const auto* pat = static_cast<const unsigned char*>(pattern);
  bool one_byte = true;
  for (std::size_t i = 1; i < element_size; ++i) {
    one_byte = one_byte && pat[i] == pat[0];
  }
  const std::size_t total = static_cast<std::size_t>(count) * element_size;
  if (one_byte) {
    check_tensor_cuda(cudaMemsetAsync(dst, pat[0], total, stream), "cudaMemsetAsync", "Tensor::fill");
    return;
  }
  constexpr std::size_t seed_bytes = 4096;
  unsigned char seed[seed_bytes];
  const std::size_t seed_count = static_cast<std::size_t>(count) < seed_bytes / element_size
                                     ? static_cast<std::size_t>(count)
                                     : seed_bytes / element_size;
  for (std::size_t i = 0; i < seed_count; ++i) {
    std::memcpy(seed + i * element_size, pat, element_size);
  }
  auto* d = static_cast<unsigned char*>(dst);
  std::size_t done = seed_count * element_size;
  // From pageable memory this returns once `seed` has been staged, so the stack buffer may go away.
  check_tensor_cuda(cudaMemcpyAsync(d, seed, done, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync",
                    "Tensor::fill");
  while (done < total) {
    const std::size_t chunk = done < total - done ? done : total - done;
    check_tensor_cuda(cudaMemcpyAsync(d + done, d, chunk, cudaMemcpyDeviceToDevice, stream),
                      "cudaMemcpyAsync", "Tensor::fill");
    done += chunk;
  }
}

/// A copy between tensors of which at least one is on a GPU, stream-ordered (core/cuda_sync.hpp): on the
/// destination's stream into a GPU (after the work pending on the source's stream, which then waits for the
/// copy, so the source may be released or rewritten there), on the source's stream to the host. The host
/// waits only for a copy to the host (it reads the result) or out of pinned host memory.
template <std::size_t Rank>
void copy_cuda_ordered(void* dst, const std::array<std::int64_t, Rank>& dst_strides, Device dst_device,
                       cudaStream_t dst_stream, const void* src,
                       const std::array<std::int64_t, Rank>& src_strides, Device src_device,
                       cudaStream_t src_stream, const std::array<std::int64_t, Rank>& shape,
                       std::size_t element_size, const char* what) {
  const bool to_device = dst_device.is_cuda();
  const cudaStream_t stream = to_device ? dst_stream : src_stream;
  TensorDeviceGuard guard(to_device ? dst_device.index : src_device.index);
  const bool both = to_device && src_device.is_cuda() && src_stream != dst_stream;
  if (both) {
    order_after(dst_stream, src_stream, what);
  }
  copy_cuda(dst, dst_strides, src, src_strides, shape, element_size, stream);
  if (!to_device) {
    host_sync(stream, std::string(what) + " (to the host)");
  } else if (!src_device.is_cuda() && is_pinned_host(src)) {
    host_sync(stream, std::string(what) + " (from pinned host memory)");
  } else {
    if (both) {
      order_after(src_stream, dst_stream, what);
    }
    after_op(stream, what);
  }
}

#endif // DTENSOR_HAS_CUDA

} // namespace detail

inline namespace DTENSOR_CONFIG_NS {

/// A local n-d array of `T` (float, double, bfloat16, half, int32, int64, uint8) with `Rank` dims
/// (Rank 0: a scalar with one element). See the top of this file for an example.
template <class T, int Rank>
class Tensor {
  static_assert(Element<T>, "dtensor::Tensor<T, Rank>: T must be float, double, dtensor::bfloat16, "
                            "dtensor::half, std::int32_t, std::int64_t or std::uint8_t");
  static_assert(Rank >= 0, "dtensor::Tensor<T, Rank>: Rank must be >= 0 (Rank 0 is a scalar)");

  template <class U, int R>
  friend class Tensor;
  friend class AnyTensor;

public:
  using value_type = T;
  static constexpr int rank = Rank;
  using Shape = std::array<std::int64_t, Rank>;

  /// An undefined tensor: defined() is false, numel() is 0, data() is nullptr.
  Tensor() = default;

  /// Uninitialised contiguous row-major memory for `shape` on `device` (stream-ordered on the legacy
  /// default stream for a CUDA device). Throws Error for negative sizes, and for a CUDA device when
  /// dtensor was compiled without CUDA.
  explicit Tensor(Shape shape, Device device = Device::cpu()) : Tensor(shape, device, nullptr, Allocate{}) {}

#if DTENSOR_HAS_CUDA
  /// As above, with device memory allocated and freed in the order of `stream`, which must outlive
  /// the memory; other streams must wait for `stream` before using it.
  Tensor(Shape shape, Device device, cudaStream_t stream) : Tensor(shape, device, stream, Allocate{}) {}

  /// The stream the memory is ordered on and copies run on (nullptr: the legacy default stream).
  cudaStream_t stream() const noexcept {
    return stream_;
  }
#endif

  static Tensor empty(Shape shape, Device device = Device::cpu()) {
    return Tensor(shape, device);
  }

  static Tensor zeros(Shape shape, Device device = Device::cpu()) {
    Tensor t(shape, device);
    t.fill(T{});
    return t;
  }

  static Tensor full(Shape shape, T value, Device device = Device::cpu()) {
    Tensor t(shape, device);
    t.fill(value);
    return t;
  }

  /// Wraps memory the caller owns (and keeps alive) as a contiguous tensor. A CUDA device pointer may
  /// be wrapped even without CUDA support; it is carried, never dereferenced.
  static Tensor from_blob(T* data, Shape shape, Device device = Device::cpu()) {
    (void)detail::checked_numel(shape, sizeof(T), "Tensor::from_blob");
    return from_blob(data, shape, detail::contiguous_strides(shape), device);
  }

  /// Wraps memory the caller owns with explicit strides (in elements).
  static Tensor from_blob(T* data, Shape shape, Shape strides, Device device = Device::cpu()) {
    return from_blob(data, shape, strides, device, std::shared_ptr<void>());
  }

  /// As above, for device memory ordered on `stream` (work on it wrote the data).
  static Tensor from_blob(T* data, Shape shape, Shape strides, Device device, CUstream_st* stream) {
    return from_blob(data, shape, strides, device, std::shared_ptr<void>(), stream);
  }

  /// Wraps memory kept alive by `owner`: every view of the result holds a reference to it, and the last
  /// one to go releases it (from_dlpack's tensors hold the producer's DLManagedTensor this way).
  static Tensor from_blob(T* data, Shape shape, Shape strides, Device device, std::shared_ptr<void> owner,
                          CUstream_st* stream = nullptr) {
    Tensor t;
    t.storage_ = std::move(owner);
    t.stream_ = stream;
    t.numel_ = detail::checked_numel(shape, sizeof(T), "Tensor::from_blob");
    t.data_ = data;
    t.shape_ = shape;
    t.strides_ = strides;
    t.device_ = device;
    t.defined_ = true;
    return t;
  }

  /// A host tensor holding `values` in row-major order; throws unless there are exactly numel of them.
  static Tensor from_values(Shape shape, std::initializer_list<T> values) {
    Tensor t(shape);
    DTENSOR_CHECK(static_cast<std::int64_t>(values.size()) == t.numel_,
                  "Tensor::from_values: shape " + detail::shape_to_string(shape) + " holds " +
                      std::to_string(t.numel_) + " elements but " + std::to_string(values.size()) +
                      " values were given");
    T* out = t.data_;
    for (const T& v : values) {
      *out++ = v;
    }
    return t;
  }

  const Shape& shape() const noexcept {
    return shape_;
  }

  /// Size of dim `dim`; negative dims count from the end. Throws for dims outside [-Rank, Rank).
  std::int64_t shape(int dim) const {
    return shape_[detail::normalize_dim(dim, Rank, "Tensor::shape")];
  }

  /// Strides in elements.
  const Shape& strides() const noexcept {
    return strides_;
  }
  std::int64_t numel() const noexcept {
    return numel_;
  }
  std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel_) * sizeof(T);
  }

  /// The first element (storage + offset); may be nullptr when numel() == 0.
  T* data() const noexcept {
    return data_;
  }
  Device device() const noexcept {
    return device_;
  }
  static constexpr DType dtype() noexcept {
    return dtype_v<T>;
  }
  bool defined() const noexcept {
    return defined_;
  }

  /// The CUDA stream the memory is ordered on (cudaStream_t; nullptr: the legacy default stream or host
  /// memory). Collectives on this tensor run after the work on it and before its release.
  CUstream_st* stream_handle() const noexcept {
    return stream_;
  }

  /// The owner of the memory (empty for from_blob tensors wrapped without one); hold a copy to keep the
  /// memory alive.
  const std::shared_ptr<void>& storage() const noexcept {
    return storage_;
  }

  /// True when the elements are laid out row-major without gaps (size-1 dims may have any stride).
  bool is_contiguous() const noexcept {
    return detail::is_contiguous_layout(shape_, strides_, Rank, numel_);
  }

  /// A view of elements [start, start + length) of dim `dim` (negative counts from the end), sharing
  /// memory. Narrowing a non-leading dim gives a non-contiguous view. Throws when out of range.
  Tensor narrow(int dim, std::int64_t start, std::int64_t length) const {
    const int d = detail::normalize_dim(dim, Rank, "Tensor::narrow");
    const std::int64_t size = shape_[d];
    DTENSOR_CHECK(start >= 0 && length >= 0 && start <= size - length,
                  "Tensor::narrow(dim=" + std::to_string(dim) + ", start=" + std::to_string(start) +
                      ", length=" + std::to_string(length) + "): out of range for dim " + std::to_string(d) +
                      " of size " + std::to_string(size) + " (shape " + detail::shape_to_string(shape_) +
                      ")");
    Tensor r = *this;
    r.shape_[d] = length;
    r.numel_ = size == 0 ? 0 : numel_ / size * length;
    if (data_ != nullptr && length > 0) {
      r.data_ = data_ + start * strides_[d];
    }
    return r;
  }

  /// The same memory seen with another shape (one size may be -1: inferred). Throws unless this tensor
  /// is contiguous and the element counts match.
  template <int R2>
  Tensor<T, R2> view(std::array<std::int64_t, R2> shape) const {
    DTENSOR_CHECK(is_contiguous(), "Tensor::view" + detail::shape_to_string(shape) + ": the tensor (shape " +
                                       detail::shape_to_string(shape_) + ", strides " +
                                       detail::shape_to_string(strides_) +
                                       ") is not contiguous; use reshape() or contiguous() first");
    int inferred = -1;
    std::int64_t known = 1; // the product of the given non-zero sizes, then of all given sizes
    bool has_zero = false;
    bool fits = true;
    for (int i = 0; i < R2; ++i) {
      if (shape[i] == -1) {
        DTENSOR_CHECK(inferred < 0,
                      "Tensor::view" + detail::shape_to_string(shape) + ": only one size may be -1");
        inferred = i;
      } else {
        DTENSOR_CHECK(shape[i] >= 0,
                      "Tensor::view" + detail::shape_to_string(shape) + ": sizes must be >= 0 (or -1)");
        has_zero = has_zero || shape[i] == 0;
        fits = fits && (shape[i] == 0 || detail::checked_mul(known, shape[i], known));
      }
    }
    DTENSOR_CHECK(fits, "Tensor::view" + detail::shape_to_string(shape) +
                            ": shape is too large (the product of its sizes does not fit in int64)");
    known = has_zero ? 0 : known;
    if (inferred >= 0) {
      DTENSOR_CHECK(known != 0 && numel_ % known == 0, "Tensor::view" + detail::shape_to_string(shape) +
                                                           ": cannot infer the -1 size for a tensor of " +
                                                           std::to_string(numel_) + " elements (shape " +
                                                           detail::shape_to_string(shape_) + ")");
      shape[inferred] = numel_ / known;
      known = numel_;
    }
    DTENSOR_CHECK(known == numel_, "Tensor::view" + detail::shape_to_string(shape) + ": shape has " +
                                       std::to_string(known) + " elements but the tensor has " +
                                       std::to_string(numel_) + " (shape " + detail::shape_to_string(shape_) +
                                       ")");
    (void)detail::checked_numel(shape, sizeof(T), "Tensor::view"); // strides and bytes fit
    Tensor<T, R2> r;
    r.storage_ = storage_;
    r.data_ = data_;
    r.shape_ = shape;
    r.strides_ = detail::contiguous_strides(shape);
    r.numel_ = numel_;
    r.device_ = device_;
    r.stream_ = stream_;
    r.defined_ = defined_;
    return r;
  }

  /// view() when contiguous, else a view of a contiguous copy.
  template <int R2>
  Tensor<T, R2> reshape(std::array<std::int64_t, R2> shape) const {
    return is_contiguous() ? view<R2>(shape) : contiguous().template view<R2>(shape);
  }

  /// This tensor when already contiguous (shared memory, as in PyTorch), else a contiguous copy.
  Tensor contiguous() const {
    return is_contiguous() ? *this : clone();
  }

  /// A contiguous copy on the same device (and stream).
  Tensor clone() const {
    if (!defined_) {
      return Tensor{};
    }
    Tensor r(shape_, device_, stream_, Allocate{});
    r.copy_from(*this);
    return r;
  }

  /// A contiguous copy on `device`; always a new tensor, even on the same device (unlike PyTorch,
  /// which returns the tensor itself then).
  Tensor to(Device device) const {
    if (!defined_) {
      return Tensor{};
    }
    Tensor r(shape_, device, device == device_ ? stream_ : nullptr, Allocate{});
    r.copy_from(*this);
    return r;
  }

  /// Copies `src` element by element into this tensor (or view). The shapes must match; strides and
  /// devices may differ. Synchronous on the host and into host memory; into a GPU, stream-ordered (see
  /// the top of this file). The two must not partially overlap. Into a meta tensor: nothing to
  /// do; out of one (into memory): an error, it has no data.
  void copy_from(const Tensor& src) {
    DTENSOR_CHECK(shape_ == src.shape_, "Tensor::copy_from: shape mismatch: destination " +
                                            detail::shape_to_string(shape_) + " vs source " +
                                            detail::shape_to_string(src.shape_));
    if (numel_ == 0 || device_.is_meta()) {
      return;
    }
    detail::check_not_meta(src.device_, "Tensor::copy_from", shape_);
    if (device_.is_cpu() && src.device_.is_cpu()) {
      detail::copy_host(data_, strides_, src.data_, src.strides_, shape_, sizeof(T));
      return;
    }
#if DTENSOR_HAS_CUDA
    detail::copy_cuda_ordered(data_, strides_, device_, stream_, src.data_, src.strides_, src.device_,
                              src.stream_, shape_, sizeof(T), "Tensor::copy_from");
#else
    detail::throw_no_cuda("Tensor::copy_from", device_.is_cuda() ? device_ : src.device_);
#endif
  }

  /// Sets every element (of this view) to `value`. Synchronous on the host; on a GPU, stream-ordered.
  void fill(T value) {
    if (numel_ == 0 || device_.is_meta()) {
      return;
    }
    if (device_.is_cpu()) {
      detail::strided_for_each(shape_, std::array<Shape, 1>{strides_},
                               [&](const std::array<std::int64_t, 1>& off) { data_[off[0]] = value; });
      return;
    }
#if DTENSOR_HAS_CUDA
    if (!is_contiguous()) {
      Tensor tmp(shape_, device_, stream_, Allocate{});
      tmp.fill(value);
      copy_from(tmp);
      return;
    }
    detail::TensorDeviceGuard guard(device_.index);
    detail::fill_cuda(data_, &value, sizeof(T), numel_, stream_);
    detail::after_op(stream_, "Tensor::fill");
#else
    detail::throw_no_cuda("Tensor::fill", device_);
#endif
  }

  /// The element at `idx...` (exactly Rank integers) of a host tensor; throws when out of bounds.
  T& operator()(std::integral auto... idx) const {
    static_assert(sizeof...(idx) == Rank, "Tensor<T, Rank>::operator(): pass exactly Rank indices");
    detail::check_not_meta(device_, "Tensor::operator()", shape_);
    DTENSOR_CHECK(device_.is_cpu(),
                  "Tensor::operator(): element access needs a host tensor; this one is on " +
                      device_.to_string() + " (copy it with to(Device::cpu()))");
    const Shape index{static_cast<std::int64_t>(idx)...};
    std::int64_t offset = 0;
    for (int d = 0; d < Rank; ++d) {
      DTENSOR_CHECK(index[d] >= 0 && index[d] < shape_[d],
                    "Tensor::operator(): index " + detail::shape_to_string(index) +
                        " is out of bounds for shape " + detail::shape_to_string(shape_));
      offset += index[d] * strides_[d];
    }
    return data_[offset];
  }

  /// The value of a one-element tensor on the host or a GPU (a meta tensor has none: an error).
  T item() const {
    DTENSOR_CHECK(numel_ == 1, "Tensor::item: the tensor has " + std::to_string(numel_) +
                                   " elements (shape " + detail::shape_to_string(shape_) + "), not 1");
    detail::check_not_meta(device_, "Tensor::item", shape_);
    return device_.is_cpu() ? *data_ : *to(Device::cpu()).data_;
  }

private:
  struct Allocate {};

  Tensor(Shape shape, Device device, CUstream_st* stream, Allocate)
      : data_(nullptr), numel_(detail::checked_numel(shape, sizeof(T), "Tensor")), shape_(shape),
        strides_(detail::contiguous_strides(shape)), device_(device), stream_(stream), defined_(true) {
    if (device.is_meta()) {
      storage_ = detail::allocate_meta(nbytes()); // addresses, no memory
    } else if (device.is_cpu()) {
      storage_ = detail::allocate_host(nbytes());
    } else {
#if DTENSOR_HAS_CUDA
      storage_ = detail::allocate_cuda(nbytes(), device, stream);
#else
      detail::throw_no_cuda("Tensor", device);
#endif
    }
    data_ = static_cast<T*>(storage_.get());
  }

  std::shared_ptr<void> storage_;
  T* data_ = nullptr;
  std::int64_t numel_ = 0; // before shape_ and strides_: checked_numel validates the shape first
  Shape shape_{};
  Shape strides_{};
  Device device_{};
  CUstream_st* stream_ = nullptr;
  bool defined_ = false;
};

} // namespace DTENSOR_CONFIG_NS
} // namespace dtensor
