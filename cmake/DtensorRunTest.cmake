# dtensor_add_multiprocess_test: a ctest that runs a program as N processes under dtensor-run.
#
#   include(DtensorRunTest)
#   dtensor_add_multiprocess_test(NAME run/allreduce_4 NPROC 4 PROGRAM my_test_target ARGS --size 8
#                                 [BACKEND gloo] [LAUNCHER_ARGS --tee 0] [TIMEOUT 60]
#                                 [ENVIRONMENT VAR=value ...] [LABELS ...])
#
# PROGRAM is a target name (its file is used) or a path. The ranks run on this machine on a free port
# (dtensor-run --standalone), so such tests may run in parallel. The test passes when every rank exits 0,
# is skipped when a rank exits with DTENSOR_SKIP_CODE (77; e.g. no GPU), and fails otherwise; dtensor-run
# names the failed rank. PROCESSORS is set to N so `ctest -j` does not oversubscribe the machine.
# BACKEND is dtensor-run's --backend (the ranks' DTENSOR_BACKEND; mpi starts them through mpirun). Without it,
# dtensor-run's default: a program that links MPI runs through mpirun on MPI (one machine, no GPU), any
# other on the backend the ranks pick; give BACKEND where a test is about one backend.
# Needs the dtensor-run target (add_subdirectory(tools/dtensor-run), done by dtensor's top-level CMakeLists).

set(DTENSOR_MULTIPROCESS_SKIP_CODE 77 CACHE STRING "Exit code of a rank that skips its test")
mark_as_advanced(DTENSOR_MULTIPROCESS_SKIP_CODE)

function(dtensor_add_multiprocess_test)
  cmake_parse_arguments(ARG "" "NAME;NPROC;PROGRAM;TIMEOUT;BACKEND" "ARGS;LAUNCHER_ARGS;ENVIRONMENT;LABELS" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_NPROC OR NOT ARG_PROGRAM)
    message(FATAL_ERROR "dtensor_add_multiprocess_test: NAME, NPROC and PROGRAM are required")
  endif()
  if(NOT TARGET dtensor-run)
    message(FATAL_ERROR "dtensor_add_multiprocess_test(${ARG_NAME}): the dtensor-run target does not exist")
  endif()
  if(TARGET ${ARG_PROGRAM})
    set(program $<TARGET_FILE:${ARG_PROGRAM}>)
  else()
    set(program ${ARG_PROGRAM})
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  if(ARG_BACKEND)
    list(PREPEND ARG_LAUNCHER_ARGS --backend ${ARG_BACKEND})
  endif()
  add_test(NAME ${ARG_NAME}
           COMMAND $<TARGET_FILE:dtensor-run> --standalone --nproc-per-node ${ARG_NPROC} --stop-timeout 5
                   ${ARG_LAUNCHER_ARGS} ${program} ${ARG_ARGS})
  set_tests_properties(${ARG_NAME} PROPERTIES TIMEOUT ${ARG_TIMEOUT} PROCESSORS ${ARG_NPROC}
                       SKIP_RETURN_CODE ${DTENSOR_MULTIPROCESS_SKIP_CODE})
  if(ARG_ENVIRONMENT)
    set_tests_properties(${ARG_NAME} PROPERTIES ENVIRONMENT "${ARG_ENVIRONMENT}")
  endif()
  if(ARG_LABELS)
    set_tests_properties(${ARG_NAME} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
endfunction()
