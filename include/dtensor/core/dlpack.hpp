#pragma once
// DLPack interop: local tensors pass to and from PyTorch, CuPy, JAX and other DLPack users without a copy.
//
//   DLManagedTensor* m = dtensor::to_dlpack(x.to_local());    // a DTensor's shard, host or CUDA
//   // ... hand `m` to a consumer (in Python: a PyCapsule named "dltensor"); it calls m->deleter once
//   auto t = dtensor::from_dlpack<float, 2>(theirs);           // shares their memory; throws on a mismatch
//   dtensor::AnyTensor any = dtensor::from_dlpack(theirs);     // any supported dtype and rank
//
// Ownership. to_dlpack's DLManagedTensor holds one reference to the tensor's storage (and owns its shape
// and strides arrays); its deleter releases both, and must be called exactly once. from_dlpack takes
// ownership of the DLManagedTensor only when it returns: the returned tensor and every view of it share
// one owner, and the last of them to go calls the producer's deleter once. When from_dlpack throws, the
// caller still owns it (as with a PyCapsule that was not renamed "used_dltensor").
//
// What maps to what. Strides are in elements both ways; dtensor strides are never negative, so a DLPack
// tensor with a negative stride is an Error. Null strides mean row-major. Types: float16/32/64 <->
// kDLFloat, bfloat16 <-> kDLBfloat 16, int32/int64 <-> kDLInt, uint8 <-> kDLUInt 8 (lanes 1). DLPack 0.6
// (Debian's libdlpack-dev) has no float8 codes: exporting float8_e4m3fn / float8_e5m2 is an Error.
// Devices: kDLCPU and kDLCUDAHost (pinned host memory) import as the host, kDLCUDA and kDLCUDAManaged as
// cuda:<device_id>; dtensor exports kDLCPU or kDLCUDA. DLPack carries no stream: a CUDA tensor's data is
// ready once the work queued on its stream has run, and a consumer on another stream must wait for that
// (from_dlpack's CUDA tensors are on the legacy default stream).
//
// Needs dlpack/dlpack.h (Debian: libdlpack-dev); the CMake target dtensor::dlpack exists when it is found.

#include <dlpack/dlpack.h>

#include <array>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "dtensor/core/any_tensor.hpp"
#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/tensor.hpp"

namespace dtensor {
namespace detail {

/// What to_dlpack hands out: the DLManagedTensor first, then what its deleter releases.
struct DLPackExport {
  DLManagedTensor managed{};
  std::shared_ptr<void> storage;
  std::int64_t shape[max_tensor_rank]{};
  std::int64_t strides[max_tensor_rank]{};
};

/// The DLPack type of `dtype`; throws for the float8 types, which DLPack 0.6 cannot name.
inline DLDataType dlpack_dtype(DType dtype) {
  switch (dtype) {
  case DType::float32:
    return {kDLFloat, 32, 1};
  case DType::float64:
    return {kDLFloat, 64, 1};
  case DType::float16:
    return {kDLFloat, 16, 1};
  case DType::bfloat16:
    return {kDLBfloat, 16, 1};
  case DType::int32:
    return {kDLInt, 32, 1};
  case DType::int64:
    return {kDLInt, 64, 1};
  case DType::uint8:
    return {kDLUInt, 8, 1};
  case DType::float8_e4m3:
  case DType::float8_e5m2:
    break;
  }
  throw Error("to_dlpack: " + std::string(dtype_name(dtype)) +
              " has no DLPack type code (DLPack 0.6, dlpack/dlpack.h, defines none for 8-bit floats); "
              "convert the tensor to bfloat16 or float16 first");
}

inline std::string dlpack_dtype_string(DLDataType t) {
  static constexpr std::array<const char*, 6> codes = {"kDLInt",          "kDLUInt",   "kDLFloat",
                                                       "kDLOpaqueHandle", "kDLBfloat", "kDLComplex"};
  const std::string code = t.code < codes.size() ? codes[t.code] : "code " + std::to_string(t.code);
  return code + " bits " + std::to_string(t.bits) + " lanes " + std::to_string(t.lanes);
}

/// The dtensor type of a DLPack type; throws naming it when there is none.
inline DType dtype_from_dlpack(DLDataType t) {
  if (t.lanes == 1) {
    switch (t.code) {
    case kDLFloat:
      switch (t.bits) {
      case 16:
        return DType::float16;
      case 32:
        return DType::float32;
      case 64:
        return DType::float64;
      }
      break;
    case kDLBfloat:
      if (t.bits == 16) {
        return DType::bfloat16;
      }
      break;
    case kDLInt:
      switch (t.bits) {
      case 32:
        return DType::int32;
      case 64:
        return DType::int64;
      }
      break;
    case kDLUInt:
      if (t.bits == 8) {
        return DType::uint8;
      }
      break;
    }
  }
  throw Error("from_dlpack: DLPack type " + dlpack_dtype_string(t) +
              " has no dtensor element type (float16/32/64, bfloat16, int32, int64, uint8, one lane)");
}

inline Device device_from_dlpack(DLDevice d) {
  switch (d.device_type) {
  case kDLCPU:
  case kDLCUDAHost:
    return Device::cpu(); // pinned host memory is ordinary host memory to the CPU
  case kDLCUDA:
  case kDLCUDAManaged:
    return Device::cuda(d.device_id); // cudaMemcpyDefault copies handle managed memory
  default:
    break;
  }
  throw Error("from_dlpack: DLPack device type " + std::to_string(static_cast<int>(d.device_type)) +
              " (device " + std::to_string(d.device_id) +
              ") is not supported; dtensor takes kDLCPU, kDLCUDAHost, kDLCUDA and kDLCUDAManaged");
}

/// What a DLManagedTensor describes, checked; takes no ownership.
struct DLPackImport {
  void* data = nullptr;
  DType dtype{};
  Device device{};
  Extents shape;
  Extents strides;
};

/// The most elements an imported tensor may have: what AnyTensor and Tensor<T> of every T accept.
inline constexpr std::int64_t max_dlpack_elements = std::int64_t{1} << 56;

inline DLPackImport describe_dlpack(const DLManagedTensor* m) {
  DTENSOR_CHECK(m != nullptr, "from_dlpack: the DLManagedTensor is null");
  const DLTensor& t = m->dl_tensor;
  DLPackImport r;
  r.dtype = dtype_from_dlpack(t.dtype);
  r.device = device_from_dlpack(t.device);
  DTENSOR_CHECK(t.ndim >= 0 && t.ndim <= max_tensor_rank,
                "from_dlpack: ndim " + std::to_string(t.ndim) + " is outside [0, " +
                    std::to_string(max_tensor_rank) + "], the ranks dtensor holds");
  DTENSOR_CHECK(t.ndim == 0 || t.shape != nullptr,
                "from_dlpack: ndim " + std::to_string(t.ndim) + " with a null shape");
  r.shape = Extents(t.ndim, 0);
  r.strides = Extents(t.ndim, 1);
  std::int64_t numel = 1;
  for (int d = 0; d < t.ndim; ++d) {
    r.shape[d] = t.shape[d];
    DTENSOR_CHECK(r.shape[d] >= 0, "from_dlpack: negative size " + std::to_string(r.shape[d]) + " in dim " +
                                       std::to_string(d));
    // Checked here so that nothing after adopt_dlpack throws (the tensor constructors check it too).
    DTENSOR_CHECK(r.shape[d] == 0 || numel <= max_dlpack_elements / r.shape[d],
                  "from_dlpack: the shape is too large (more than 2^56 elements in its first " +
                      std::to_string(d + 1) + " dims)");
    numel *= r.shape[d];
  }
  std::int64_t step = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    r.strides[d] = t.strides != nullptr ? t.strides[d] : step; // null strides: row-major
    step *= r.shape[d];
    DTENSOR_CHECK(r.strides[d] >= 0, "from_dlpack: stride " + std::to_string(r.strides[d]) + " in dim " +
                                         std::to_string(d) + " of shape " + AnyTensor::to_string(r.shape) +
                                         ": dtensor tensors cannot have negative strides");
  }
  r.data = t.data == nullptr ? nullptr : static_cast<char*>(t.data) + t.byte_offset;
  return r;
}

/// Holds a producer's DLManagedTensor and calls its deleter when the last tensor sharing it goes.
struct DLPackOwner {
  DLManagedTensor* managed = nullptr;
  DLPackOwner() = default;
  DLPackOwner(const DLPackOwner&) = delete;
  DLPackOwner& operator=(const DLPackOwner&) = delete;
  ~DLPackOwner() {
    if (managed->deleter != nullptr) {
      managed->deleter(managed);
    }
  }
};

/// Takes ownership of `m`: the allocation that may throw comes first, so a throw leaves `m` with the caller.
inline std::shared_ptr<void> adopt_dlpack(DLManagedTensor* m) {
  auto owner = std::make_shared<DLPackOwner>();
  owner->managed = m;
  return owner;
}

inline DLManagedTensor* to_dlpack_any(const AnyTensor& t) {
  DTENSOR_CHECK(t.defined(), "to_dlpack: the tensor is undefined");
  DTENSOR_CHECK(!t.device().is_meta(), "to_dlpack: the tensor is a meta tensor (no data); DLPack has no "
                                       "device for it");
  const DLDataType dtype = dlpack_dtype(t.dtype());
#if DTENSOR_HAS_CUDA
  if (t.device().is_cuda()) { // DLPack 0.6 carries no stream: the data must be ready for any consumer
    TensorDeviceGuard guard(t.device().index);
    host_sync(t.stream(), "to_dlpack (DLPack carries no stream)");
  }
#endif
  auto* e = new DLPackExport;
  e->storage = t.storage();
  for (int d = 0; d < t.rank(); ++d) {
    e->shape[d] = t.shape()[d];
    e->strides[d] = t.strides()[d];
  }
  DLTensor& out = e->managed.dl_tensor;
  out.data = t.data();
  out.device = t.device().is_cuda() ? DLDevice{kDLCUDA, t.device().index} : DLDevice{kDLCPU, 0};
  out.ndim = t.rank();
  out.dtype = dtype;
  out.shape = e->shape;
  out.strides = e->strides;
  out.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* self) { delete static_cast<DLPackExport*>(self->manager_ctx); };
  return &e->managed;
}

} // namespace detail

inline namespace DTENSOR_CONFIG_NS {

/// `t` as a DLManagedTensor sharing its memory (data points at the first element, byte_offset 0, strides
/// in elements). The result holds a reference to t's storage until its deleter runs; a from_blob tensor
/// without an owner exports memory its caller must keep alive. Throws for an undefined tensor and for
/// the float8 types.
template <class T, int Rank>
DLManagedTensor* to_dlpack(const Tensor<T, Rank>& t) {
  return detail::to_dlpack_any(AnyTensor(t));
}
inline DLManagedTensor* to_dlpack(const AnyTensor& t) {
  return detail::to_dlpack_any(t);
}

/// A tensor sharing the memory `m` describes (data + byte_offset); takes ownership of `m` when it returns,
/// leaves it with the caller when it throws (unsupported type or device, negative strides, rank > 8).
inline AnyTensor from_dlpack(DLManagedTensor* m) {
  detail::DLPackImport d = detail::describe_dlpack(m);
  return AnyTensor::from_blob(d.data, d.dtype, d.shape, d.strides, d.device, detail::adopt_dlpack(m));
}

/// As above, typed: also throws (leaving `m` with the caller) unless the type is T and ndim is Rank.
template <class T, int Rank>
Tensor<T, Rank> from_dlpack(DLManagedTensor* m) {
  detail::DLPackImport d = detail::describe_dlpack(m);
  DTENSOR_CHECK(d.dtype == dtype_v<T> && d.shape.size() == Rank,
                "from_dlpack<" + std::string(dtype_name(dtype_v<T>)) + ", " + std::to_string(Rank) +
                    ">: the DLPack tensor is " + std::string(dtype_name(d.dtype)) + " of rank " +
                    std::to_string(d.shape.size()) + ", shape " + AnyTensor::to_string(d.shape));
  typename Tensor<T, Rank>::Shape shape{};
  typename Tensor<T, Rank>::Shape strides{};
  for (int i = 0; i < Rank; ++i) {
    shape[i] = d.shape[i];
    strides[i] = d.strides[i];
  }
  return Tensor<T, Rank>::from_blob(static_cast<T*>(d.data), shape, strides, d.device,
                                    detail::adopt_dlpack(m));
}

} // namespace DTENSOR_CONFIG_NS
} // namespace dtensor
