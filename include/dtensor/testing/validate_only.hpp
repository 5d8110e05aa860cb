#pragma once
// A program's launch check: `scripts/gpu_check.sh --dry-run` runs the GPU check's real command lines (the
// launcher's flags, each program's arguments and environment) on a machine without a GPU, with
// DTENSOR_GPU_CHECK_VALIDATE=1. A program that honours it checks its command line and its launch
// environment as its real run would, says what it would run, and exits before touching CUDA or NCCL:
// 0 when the run could start, 2 (a usage error) when it could not.
//
//   const Options o = parse(argc, argv);                   // exits 2 on a bad flag
//   if (dtensor::testing::validate_only()) {
//     return dtensor::testing::validated("nccl_suite", "mode " + mode + " on 2 ranks");
//   }

#include <cstdio>
#include <cstdlib>
#include <string>

namespace dtensor::testing {

/// True when DTENSOR_GPU_CHECK_VALIDATE is set to anything but "" or "0".
inline bool validate_only() {
  const char* v = std::getenv("DTENSOR_GPU_CHECK_VALIDATE");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

/// Prints "<program>: valid: <what>" and returns 0 (main's status).
inline int validated(const std::string& program, const std::string& what) {
  std::printf("%s: valid: %s\n", program.c_str(), what.c_str());
  std::fflush(stdout);
  return 0;
}

/// Prints "<program>: invalid: <why>" to stderr and returns 2 (main's status).
inline int invalid(const std::string& program, const std::string& why) {
  std::fprintf(stderr, "%s: invalid: %s\n", program.c_str(), why.c_str());
  return 2;
}

} // namespace dtensor::testing
