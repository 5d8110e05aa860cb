# Fails when a file has more lines than allowed (ctest's docs/readme_length: the README is a front door).
#   cmake -DFILE=README.md -DMAX=260 -P scripts/check_line_count.cmake
foreach(var FILE MAX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "usage: cmake -DFILE=path -DMAX=lines -P check_line_count.cmake (${var} not set)")
  endif()
endforeach()
file(READ "${FILE}" text)
string(REGEX MATCHALL "\n" newlines "${text}")
list(LENGTH newlines lines) # as wc -l counts them
if(lines GREATER MAX)
  message(FATAL_ERROR "${FILE} has ${lines} lines, more than ${MAX}: move the detail to docs/ (a timing log to "
                      "docs/testing.md or docs/changelog.md, a tool's manual to its layer's page) and link it")
endif()
message(STATUS "${FILE}: ${lines} lines (at most ${MAX})")
