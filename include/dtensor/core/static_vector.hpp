#pragma once
// StaticVector: a fixed-capacity vector usable in constant expressions. The layout algebra and the
// planner work on small run-time-sized lists (mesh coordinates, shapes, placement lists) whose length
// is bounded by small constants, so they need no allocation and fold at compile time.

#include <cstddef>
#include <initializer_list>

#include "dtensor/core/error.hpp"

namespace dtensor {

/// Most mesh axes a DeviceMesh may have and most dimensions a tensor may have.
inline constexpr int max_mesh_rank = 8;
inline constexpr int max_tensor_rank = 8;

template <class T, int Capacity>
class StaticVector {
public:
  using value_type = T;

  constexpr StaticVector() = default;
  constexpr StaticVector(std::initializer_list<T> init) {
    for (const T& v : init) {
      push_back(v);
    }
  }
  /// `n` copies of `value`.
  constexpr StaticVector(int n, const T& value) {
    for (int i = 0; i < n; ++i) {
      push_back(value);
    }
  }

  constexpr void push_back(const T& v) {
    DTENSOR_CHECK(size_ < Capacity, "StaticVector: capacity exceeded");
    data_[size_++] = v;
  }
  constexpr void pop_back() { --size_; }
  constexpr void clear() noexcept { size_ = 0; }

  constexpr int size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }
  static constexpr int capacity() noexcept { return Capacity; }

  constexpr T& operator[](int i) noexcept { return data_[i]; }
  constexpr const T& operator[](int i) const noexcept { return data_[i]; }
  constexpr T& back() noexcept { return data_[size_ - 1]; }
  constexpr const T& back() const noexcept { return data_[size_ - 1]; }

  constexpr T* begin() noexcept { return data_; }
  constexpr T* end() noexcept { return data_ + size_; }
  constexpr const T* begin() const noexcept { return data_; }
  constexpr const T* end() const noexcept { return data_ + size_; }

  friend constexpr bool operator==(const StaticVector& a, const StaticVector& b) noexcept {
    if (a.size_ != b.size_) {
      return false;
    }
    for (int i = 0; i < a.size_; ++i) {
      if (!(a.data_[i] == b.data_[i])) {
        return false;
      }
    }
    return true;
  }

private:
  T data_[Capacity]{};
  int size_ = 0;
};

} // namespace dtensor
