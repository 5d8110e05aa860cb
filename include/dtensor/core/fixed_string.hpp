#pragma once
// fixed_string: a string literal usable as a template argument (`Axis<"tp", 4>`).

#include <cstddef>
#include <string_view>

namespace dtensor {

/// A structural string type for non-type template parameters. `N` counts the terminating '\0'.
template <std::size_t N>
struct fixed_string {
  char chars[N]{};

  constexpr fixed_string(const char (&s)[N]) noexcept {
    for (std::size_t i = 0; i < N; ++i) {
      chars[i] = s[i];
    }
  }

  constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
  constexpr std::size_t size() const noexcept { return N - 1; }

  template <std::size_t M>
  friend constexpr bool operator==(const fixed_string& a, const fixed_string<M>& b) noexcept {
    return a.view() == b.view();
  }
};

} // namespace dtensor
