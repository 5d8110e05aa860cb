# FindNCCL: locates NCCL's header and library.
#
# Looks, in order, in NCCL_ROOT (CMake or environment variable), in the CUDA Toolkit
# (/usr/local/cuda or CUDAToolkit_ROOT), and in the nvidia/nccl folder of the Python site-packages
# (the nvidia-nccl-cu* wheels). Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION and the
# imported target NCCL::NCCL.

set(_nccl_hints)
if(DEFINED NCCL_ROOT)
  list(APPEND _nccl_hints ${NCCL_ROOT})
endif()
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _nccl_hints $ENV{NCCL_ROOT})
endif()
if(DEFINED CUDAToolkit_ROOT)
  list(APPEND _nccl_hints ${CUDAToolkit_ROOT})
endif()
list(APPEND _nccl_hints /usr/local/cuda)

find_package(Python3 QUIET COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
            "import site,sys; print(';'.join(site.getsitepackages() + [site.getusersitepackages()]))"
    OUTPUT_VARIABLE _nccl_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  foreach(_dir IN LISTS _nccl_site)
    if(EXISTS ${_dir}/nvidia/nccl)
      list(APPEND _nccl_hints ${_dir}/nvidia/nccl)
    endif()
  endforeach()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS ${NCCL_INCLUDE_DIR}/nccl.h)
  file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" _major "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" _minor "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_PATCH ([0-9]+).*" "\\1" _patch "${_nccl_ver}")
  set(NCCL_VERSION "${_major}.${_minor}.${_patch}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                                              INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
