#pragma once
// Device: where a tensor's memory lives (the host, or one CUDA GPU).
//
//   auto d = dtensor::Device::cuda(1);   // d.to_string() == "cuda:1"
//   if (d.is_cuda()) { ... }

#include <cstdint>
#include <string>

namespace dtensor {

/// A memory location: the host (`Device::cpu()`, index 0) or CUDA GPU `index` (`Device::cuda(index)`).
/// A plain value type; `Device{}` is the host.
struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };

  Kind kind = Kind::cpu;
  int index = 0;

  static constexpr Device cpu() noexcept { return Device{}; }
  static constexpr Device cuda(int index = 0) noexcept { return Device{Kind::cuda, index}; }

  constexpr bool is_cpu() const noexcept { return kind == Kind::cpu; }
  constexpr bool is_cuda() const noexcept { return kind == Kind::cuda; }

  friend constexpr bool operator==(Device, Device) noexcept = default;

  /// "cpu" or "cuda:<index>", as PyTorch prints devices.
  std::string to_string() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }
};

} // namespace dtensor
