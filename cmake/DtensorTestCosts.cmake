# What ctest knows about dtensor's own tests before their first run here: tests/ctest_costs.txt holds the
# seconds each test took in a test-build run on a 2-core machine, in CTest's cost-data format (scripts/
# test_costs.sh refreshes it from a run).
#
#  - dtensor_seed_test_costs(): copies it to <build>/Testing/Temporary/CTestCostData.txt when that file does
#    not exist yet, so the first `ctest -j2` on a clean clone starts the longest tests first (ctest keeps
#    the file up to date from then on);
#  - dtensor_label_slow_tests(): in the calling directory, appends the label `slow` to every test that took
#    DTENSOR_SLOW_TEST_SECONDS (10) or more. Tests added by add_test get it now; the ones Catch2 discovers
#    when ctest runs (their TEST_PREFIX registered with dtensor_catch_prefix) get it from an include file
#    ctest reads after Catch2's, so call this after the directory's last catch_discover_tests.
#
# Labels of dtensor's tests: gpu (needs a GPU, skips without one), nccl, mpi (under mpirun), compile_fail,
# bench (benchmarks' smoke runs), emulated (the device kernels on the emulated device, docs/local.md), slow.
# `ctest -LE slow` is the quick slice; `ctest -L compile_fail` one kind.

set(DTENSOR_TEST_COSTS_FILE ${PROJECT_SOURCE_DIR}/tests/ctest_costs.txt)
set(DTENSOR_SLOW_TEST_SECONDS 10)

function(dtensor_seed_test_costs)
  set(data ${PROJECT_BINARY_DIR}/Testing/Temporary/CTestCostData.txt)
  if(EXISTS ${DTENSOR_TEST_COSTS_FILE} AND NOT EXISTS ${data})
    file(MAKE_DIRECTORY ${PROJECT_BINARY_DIR}/Testing/Temporary)
    file(COPY_FILE ${DTENSOR_TEST_COSTS_FILE} ${data})
  endif()
endfunction()

# The names of the tests that took DTENSOR_SLOW_TEST_SECONDS or more, into `out`.
function(dtensor_slow_tests out)
  set(names)
  if(EXISTS ${DTENSOR_TEST_COSTS_FILE})
    file(STRINGS ${DTENSOR_TEST_COSTS_FILE} lines)
    foreach(line IN LISTS lines)
      if(line STREQUAL "---")
        break() # the failed tests follow
      endif()
      # "<name> <runs> <average seconds>"; names may hold spaces
      if(line MATCHES "^(.+) [0-9]+ ([0-9.eE+-]+)$")
        set(name ${CMAKE_MATCH_1})
        set(seconds ${CMAKE_MATCH_2})
        if(seconds GREATER_EQUAL DTENSOR_SLOW_TEST_SECONDS)
          list(APPEND names ${name})
        endif()
      endif()
    endforeach()
  endif()
  set(${out} ${names} PARENT_SCOPE)
endfunction()

function(dtensor_label_slow_tests)
  dtensor_slow_tests(slow)
  # The prefixes of the tests Catch2 discovers here ("<layer>/"), registered by dtensor_catch_prefix.
  get_property(prefixes DIRECTORY PROPERTY DTENSOR_CATCH_PREFIXES)
  set(later "# Written by dtensor_label_slow_tests (cmake/DtensorTestCosts.cmake).\n")
  foreach(name IN LISTS slow)
    string(REGEX MATCH "^[^/]*/" prefix "${name}")
    if(TEST ${name})
      set_property(TEST ${name} APPEND PROPERTY LABELS slow)
    elseif(prefix AND prefix IN_LIST prefixes)
      string(APPEND later "set_tests_properties([=[${name}]=] PROPERTIES LABELS slow)\n")
    endif()
  endforeach()
  if(prefixes)
    set(file ${CMAKE_CURRENT_BINARY_DIR}/dtensor_slow_labels.cmake)
    file(WRITE ${file} "${later}")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${file})
  endif()
endfunction()

# Registers a TEST_PREFIX given to catch_discover_tests in this directory.
function(dtensor_catch_prefix prefix)
  set_property(DIRECTORY APPEND PROPERTY DTENSOR_CATCH_PREFIXES ${prefix})
endfunction()
