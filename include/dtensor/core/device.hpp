#pragma once
// Device: where a tensor's memory lives (the host, or one CUDA GPU), or nowhere (meta).
//
//   auto d = dtensor::Device::cuda(1);   // d.to_string() == "cuda:1"
//   if (d.is_cuda()) { ... }
//   auto m = dtensor::Tensor<float, 2>({4096, 4096}, dtensor::Device::meta());   // shape only, no memory
//
// A meta tensor (torch's device "meta") has a shape, strides and a dtype and no elements: ops on it do
// their shape logic and allocate their outputs (meta too) but run no kernel, collectives on the fake
// backend record what they would move and move nothing. A dry run (backends/fake/backend.hpp) runs a
// training step on meta tensors to learn what it communicates and holds without the memory or the time
// of the real one; a MemoryTracker counts a meta tensor's bytes as if they were held.

#include <cstdint>
#include <string>

namespace dtensor {

/// A memory location: the host (`Device::cpu()`, index 0), CUDA GPU `index` (`Device::cuda(index)`), or
/// none (`Device::meta()`: tensors with a shape and no data). A plain value type; `Device{}` is the host.
struct Device {
  enum class Kind : std::uint8_t { cpu, cuda, meta };

  Kind kind = Kind::cpu;
  int index = 0;

  static constexpr Device cpu() noexcept { return Device{}; }
  static constexpr Device cuda(int index = 0) noexcept { return Device{Kind::cuda, index}; }
  static constexpr Device meta() noexcept { return Device{Kind::meta, 0}; }

  constexpr bool is_cpu() const noexcept { return kind == Kind::cpu; }
  constexpr bool is_cuda() const noexcept { return kind == Kind::cuda; }
  constexpr bool is_meta() const noexcept { return kind == Kind::meta; }

  friend constexpr bool operator==(Device, Device) noexcept = default;

  /// "cpu", "cuda:<index>" or "meta", as PyTorch prints devices.
  std::string to_string() const {
    return is_cuda() ? "cuda:" + std::to_string(index) : std::string(is_cpu() ? "cpu" : "meta");
  }
};

} // namespace dtensor
