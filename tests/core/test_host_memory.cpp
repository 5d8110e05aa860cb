// Host memory (core/host_memory.hpp): when the malloc settings apply, and that freed tensor memory is
// reused without page faults (getrusage's minor faults), which glibc's defaults do not do for this
// pattern: eight 1 MiB tensors alive at once, freed last first, again and again (with the defaults the
// freed top of the heap exceeds the trim threshold and goes back to the kernel each round: ~2000 faults a
// round here, against 0 with the settings).
#include <catch2/catch.hpp>

#include <dtensor/core/host_memory.hpp>
#include <dtensor/core/tensor.hpp>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include <sys/resource.h>

using namespace dtensor;

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

/// Eight tensors of 1 MiB, written, then freed last first: the minor page faults this took.
long one_round() {
  const long f0 = minor_faults();
  {
    std::vector<Tensor<float, 1>> ts;
    for (int i = 0; i < 8; ++i) {
      ts.push_back(Tensor<float, 1>::full({1 << 18}, float(i)));
    }
    float sum = 0;
    for (const auto& t : ts) {
      sum += t.data()[t.numel() - 1];
    }
    CHECK(sum == 28.0f);
    while (!ts.empty()) {
      ts.pop_back();
    }
  }
  return minor_faults() - f0;
}

/// Sets (or, with nullptr, unsets) an environment variable for the scope.
struct ScopedEnv {
  const char* name;
  std::string old;
  bool had;
  ScopedEnv(const char* n, const char* value) : name(n), had(std::getenv(n) != nullptr) {
    if (had) {
      old = std::getenv(n);
    }
    if (value != nullptr) {
      setenv(n, value, 1);
    } else {
      unsetenv(n);
    }
  }
  ~ScopedEnv() {
    if (had) {
      setenv(name, old.c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
};

} // namespace

TEST_CASE("the malloc settings: applied once, left alone when the environment says so", "[core][memory]") {
#if defined(__GLIBC__) && !DTENSOR_DETAIL_SANITIZED_ALLOCATOR
  {
    ScopedEnv off("DTENSOR_HOST_MALLOC_TUNING", "0");
    CHECK_FALSE(detail::tune_host_malloc());
  }
  {
    ScopedEnv tunables("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000");
    CHECK_FALSE(detail::tune_host_malloc());
  }
  {
    ScopedEnv trim("MALLOC_TRIM_THRESHOLD_", "1000000");
    CHECK_FALSE(detail::tune_host_malloc());
  }
  {
    ScopedEnv other("GLIBC_TUNABLES", "glibc.pthread.rseq=0"); // not a malloc tunable
    ScopedEnv on("DTENSOR_HOST_MALLOC_TUNING", "1");
    CHECK(detail::tune_host_malloc());
  }
  {
    ScopedEnv bad("DTENSOR_HOST_MALLOC_TUNING", "maybe");
    CHECK_THROWS_WITH(detail::tune_host_malloc(), Catch::Contains("DTENSOR_HOST_MALLOC_TUNING"));
  }
#else
  CHECK_FALSE(detail::tune_host_malloc()); // the sanitizer's (or another C library's) allocator decides
#endif
}

TEST_CASE("freed tensor memory is reused without page faults", "[core][memory]") {
  if (!detail::host_malloc_tuned()) {
    WARN("malloc is left alone here (sanitizer, environment or C library): nothing to check");
    return;
  }
  one_round(); // the heap grows to its size for this pattern
  one_round();
  const long faults = one_round();
  INFO(faults << " minor page faults for 8 MiB of tensors written a third time (2048 pages)");
  CHECK(faults < 64);
}
