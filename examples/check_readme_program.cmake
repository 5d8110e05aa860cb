# Checks that README.md shows the first program as it is (examples/first_program/).
#
#   cmake -DREADME=README.md -DDIR=examples/first_program -P examples/check_readme_program.cmake
#   cmake -DREADME=README.md -DDIR=examples/first_program -DLAUNCHER=dtensor-run -DPROGRAM=prog -P ...
#
# A fenced block in README.md follows each marker line:
#   <!-- first-program:main.cpp -->        must equal DIR/main.cpp byte for byte
#   <!-- first-program:CMakeLists.txt -->  must equal DIR/CMakeLists.txt byte for byte
#   <!-- first-program:output -->          with LAUNCHER and PROGRAM: what `LAUNCHER --standalone --tee 0
#                                          --nproc-per-node 4 PROGRAM` writes to stdout, exactly
# ALSO (optional, a list): other pages that show the output under the same marker; their block must equal
# README.md's.
# A block is the text between its opening fence line and its closing fence, newlines included. The script
# fails naming the block that differs, and prints both versions.
foreach(var README DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_readme_program: -D${var}=... is required")
  endif()
endforeach()
file(READ ${README} readme)

# The fenced block after the marker line `<!-- first-program:NAME -->` in README.md (or in the text of
# `page`, named `page_name`), into `out`.
function(readme_block name out)
  set(text "${readme}")
  set(file "${README}")
  if(ARGC GREATER 2)
    set(text "${ARGV2}")
    set(file "${ARGV3}")
  endif()
  set(marker "<!-- first-program:${name} -->\n")
  string(FIND "${text}" "${marker}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check_readme_program: ${file} has no line `<!-- first-program:${name} -->`")
  endif()
  string(LENGTH "${marker}" n)
  math(EXPR at "${at} + ${n}")
  string(SUBSTRING "${text}" ${at} -1 rest)
  if(NOT rest MATCHES "^```[^\n]*\n")
    message(FATAL_ERROR "check_readme_program: the line after `<!-- first-program:${name} -->` is not a fence")
  endif()
  string(LENGTH "${CMAKE_MATCH_0}" n)
  string(SUBSTRING "${rest}" ${n} -1 rest)
  if(rest MATCHES "^```")  # an empty block
    set(${out} "" PARENT_SCOPE)
    return()
  endif()
  string(FIND "${rest}" "\n```" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "check_readme_program: the block after `<!-- first-program:${name} -->` is not closed")
  endif()
  math(EXPR end "${end} + 1")
  string(SUBSTRING "${rest}" 0 ${end} block)
  set(${out} "${block}" PARENT_SCOPE)
endfunction()

function(expect_equal what expected actual)
  if(NOT "${expected}" STREQUAL "${actual}")
    message(NOTICE "--- README.md:\n${expected}--- actual:\n${actual}---")  # printed as it is
    message(FATAL_ERROR "check_readme_program: ${what} differ (both above)")
  endif()
  message(STATUS "${what}: identical")
endfunction()

foreach(page IN LISTS ALSO)
  file(READ ${page} page_text)
  readme_block(output shown)
  readme_block(output also "${page_text}" ${page})
  expect_equal("README's output block and ${page}'s" "${shown}" "${also}")
endforeach()

foreach(file main.cpp CMakeLists.txt)
  readme_block(${file} shown)
  file(READ ${DIR}/${file} real)
  expect_equal("README's ${file} block and ${DIR}/${file}" "${shown}" "${real}")
endforeach()

if(DEFINED LAUNCHER AND DEFINED PROGRAM)
  readme_block(output shown)
  execute_process(COMMAND ${LAUNCHER} --standalone --tee 0 --nproc-per-node 4 ${PROGRAM}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE printed ERROR_VARIABLE errors)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_readme_program: ${PROGRAM} on 4 ranks exited with ${rc}:\n${printed}${errors}")
  endif()
  expect_equal("README's output block and what the program printed on 4 ranks" "${shown}" "${printed}")
endif()
