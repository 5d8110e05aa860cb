# Compiles SOURCE with -DCASE_<CASE> (syntax only). With CASE empty the compile must succeed; otherwise it
# must fail, and its first error must match REGEX: the first line of the compiler's output that contains
# ": error:" or ": fatal error:" (GCC and Clang: "file:line:col: error: static assertion failed: <message>";
# a source line the compiler quotes, with "internal error: ..." in a string, is not one). The "In
# instantiation of" and "required from" lines before it are context, and the errors after it do not count:
# a case pins the message a user reads first (so a case compiles with -Wfatal-errors: nothing after it).
#
# PCH (optional): a header holding SOURCE's preprocessor lines before its cases, precompiled next to it
# (PCH.gch, same flags); the compile starts from it (-include), unless a header under INCLUDE is newer than
# the .gch (not rebuilt yet: GCC does not check), then it compiles the headers from source as before. A .gch
# GCC would skip (other flags or macros) is an error (-Werror=invalid-pch), not a silent slow compile.
set(args -std=c++20 -fsyntax-only -I${INCLUDE} ${SOURCE})
if(PCH AND EXISTS ${PCH}.gch)
  file(GLOB_RECURSE headers ${INCLUDE}/*.hpp ${INCLUDE}/*.cuh)
  set(fresh TRUE)
  foreach(h IN LISTS headers)
    if("${h}" IS_NEWER_THAN "${PCH}.gch") # quoted: if() reads a bare h as a file named h
      set(fresh FALSE)
      message(STATUS "${h} is newer than ${PCH}.gch: compiling without it (build the tests to refresh it)")
      break()
    endif()
  endforeach()
  if(fresh)
    list(PREPEND args -include ${PCH} -Werror=invalid-pch)
  endif()
endif()
if(CASE)
  # -Wfatal-errors: the compile stops at the first error, the one a case pins (the instantiation context
  # before it is still printed); the cascade after it would cost time and is not read.
  list(APPEND args -DCASE_${CASE} -Wfatal-errors)
endif()
execute_process(COMMAND ${COMPILER} ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT CASE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "control compile of ${SOURCE} failed:\n${out}")
  endif()
  return()
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "case ${CASE} of ${SOURCE} compiled, but it must not")
endif()
string(REGEX MATCH "[^\n]*: (fatal )?error:[^\n]*" first_error "${out}")
if(first_error STREQUAL "")
  message(FATAL_ERROR "case ${CASE} failed to compile, but printed no error line:\n${out}")
endif()
if(NOT first_error MATCHES "${REGEX}")
  message(FATAL_ERROR "case ${CASE}: the first error does not match '${REGEX}':\n${first_error}\n\n"
                      "The whole output:\n${out}")
endif()
string(REGEX MATCHALL ": (fatal )?error:" errors "${out}")
list(LENGTH errors count)
message(STATUS "case ${CASE}: failed as expected, ${count} error(s), the first: ${first_error}")
