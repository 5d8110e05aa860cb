// The calibration unit of CI (scripts/lib/ci.sh): a translation unit that never changes, compiled at the
// start of .ci/run the way the test build compiles (C++20, -O0), so that every phase's seconds can also be
// printed as a multiple of what this machine, at this hour, needs to compile it. The build is most of
// CI, and it is this kind of work: standard-library templates instantiated and compiled to code at -O0.
//
// Do not edit: a change makes the unit of every earlier run incomparable with the later ones. If it must
// change, name the new unit (ci.sh's calibration_name) and restate the budgets in it (docs/testing.md).
#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

namespace calibration {

template <class T, int N>
struct Grid {
  std::vector<T> cells = std::vector<T>(N * N);
  T& at(int i, int j) { return cells[i * N + j]; }
  T sum() const { return std::accumulate(cells.begin(), cells.end(), T{}); }
};

template <class Key, class Value>
std::string describe(const std::map<Key, Value>& m) {
  std::ostringstream out;
  for (const auto& [k, v] : m) {
    out << k << '=' << v << ';';
  }
  return out.str();
}

template <class T>
std::vector<T> sorted_unique(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

using Value = std::variant<int, long, double, std::string, std::vector<int>>;

std::string visit_all(const std::vector<Value>& values) {
  std::string out;
  for (const auto& v : values) {
    out += std::visit(
        [](const auto& x) -> std::string {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, std::string>) {
            return x;
          } else if constexpr (std::is_same_v<X, std::vector<int>>) {
            return std::to_string(x.size());
          } else {
            return std::to_string(x);
          }
        },
        v);
  }
  return out;
}

template <class T>
T run_grid() {
  Grid<T, 8> g;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      g.at(i, j) = static_cast<T>(i * j);
    }
  }
  std::map<int, T> m;
  std::unordered_map<long, std::vector<T>> u;
  for (int i = 0; i < 8; ++i) {
    m[i] = g.at(i, i);
    u[i].push_back(g.at(i, 7 - i));
  }
  std::function<T(T)> twice = [](T x) { return x + x; };
  std::optional<T> best;
  for (auto& [k, v] : u) {
    auto s = sorted_unique(v);
    if (!best || s.front() > *best) {
      best = twice(s.front()) + static_cast<T>(k);
    }
  }
  auto shared = std::make_shared<std::tuple<T, std::string>>(g.sum(), describe(m));
  return std::get<0>(*shared) + best.value_or(T{});
}

} // namespace calibration

int calibration_entry() {
  std::vector<calibration::Value> values{1, 2L, 3.0, std::string("four"), std::vector<int>{5}};
  auto text = calibration::visit_all(values);
  return static_cast<int>(calibration::run_grid<int>() + calibration::run_grid<long>() +
                          calibration::run_grid<double>() + calibration::run_grid<float>() +
                          calibration::run_grid<short>() + calibration::run_grid<unsigned>() +
                          calibration::run_grid<long long>() + calibration::run_grid<long double>()) +
         static_cast<int>(text.size());
}
