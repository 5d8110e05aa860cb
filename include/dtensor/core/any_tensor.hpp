#pragma once
// AnyTensor: a Tensor with its element type and rank erased, for code that must not be a template over
// them (the plan executor, the comm front end). It shares memory with the Tensor it came from.
//
//   dtensor::Tensor<float, 2> t = dtensor::Tensor<float, 2>::zeros({4, 6});
//   dtensor::AnyTensor a(t);                        // float32, shape (4, 6), same memory
//   dtensor::AnyTensor col = a.narrow(1, 2, 3);     // strided view
//   auto packed = dtensor::AnyTensor::empty(a.dtype(), col.shape(), a.device(), a.stream());
//   packed.copy_from(col);                          // strided copy, host or CUDA
//   dtensor::Tensor<float, 2> back = packed.as<float, 2>();   // checked: dtype and rank must match
//
// Copies and fills are ordered like Tensor's (synchronous on the host, stream-ordered on a GPU:
// core/cuda_sync.hpp), and run the same code in every translation unit (memmove on the host;
// cudaMemcpy2DAsync / cudaMemsetAsync on a CUDA tensor's stream, which need no kernel, so nvcc and plain
// C++ TUs agree).

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "dtensor/core/config.hpp"
#include "dtensor/core/cuda_sync.hpp"
#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"
#include "dtensor/core/error.hpp"
#include "dtensor/core/extents.hpp"
#include "dtensor/core/format.hpp"
#include "dtensor/core/tensor.hpp"

namespace dtensor {
inline namespace DTENSOR_CONFIG_NS {

class AnyTensor {
public:
  /// Undefined: defined() is false.
  AnyTensor() = default;

  /// Shares `t`'s memory (moving from an rvalue keeps its storage's use count).
  template <class T, int Rank>
  explicit AnyTensor(const Tensor<T, Rank>& t) : AnyTensor(Tensor<T, Rank>(t)) {}
  template <class T, int Rank>
  explicit AnyTensor(Tensor<T, Rank>&& t)
      : storage_(std::move(t.storage_)), data_(t.data_), dtype_(dtype_v<T>), device_(t.device_),
        stream_(t.stream_), numel_(t.numel_), defined_(t.defined_) {
    for (int d = 0; d < Rank; ++d) {
      shape_.push_back(t.shape_[d]);
      strides_.push_back(t.strides_[d]);
    }
  }

  /// Uninitialised contiguous memory of `shape` (stream-ordered on `stream` for a CUDA device).
  static AnyTensor empty(DType dtype, const Extents& shape, Device device, CUstream_st* stream = nullptr) {
    AnyTensor t;
    t.dtype_ = dtype;
    t.device_ = device;
    t.stream_ = stream;
    t.shape_ = shape;
    t.numel_ = checked_numel(shape, "AnyTensor::empty");
    t.strides_ = contiguous_strides(shape);
    const std::size_t nbytes = t.nbytes();
    t.defined_ = true;
    if (device.is_meta()) {
      t.storage_ = detail::allocate_meta(nbytes); // addresses, no memory
    } else if (device.is_cpu()) {
      t.storage_ = detail::allocate_host(nbytes);
    } else {
#if DTENSOR_HAS_CUDA
      t.storage_ = detail::allocate_cuda(nbytes, device, stream);
#else
      detail::throw_no_cuda("AnyTensor::empty", device);
#endif
    }
    t.data_ = t.storage_.get();
    return t;
  }

  /// Wraps `data` (the first element) laid out by `shape` and `strides` (in elements), kept alive by
  /// `owner` (empty: the caller keeps the memory alive). Throws for negative sizes or strides.
  static AnyTensor from_blob(void* data, DType dtype, const Extents& shape, const Extents& strides,
                             Device device, std::shared_ptr<void> owner, CUstream_st* stream = nullptr) {
    DTENSOR_CHECK(strides.size() == shape.size(), "AnyTensor::from_blob: shape " + to_string(shape) +
                                                      " and strides " + to_string(strides) +
                                                      " differ in rank");
    AnyTensor t;
    t.numel_ = 1;
    for (int d = 0; d < shape.size(); ++d) {
      DTENSOR_CHECK(shape[d] >= 0 && strides[d] >= 0 &&
                        (shape[d] == 0 || t.numel_ <= kMaxElements / shape[d]),
                    "AnyTensor::from_blob: invalid shape " + to_string(shape) + " or strides " +
                        to_string(strides) + " (sizes and strides must be >= 0)");
      t.numel_ *= shape[d];
    }
    t.storage_ = std::move(owner);
    t.data_ = data;
    t.dtype_ = dtype;
    t.device_ = device;
    t.stream_ = stream;
    t.shape_ = shape;
    t.strides_ = strides;
    t.defined_ = true;
    return t;
  }

  /// The typed tensor sharing this memory; throws unless T and Rank match.
  template <class T, int Rank>
  Tensor<T, Rank> as() const& {
    return AnyTensor(*this).template as<T, Rank>();
  }
  template <class T, int Rank>
  Tensor<T, Rank> as() && {
    DTENSOR_CHECK(dtype_ == dtype_v<T> && shape_.size() == Rank,
                  "AnyTensor::as<" + std::string(dtype_name(dtype_v<T>)) + ", " + std::to_string(Rank) +
                      ">: the tensor is " + std::string(dtype_name(dtype_)) + " of rank " +
                      std::to_string(shape_.size()));
    Tensor<T, Rank> t;
    t.storage_ = std::move(storage_);
    t.data_ = static_cast<T*>(data_);
    for (int d = 0; d < Rank; ++d) {
      t.shape_[d] = shape_[d];
      t.strides_[d] = strides_[d];
    }
    t.numel_ = numel_;
    t.device_ = device_;
    t.stream_ = stream_;
    t.defined_ = defined_;
    return t;
  }

  bool defined() const noexcept {
    return defined_;
  }
  DType dtype() const noexcept {
    return dtype_;
  }
  Device device() const noexcept {
    return device_;
  }
  CUstream_st* stream() const noexcept {
    return stream_;
  }
  int rank() const noexcept {
    return shape_.size();
  }
  const Extents& shape() const noexcept {
    return shape_;
  }
  const Extents& strides() const noexcept {
    return strides_;
  }
  std::int64_t numel() const noexcept {
    return numel_;
  }
  std::size_t element_size() const noexcept {
    return dtype_size(dtype_);
  }
  std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel_) * element_size();
  }
  void* data() const noexcept {
    return data_;
  }
  const std::shared_ptr<void>& storage() const noexcept {
    return storage_;
  }

  /// Row-major without gaps (size-1 dims may have any stride).
  bool is_contiguous() const noexcept {
    return detail::is_contiguous_layout(shape_, strides_, rank(), numel_);
  }

  /// Elements [start, start + length) of dim `dim`, sharing memory.
  AnyTensor narrow(int dim, std::int64_t start, std::int64_t length) const {
    DTENSOR_CHECK(dim >= 0 && dim < rank() && start >= 0 && length >= 0 && start <= shape_[dim] - length,
                  "AnyTensor::narrow(" + std::to_string(dim) + ", " + std::to_string(start) + ", " +
                      std::to_string(length) + "): out of range for shape " + to_string(shape_));
    AnyTensor r = *this;
    r.numel_ = shape_[dim] == 0 ? 0 : numel_ / shape_[dim] * length;
    r.shape_[dim] = length;
    if (data_ != nullptr && length > 0) {
      r.data_ = static_cast<char*>(data_) + start * strides_[dim] * static_cast<std::int64_t>(element_size());
    }
    return r;
  }

  /// The part `part` of this tensor, which holds the block `whole` (both in global coordinates).
  AnyTensor region(const Block& whole, const Block& part) const {
    AnyTensor r = *this;
    for (int d = 0; d < rank(); ++d) {
      r = r.narrow(d, part.offset[d] - whole.offset[d], part.shape[d]);
    }
    return r;
  }

  /// The same memory seen as contiguous `shape` (same element count); throws unless contiguous.
  AnyTensor view(const Extents& shape) const {
    const std::int64_t n = checked_numel(shape, "AnyTensor::view");
    DTENSOR_CHECK(is_contiguous() && n == numel_, "AnyTensor::view" + to_string(shape) + ": the tensor " +
                                                      to_string(shape_) + " is not contiguous or has " +
                                                      std::to_string(numel_) + " elements");
    AnyTensor r = *this;
    r.shape_ = shape;
    r.strides_ = contiguous_strides(shape);
    return r;
  }

  /// A new contiguous tensor with this one's dtype, device and stream, and `shape`.
  AnyTensor new_empty(const Extents& shape) const {
    return empty(dtype_, shape, device_, stream_);
  }

  /// A contiguous copy (on the same device and stream).
  AnyTensor clone() const {
    AnyTensor r = new_empty(shape_);
    r.copy_from(*this);
    return r;
  }

  /// Element-wise copy of `src` (same dtype and shape; strides and devices may differ), ordered as
  /// Tensor::copy_from. Into a meta tensor: nothing to do; out of one (into memory): an error, it has no data.
  void copy_from(const AnyTensor& src) const {
    DTENSOR_CHECK(src.dtype_ == dtype_ && src.shape_ == shape_,
                  "AnyTensor::copy_from: destination " + std::string(dtype_name(dtype_)) + to_string(shape_) +
                      " vs source " + std::string(dtype_name(src.dtype_)) + to_string(src.shape_));
    if (numel_ == 0 || device_.is_meta()) {
      return;
    }
    DTENSOR_CHECK(!src.device_.is_meta(), "AnyTensor::copy_from: the source " + to_string(src.shape_) +
                                              " is a meta tensor: it has a shape and no data to copy");
    const auto shape = padded(shape_, 1);
    const auto dst_strides = padded(strides_, 0);
    const auto src_strides = padded(src.strides_, 0);
    if (device_.is_cpu() && src.device_.is_cpu()) {
      detail::copy_host(data_, dst_strides, src.data_, src_strides, shape, element_size());
      return;
    }
#if DTENSOR_HAS_CUDA
    detail::copy_cuda_ordered(data_, dst_strides, device_, stream_, src.data_, src_strides, src.device_,
                              src.stream_, shape, element_size(), "AnyTensor::copy_from");
#else
    detail::throw_no_cuda("AnyTensor::copy_from", device_.is_cuda() ? device_ : src.device_);
#endif
  }

  /// Sets every element to the element_size()-byte value at `value` (ordered as Tensor::fill).
  void fill_bytes(const void* value) const {
    if (numel_ == 0 || device_.is_meta()) {
      return;
    }
    const std::size_t es = element_size();
    if (!is_contiguous()) {
      AnyTensor tmp = new_empty(shape_);
      tmp.fill_bytes(value);
      copy_from(tmp);
      return;
    }
    if (device_.is_cpu()) {
      auto* out = static_cast<unsigned char*>(data_);
      const std::size_t total = nbytes();
      std::memcpy(out, value, es);
      for (std::size_t done = es; done < total;) { // doubling copies of the filled prefix
        const std::size_t n = done < total - done ? done : total - done;
        std::memcpy(out + done, out, n);
        done += n;
      }
      return;
    }
#if DTENSOR_HAS_CUDA
    detail::TensorDeviceGuard guard(device_.index);
    detail::fill_cuda(data_, value, es, numel_, stream_);
    detail::after_op(stream_, "AnyTensor::fill");
#else
    detail::throw_no_cuda("AnyTensor::fill", device_);
#endif
  }

  /// "(4, 6)".
  static std::string to_string(const Extents& e) {
    return detail::format_list(e, ", ", "(", ")");
  }

private:
  static constexpr std::int64_t kMaxElements = std::int64_t{1} << 56;

  /// Number of elements of `shape`; throws unless every size is >= 0 and the product of the non-zero
  /// sizes is at most kMaxElements (so the strides of an empty tensor fit too).
  static std::int64_t checked_numel(const Extents& shape, const char* what) {
    std::int64_t nonzero = 1;
    std::int64_t n = 1;
    for (std::int64_t s : shape) {
      DTENSOR_CHECK(s >= 0 && (s == 0 || nonzero <= kMaxElements / s),
                    std::string(what) + ": invalid shape " + to_string(shape) +
                        (s < 0 ? " (negative size)" : " (more than 2^56 elements)"));
      nonzero *= s == 0 ? 1 : s;
      n *= s;
    }
    return n;
  }

  /// @pre checked_numel(shape) did not throw.
  static Extents contiguous_strides(const Extents& shape) {
    Extents s(shape.size(), 1);
    std::int64_t step = 1;
    for (int d = shape.size() - 1; d >= 0; --d) {
      s[d] = step;
      step *= shape[d];
    }
    return s;
  }

  /// `e` as a max_tensor_rank array, leading dims filled with `fill` (so one copy routine serves every
  /// rank).
  static std::array<std::int64_t, max_tensor_rank> padded(const Extents& e, std::int64_t fill) {
    std::array<std::int64_t, max_tensor_rank> a{};
    const int lead = max_tensor_rank - e.size();
    for (int d = 0; d < lead; ++d) {
      a[d] = fill;
    }
    for (int d = 0; d < e.size(); ++d) {
      a[lead + d] = e[d];
    }
    return a;
  }

  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::float32;
  Device device_{};
  CUstream_st* stream_ = nullptr;
  Extents shape_;
  Extents strides_;
  std::int64_t numel_ = 0;
  bool defined_ = false;
};

} // namespace DTENSOR_CONFIG_NS
} // namespace dtensor
