#pragma once
// Lists in messages, written once: "[0,2,3]" (group members, compact) or "[4, 0, 4]" (sizes, spaced like
// a shape).
//
//   dtensor::detail::format_list(std::vector{0, 2})        // "[0,2]"
//   dtensor::detail::format_list(counts, ", ")            // "[4, 0, 4]"

#include <string>
#include <string_view>

namespace dtensor::detail {

/// "[a<sep>b<sep>c]": every element of `range` (integers) with std::to_string, between `open` and `close`
/// ("(7, 5)" for shapes: format_list(shape, ", ", "(", ")")).
template <class Range>
std::string format_list(const Range& range, std::string_view sep = ",", std::string_view open = "[",
                        std::string_view close = "]") {
  std::string s(open);
  bool first = true;
  for (const auto& v : range) {
    if (!first) {
      s += sep;
    }
    first = false;
    s += std::to_string(v);
  }
  return s.append(close);
}

} // namespace dtensor::detail
