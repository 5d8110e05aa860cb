#pragma once
// The data of a backend op, untyped: a raw buffer described by (pointer, element count, DType, Device,
// stream), and one point-to-point request of a batch. What the collectives front end (comm/) hands a
// Backend (backends/backend.hpp); a BufferRef never owns its memory.
//
//   std::vector<float> v(6);
//   dtensor::BufferRef buf{v.data(), 6, dtensor::DType::float32, dtensor::Device::cpu()};
//   auto blocks = dtensor::split_buffer(buf, counts, displs);   // one BufferRef per member
//   bool packed = dtensor::packed_in_order(counts, displs);     // blocks back to back from 0?

#include "dtensor/core/device.hpp"
#include "dtensor/core/element_type.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace dtensor {

/// `count` elements of `dtype` starting at `data`, in the memory of `device`. Never owns.
struct BufferRef {
  void* data = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::float32;
  Device device = Device::cpu();
  /// The CUDA stream (cudaStream_t) the memory is ordered on: work on it wrote the data, and its release
  /// is enqueued there. nullptr: the legacy default stream, or host memory.
  void* stream = nullptr;

  std::size_t nbytes() const noexcept { return static_cast<std::size_t>(count) * dtype_size(dtype); }
};

/// The blocks buf[displs[i] .. + counts[i]) of one buffer, e.g. for gather and scatter.
inline std::vector<BufferRef> split_buffer(BufferRef buf, std::span<const std::int64_t> counts,
                                           std::span<const std::int64_t> displs) {
  std::vector<BufferRef> blocks(counts.size(), buf);
  for (std::size_t i = 0; i < counts.size(); ++i) {
    blocks[i].data =
        static_cast<char*>(buf.data) + static_cast<std::size_t>(displs[i]) * dtype_size(buf.dtype);
    blocks[i].count = counts[i];
  }
  return blocks;
}

/// Whether the blocks (counts[i] elements at displs[i]) lie back to back in member order from 0.
inline bool packed_in_order(std::span<const std::int64_t> counts, std::span<const std::int64_t> displs) {
  std::int64_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (displs[i] != at) {
      return false;
    }
    at += counts[i];
  }
  return true;
}

/// Largest user tag + 1 accepted by point-to-point ops.
inline constexpr int kMaxP2PTag = 1 << 23;

/// One point-to-point operation of a batch.
struct P2PRequest {
  enum class Kind : std::uint8_t { send, recv };
  Kind kind = Kind::send;
  BufferRef buffer;
  int peer = 0; ///< rank in the group, not this rank
  int tag = 0;  ///< user tag, 0 <= tag < kMaxP2PTag
};

} // namespace dtensor
