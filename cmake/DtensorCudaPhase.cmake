# The programs nvcc compiles (the CUDA tests, nccl_suite, example_06_train_cuda, bench_redistribution_cuda, the
# two-TU link test): one target builds them all, dtensor_cuda_programs. With DTENSOR_CUDA_IN_ALL OFF (the test
# preset's setting) they are left out of `all`: the test command builds and runs the host tests, and CI compiles
# the nvcc programs in a phase of its own after it (build preset `cuda`, then `ctest --preset cuda`: the tests
# labelled nvcc, which skip without a GPU, and the GPU check's dry run over those programs). On 2 cores the nvcc
# translation units were a seventh of the test build's compile time, for tests that cannot run there.
#
# dtensor_cuda_phase(): call at the end of the top-level CMakeLists, after every add_subdirectory.

option(DTENSOR_CUDA_IN_ALL "Build the programs nvcc compiles as part of `all`" ON)

function(dtensor_collect_targets dir out)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    dtensor_collect_targets(${sub} more)
    list(APPEND targets ${more})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(dtensor_cuda_phase)
  add_custom_target(dtensor_cuda_programs)
  if(NOT DTENSOR_HAS_CUDA_LANGUAGE)
    return()
  endif()
  dtensor_collect_targets(${PROJECT_SOURCE_DIR} targets)
  # Targets with a .cu source, then the executables made of their objects ($<TARGET_OBJECTS:...>).
  set(cuda)
  foreach(t IN LISTS targets)
    get_target_property(sources ${t} SOURCES)
    if(sources MATCHES "\\.cu(;|$)")
      list(APPEND cuda ${t})
    endif()
  endforeach()
  foreach(t IN LISTS targets)
    get_target_property(sources ${t} SOURCES)
    foreach(c IN LISTS cuda)
      if(sources MATCHES "\\$<TARGET_OBJECTS:${c}>")
        list(APPEND cuda ${t})
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES cuda)
  foreach(t IN LISTS cuda)
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "EXECUTABLE")
      add_dependencies(dtensor_cuda_programs ${t})
    endif()
    if(NOT DTENSOR_CUDA_IN_ALL)
      set_target_properties(${t} PROPERTIES EXCLUDE_FROM_ALL ON)
    endif()
  endforeach()
endfunction()
