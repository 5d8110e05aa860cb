#pragma once
// Local data movement: the copies, fills and scalings a rank does on its own memory (packing the pieces
// of a non-leading dim before a collective and unpacking them after, local chunks, Partial identities,
// poisoned buffers), written once as index-mapping function objects and run by one launcher per system.
// The launcher (RunLayout, run_host, run_cuda) is also what the other local kernels run on
// (local/pointwise.hpp, local/random.hpp).
//
//   auto t = dtensor::Tensor<float, 2>::zeros({4, 6});
//   auto packed = dtensor::Tensor<float, 2>({4, 3});
//   dtensor::local::copy(packed, t.narrow(1, 2, 3));   // packed[i][j] = t[i][2 + j]
//   dtensor::local::fill(t.narrow(0, 0, 2), 1.0f);     // rows 0 and 1 of t
//   dtensor::local::scale(t, 0.5);                      // t *= 0.5 (floating types)
//   dtensor::local::convert(t16, t);                    // bfloat16 <- float, elementwise
//
// How it runs:
//  - The kernel, once. A strided region is collapsed into a RunLayout: size-1 dims dropped, dims that are
//    contiguous across each other in every operand merged, and the innermost dim, when it has stride 1
//    in every operand, becomes a contiguous *run*. Launch index i names one *tile* (rows of runs, or
//    part of one); CopyRuns / FillRuns / ScaleRuns map i to operand offsets (RunLayout::locate) and handle
//    the tile. They are DTENSOR_HOST_DEVICE: the same code runs on the host and on the GPU; only the tile
//    shape differs (TileShape: a whole block of rows of whole runs on the host, one element on a GPU).
//  - Host copies and fills are Tensor::copy_from / Tensor::fill: one strided-copy engine on the host
//    (core/tensor.hpp's run-wise memmove). scale on the host runs ScaleRuns with
//    thrust::for_each(thrust::cpp::par, counting_iterator) when Thrust (CCCL) is available
//    (DTENSOR_HAS_THRUST; CMake turns it on when it finds the CUDA Toolkit's CCCL headers), else a plain
//    loop; a host tile is every row of the innermost outer dim.
//  - CUDA tensors in a translation unit compiled by nvcc (with Thrust): thrust::for_each with
//    thrust::cuda::par_nosync.on(stream of the destination), one element per index (neighbouring threads
//    touch neighbouring elements), stream-ordered like Tensor's own copy and fill: the host does not wait
//    (core/cuda_sync.hpp; DTENSOR_CUDA_SYNC_EACH_OP=1 makes it wait after each, for debugging). A source on
//    another stream than the destination's is joined by events both ways (StreamJoin). On the host these
//    ops are synchronous.
//  - Emulated (DTENSOR_EMULATE_DEVICE, core/config.hpp; tests only): CUDA tensors run the same kernels
//    as in an nvcc TU, with their device paths (DTENSOR_ON_DEVICE), compiled for Thrust's host system and
//    launched by the emulated CUDA runtime (tests/support/emulated_cuda), one element per index.
//  - CUDA tensors in a TU compiled by a plain C++ compiler (DTENSOR_HAS_CUDA=1 without nvcc) cannot
//    launch kernels: copy and fill go through Tensor::copy_from / Tensor::fill (cudaMemcpy2DAsync /
//    cudaMemsetAsync, which need no kernel), and scale throws an Error asking for nvcc. Copies between
//    host and device memory, or between two devices, always go through Tensor::copy_from.
//
// Thrust outside nvcc needs a host device system: when THRUST_DEVICE_SYSTEM is not defined, a non-CUDA TU
// that includes this header gets THRUST_DEVICE_SYSTEM_CPP (include this header before other Thrust
// headers, or define THRUST_DEVICE_SYSTEM yourself). Define DTENSOR_HAS_THRUST=0 to never use Thrust.
// In nvcc TUs Thrust brings in CUDA's cuda_fp16.h, whose global `half` (a typedef of __half) makes a plain
// `half` ambiguous after `using namespace dtensor;`: write dtensor::half there, or add
// `using dtensor::half;` in your own namespace.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>

#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/tensor.hpp"

#ifndef DTENSOR_HAS_THRUST
#if __has_include(<thrust/for_each.h>)
#define DTENSOR_HAS_THRUST 1
#else
#define DTENSOR_HAS_THRUST 0
#endif
#endif

// DTENSOR_LOCAL_OPS_THRUST: Thrust launches host tensors. DTENSOR_LOCAL_OPS_CUDA: Thrust launches CUDA
// tensors too (an nvcc TU).
#if DTENSOR_HAS_THRUST && __has_include(<thrust/for_each.h>)
#define DTENSOR_LOCAL_OPS_THRUST 1
#if !defined(__CUDACC__) && !defined(THRUST_DEVICE_SYSTEM)
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#if defined(__CUDACC__) && DTENSOR_HAS_CUDA
#define DTENSOR_LOCAL_OPS_CUDA 1
#include <thrust/system/cuda/execution_policy.h>
#elif DTENSOR_EMULATE_DEVICE
#define DTENSOR_LOCAL_OPS_CUDA 1
#else
#define DTENSOR_LOCAL_OPS_CUDA 0
#endif
#else
#if DTENSOR_EMULATE_DEVICE
#error "DTENSOR_EMULATE_DEVICE needs Thrust (the CUDA Toolkit's CCCL headers): the kernels are Thrust code"
#endif
#define DTENSOR_LOCAL_OPS_THRUST 0
#define DTENSOR_LOCAL_OPS_CUDA 0
#endif

// The kernels differ with the compiler (Thrust on CUDA tensors in nvcc TUs, or emulated: DTENSOR_ON_DEVICE
// is a flag there) and with Thrust's presence: an inline namespace per variant keeps each TU's functions
// its own (see core/config.hpp).
#if DTENSOR_EMULATE_DEVICE
#define DTENSOR_LOCAL_OPS_NS thrust_emulated
#elif DTENSOR_LOCAL_OPS_CUDA
#define DTENSOR_LOCAL_OPS_NS thrust_cuda
#elif DTENSOR_LOCAL_OPS_THRUST
#define DTENSOR_LOCAL_OPS_NS thrust_host
#else
#define DTENSOR_LOCAL_OPS_NS loop_host
#endif

namespace dtensor::local {
inline namespace DTENSOR_LOCAL_OPS_NS {

/// How much of a region one launch index handles: up to `rows` rows of the innermost outer dim, and up to
/// `width` elements of a run.
struct TileShape {
  std::int64_t rows;
  std::int64_t width;
};

/// On the host an index handles every row of the innermost outer dim, whole runs: one index decomposition
/// per block of rows, then a 2-d loop of memmoves (what Tensor::copy_from's run-wise loop does).
inline constexpr TileShape host_tile{std::numeric_limits<std::int64_t>::max(),
                                     std::numeric_limits<std::int64_t>::max()};
/// On a GPU an index (a thread) handles one element: neighbouring threads touch neighbouring elements.
inline constexpr TileShape cuda_tile{1, 1};

/// What one launch index handles: `rows` rows, `row_stride[k]` elements apart in operand k, of `n`
/// contiguous elements each, the first at `offset[k]`.
template <int N>
struct Tile {
  std::int64_t offset[N];
  std::int64_t row_stride[N];
  std::int64_t rows;
  std::int64_t n;
};

/// A strided region of N operands of the same shape, collapsed: `dims` outer dims (outermost first; the
/// last is the *row* dim) with per-operand strides, each index of which starts a run of `run` elements
/// contiguous in every operand. A launch has `count` indices, one per tile: `tile_rows` rows by `width`
/// elements (fewer at the edges).
template <int R, int N>
struct RunLayout {
  static constexpr int max_dims = R > 0 ? R : 1;
  int dims = 0;
  std::int64_t shape[max_dims] = {};
  std::int64_t strides[N][max_dims] = {};
  std::int64_t run = 1;
  std::int64_t tile_rows = 1;
  std::int64_t width = 1;
  std::int64_t row_tiles = 1; // tiles along the row dim
  std::int64_t col_tiles = 1; // tiles along a run
  std::int64_t count = 0;

  /// The tile of launch index i (0 <= i < count).
  DTENSOR_HOST_DEVICE Tile<N> locate(std::int64_t i) const {
    Tile<N> t;
    std::int64_t col = 0;
    if (col_tiles != 1) {
      col = i % col_tiles;
      i /= col_tiles;
    }
    const std::int64_t begin = col * width;
    t.n = run - begin < width ? run - begin : width;
    t.rows = 1;
    for (int k = 0; k < N; ++k) {
      t.offset[k] = begin;
      t.row_stride[k] = 0;
    }
    const int top = dims < max_dims ? dims : max_dims; // == dims; spelled so compilers see the bound
    if (top == 0) {
      return t;
    }
    std::int64_t row_tile = 0;
    if (row_tiles != 1) {
      row_tile = i % row_tiles;
      i /= row_tiles;
    }
    const std::int64_t first = row_tile * tile_rows;
    const std::int64_t left = shape[top - 1] - first;
    t.rows = left < tile_rows ? left : tile_rows;
    for (int k = 0; k < N; ++k) {
      t.row_stride[k] = strides[k][top - 1];
      t.offset[k] += first * strides[k][top - 1];
    }
    for (int d = top - 2; d >= 0; --d) { // the other outer dims, innermost first
      std::int64_t at = i;
      if (d > 0) {
        at = i % shape[d];
        i /= shape[d];
      }
      for (int k = 0; k < N; ++k) {
        t.offset[k] += at * strides[k][d];
      }
    }
    return t;
  }
};

/// The RunLayout of `shape` under each operand's `strides`, cut into tiles of at most `tile`.
/// @post count == 0 when the region is empty; a rank-0 region is one run of one element.
template <int R, int N>
RunLayout<R, N> make_run_layout(const std::array<std::int64_t, R>& shape,
                                const std::array<std::array<std::int64_t, R>, N>& strides, TileShape tile) {
  RunLayout<R, N> l;
  for (int d = 0; d < R; ++d) {
    if (shape[d] == 0) {
      return l;
    }
  }
  for (int d = 0; d < R; ++d) {
    if (shape[d] == 1) {
      continue;
    }
    bool merges = l.dims > 0;
    for (int k = 0; k < N && merges; ++k) {
      merges = l.strides[k][l.dims - 1] == strides[k][d] * shape[d];
    }
    if (merges) { // dims (p, d) walk memory like one dim of size shape[p] * shape[d] in every operand
      l.shape[l.dims - 1] *= shape[d];
      for (int k = 0; k < N; ++k) {
        l.strides[k][l.dims - 1] = strides[k][d];
      }
      continue;
    }
    l.shape[l.dims] = shape[d];
    for (int k = 0; k < N; ++k) {
      l.strides[k][l.dims] = strides[k][d];
    }
    ++l.dims;
  }
  bool unit = l.dims > 0;
  for (int k = 0; k < N && unit; ++k) {
    unit = l.strides[k][l.dims - 1] == 1;
  }
  if (unit) {
    --l.dims;
    l.run = l.shape[l.dims];
  }
  l.width = l.run < tile.width ? l.run : tile.width;
  l.col_tiles = (l.run + l.width - 1) / l.width;
  l.count = l.col_tiles;
  if (l.dims > 0) {
    const std::int64_t rows = l.shape[l.dims - 1];
    l.tile_rows = rows < tile.rows ? rows : tile.rows;
    l.row_tiles = (rows + l.tile_rows - 1) / l.tile_rows;
    l.count *= l.row_tiles;
    for (int d = 0; d + 1 < l.dims; ++d) {
      l.count *= l.shape[d];
    }
  }
  return l;
}

/// dst[k] = src[k] for k < n (the two do not partially overlap).
template <class T>
DTENSOR_HOST_DEVICE void copy_elements(T* dst, const T* src, std::int64_t n) {
  if (DTENSOR_ON_DEVICE) {
    for (std::int64_t k = 0; k < n; ++k) {
      dst[k] = src[k];
    }
  } else {
#if !defined(__CUDA_ARCH__)
    if (n == 1) {
      *dst = *src;
    } else {
      std::memmove(static_cast<void*>(dst), static_cast<const void*>(src),
                   static_cast<std::size_t>(n) * sizeof(T));
    }
#endif
  }
}

/// Index i copies tile i: operand 0 is the destination, operand 1 the source.
template <class T, int R>
struct CopyRuns {
  RunLayout<R, 2> layout;
  T* dst;
  const T* src;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<2> t = layout.locate(i);
    T* d = dst + t.offset[0];
    const T* s = src + t.offset[1];
    if (t.n == 1) { // runs of one element (a strided dim innermost): a plain gather/scatter loop
      for (std::int64_t r = 0; r < t.rows; ++r) {
        d[r * t.row_stride[0]] = s[r * t.row_stride[1]];
      }
      return;
    }
    for (std::int64_t r = 0; r < t.rows; ++r) {
      copy_elements(d + r * t.row_stride[0], s + r * t.row_stride[1], t.n);
    }
  }
};

/// Index i sets every element of tile i to `value`.
template <class T, int R>
struct FillRuns {
  RunLayout<R, 1> layout;
  T* dst;
  T value;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<1> t = layout.locate(i);
    const T v = value; // a local: stores through p cannot change it
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* p = dst + t.offset[0] + r * t.row_stride[0];
      for (std::int64_t k = 0; k < t.n; ++k) {
        p[k] = v;
      }
    }
  }
};

/// The type a floating element type is scaled in: double for double, float otherwise.
template <class T>
using scale_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// Index i multiplies every element of tile i by `factor` (in scale_type_t<T>, rounded back to T).
template <class T, int R>
struct ScaleRuns {
  RunLayout<R, 1> layout;
  T* dst;
  scale_type_t<T> factor;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<1> t = layout.locate(i);
    const scale_type_t<T> f = factor;
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* p = dst + t.offset[0] + r * t.row_stride[0];
      for (std::int64_t k = 0; k < t.n; ++k) {
        p[k] = T(static_cast<scale_type_t<T>>(p[k]) * f);
      }
    }
  }
};

/// Index i converts tile i: operand 0 is the destination (element type D), operand 1 the source (S);
/// each element goes through double when either type is double, else through float.
template <class D, class S, int R>
struct ConvertRuns {
  using via_type = std::conditional_t<std::is_same_v<D, double> || std::is_same_v<S, double>, double, float>;
  RunLayout<R, 2> layout;
  D* dst;
  const S* src;

  DTENSOR_HOST_DEVICE void operator()(std::int64_t i) const {
    const Tile<2> t = layout.locate(i);
    for (std::int64_t r = 0; r < t.rows; ++r) {
      D* d = dst + t.offset[0] + r * t.row_stride[0];
      const S* s = src + t.offset[1] + r * t.row_stride[1];
      for (std::int64_t k = 0; k < t.n; ++k) {
        d[k] = D(static_cast<via_type>(s[k]));
      }
    }
  }
};

/// Runs f(i) for every i in [0, f.layout.count) on the host: Thrust's cpp system, or a plain loop.
template <class F>
void run_host(const F& f) {
#if DTENSOR_LOCAL_OPS_THRUST
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::int64_t>(0),
                   thrust::counting_iterator<std::int64_t>(f.layout.count), f);
#else
  for (std::int64_t i = 0; i < f.layout.count; ++i) {
    f(i);
  }
#endif
}

#if DTENSOR_LOCAL_OPS_CUDA
#if DTENSOR_EMULATE_DEVICE
/// The emulated kernel of F: f(i) for every i in [0, count), args = {&f, &count}, run by the emulated
/// runtime's cudaLaunchKernel. The indices run in descending order (a GPU's are in no order; the host
/// launcher's ascend), and DTENSOR_ON_DEVICE is true meanwhile, so f takes its device path.
template <class F>
void emulated_kernel(void** args) {
  const F& f = *static_cast<const F*>(args[0]);
  const std::int64_t count = *static_cast<const std::int64_t*>(args[1]);
  struct OnDevice {
    OnDevice() { ::dtensor::detail::emulated_device_code = true; }
    ~OnDevice() { ::dtensor::detail::emulated_device_code = false; }
  } on_device;
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::int64_t>(0),
                   thrust::counting_iterator<std::int64_t>(count),
                   [&f, count](std::int64_t i) { f(count - 1 - i); });
}
#endif

/// Runs f(i) for every i in [0, count) as one kernel on `stream` of `device`, stream-ordered (the host
/// does not wait; core/cuda_sync.hpp): the one place where device work of the local kernels starts. nvcc: thrust::for_each on the CUDA system;
/// emulated (DTENSOR_EMULATE_DEVICE): emulated_kernel<F> through cudaLaunchKernel.
template <class F>
void launch_kernel(const F& f, std::int64_t count, Device device, cudaStream_t stream, const char* what) {
  if (count == 0) {
    return;
  }
  detail::TensorDeviceGuard guard(device.index);
#if DTENSOR_EMULATE_DEVICE
  const void* args[] = {&f, &count};
  detail::check_tensor_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(&emulated_kernel<F>), dim3(1),
                                             dim3(1), const_cast<void**>(args), 0, stream),
                            "cudaLaunchKernel", what);
#else
  try {
    thrust::for_each(thrust::cuda::par_nosync.on(stream), thrust::counting_iterator<std::int64_t>(0),
                     thrust::counting_iterator<std::int64_t>(count), f);
  } catch (const std::exception& e) {
    detail::throw_error(std::string(what) + " on " + device.to_string() +
                        ": kernel launch failed: " + e.what());
  }
#endif
  detail::after_op(stream, what);
}

/// A kernel on `stream` that reads a tensor of another stream of `device`: `stream` waits for the work
/// pending on `other` before the kernel, and `other` for the kernel after it, so the operand may be
/// released or rewritten there (its memory is freed on its own stream). One stream: nothing.
class StreamJoin {
public:
  StreamJoin(Device device, cudaStream_t stream, cudaStream_t other, const char* what)
      : device_(device), stream_(stream), other_(other), what_(what) {
    if (other_ != stream_) {
      detail::TensorDeviceGuard guard(device_.index);
      detail::order_after(stream_, other_, what_);
    }
  }
  ~StreamJoin() {
    if (other_ != stream_) {
      try {
        detail::TensorDeviceGuard guard(device_.index);
        detail::order_after(other_, stream_, what_);
      } catch (...) { // the stream's error surfaces at its next op
      }
    }
  }
  StreamJoin(const StreamJoin&) = delete;
  StreamJoin& operator=(const StreamJoin&) = delete;

private:
  Device device_;
  cudaStream_t stream_, other_;
  const char* what_;
};

/// Runs f(i) for every i in [0, f.layout.count) as a kernel on `stream` of `device` (stream-ordered).
template <class F>
void run_cuda(const F& f, Device device, cudaStream_t stream, const char* what) {
  launch_kernel(f, f.layout.count, device, stream, what);
}
#endif

/// Copies `src` element by element into `dst` (a tensor or view; Tensor is a handle, so a temporary view
/// is fine). Shapes must match; strides may differ; the two must not partially overlap. Synchronous on the
/// host, stream-ordered on a GPU (the top of this file).
/// Host to host is Tensor::copy_from; device to device on one GPU runs CopyRuns as a kernel in an nvcc TU;
/// anything else is Tensor::copy_from.
template <class T, int R>
void copy(const Tensor<T, R>& dst, const Tensor<T, R>& src) {
  DTENSOR_CHECK(dst.shape() == src.shape(), "local::copy: shape mismatch: destination " +
                                                detail::shape_to_string(dst.shape()) + " vs source " +
                                                detail::shape_to_string(src.shape()));
  if (dst.numel() == 0) {
    return;
  }
#if DTENSOR_LOCAL_OPS_CUDA
  if (dst.device() == src.device() && dst.device().is_cuda()) {
    const StreamJoin join(dst.device(), dst.stream(), src.stream(), "local::copy");
    run_cuda(CopyRuns<T, R>{make_run_layout<R, 2>(dst.shape(), {dst.strides(), src.strides()}, cuda_tile),
                            dst.data(), src.data()},
             dst.device(), dst.stream(), "local::copy");
    return;
  }
#endif
  Tensor<T, R>(dst).copy_from(src);
}

/// Sets every element of `dst` (a tensor or view) to `value` (ordered as copy). CUDA: FillRuns as a kernel in
/// an nvcc TU; otherwise (and on the host) Tensor::fill.
template <class T, int R>
void fill(const Tensor<T, R>& dst, T value) {
  if (dst.numel() == 0) {
    return;
  }
#if DTENSOR_LOCAL_OPS_CUDA
  if (dst.device().is_cuda()) {
    run_cuda(
        FillRuns<T, R>{make_run_layout<R, 1>(dst.shape(), {dst.strides()}, cuda_tile), dst.data(), value},
        dst.device(), dst.stream(), "local::fill");
    return;
  }
#endif
  Tensor<T, R>(dst).fill(value);
}

/// Multiplies every element of `t` (a tensor or view of a floating type) by `factor`, computing in float
/// (double for double) and rounding back (ordered as copy). CUDA tensors need an nvcc TU (a kernel).
template <class T, int R>
void scale(const Tensor<T, R>& t, double factor) {
  static_assert(std::is_floating_point_v<T> || detail::is_reduced_float_v<T>,
                "local::scale: the element type must be floating (float, double, bfloat16, half, "
                "float8_e4m3, float8_e5m2)");
  if (t.numel() == 0 || t.device().is_meta()) {
    return;
  }
  const auto f = static_cast<scale_type_t<T>>(factor);
  if (t.device().is_cpu()) {
    run_host(ScaleRuns<T, R>{make_run_layout<R, 1>(t.shape(), {t.strides()}, host_tile), t.data(), f});
    return;
  }
#if DTENSOR_LOCAL_OPS_CUDA
  run_cuda(ScaleRuns<T, R>{make_run_layout<R, 1>(t.shape(), {t.strides()}, cuda_tile), t.data(), f},
           t.device(), t.stream(), "local::scale");
#else
  detail::throw_error(
      "local::scale on " + t.device().to_string() +
      ": scaling a CUDA tensor needs a kernel; compile this translation unit with nvcc (and the "
      "CUDA Toolkit's Thrust headers)");
#endif
}

/// dst = src converted element by element to dst's element type (float <-> bfloat16, half, double: through
/// float, or double when either side is double; rounding to nearest even). Shapes must match; strides may
/// differ; both on one device (ordered as copy). CUDA tensors need an nvcc TU (a kernel).
template <class D, class S, int R>
void convert(const Tensor<D, R>& dst, const Tensor<S, R>& src) {
  static_assert((std::is_floating_point_v<D> || detail::is_reduced_float_v<D>)&&(
                    std::is_floating_point_v<S> || detail::is_reduced_float_v<S>),
                "local::convert: both element types must be floating (float, double, bfloat16, half, "
                "float8_e4m3, float8_e5m2)");
  DTENSOR_CHECK(dst.shape() == src.shape(), "local::convert: shape mismatch: destination " +
                                                detail::shape_to_string(dst.shape()) + " vs source " +
                                                detail::shape_to_string(src.shape()));
  DTENSOR_CHECK(dst.device() == src.device(), "local::convert: the destination is on " +
                                                  dst.device().to_string() + ", the source on " +
                                                  src.device().to_string());
  if constexpr (std::is_same_v<D, S>) {
    copy(dst, src);
  } else {
    if (dst.numel() == 0 || dst.device().is_meta()) {
      return;
    }
    if (dst.device().is_cpu()) {
      run_host(
          ConvertRuns<D, S, R>{make_run_layout<R, 2>(dst.shape(), {dst.strides(), src.strides()}, host_tile),
                               dst.data(), src.data()});
      return;
    }
#if DTENSOR_LOCAL_OPS_CUDA
    const StreamJoin join(dst.device(), dst.stream(), src.stream(), "local::convert");
    run_cuda(
        ConvertRuns<D, S, R>{make_run_layout<R, 2>(dst.shape(), {dst.strides(), src.strides()}, cuda_tile),
                             dst.data(), src.data()},
        dst.device(), dst.stream(), "local::convert");
#else
    detail::throw_error("local::convert on " + dst.device().to_string() +
                        ": converting a CUDA tensor needs a kernel; compile this translation unit with nvcc "
                        "(and the CUDA Toolkit's Thrust headers)");
#endif
  }
}

} // namespace DTENSOR_LOCAL_OPS_NS
} // namespace dtensor::local
