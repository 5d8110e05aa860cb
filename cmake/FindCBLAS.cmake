# FindCBLAS: locates a BLAS with its C interface (cblas.h), OpenBLAS unless BLA_VENDOR says otherwise.
#
# The library comes from CMake's FindBLAS (BLA_VENDOR defaults to OpenBLAS here: dtensor is built and
# tested against Debian's libopenblas-dev). The header is looked for next to it: Debian installs
# OpenBLAS's cblas.h under /usr/include/<multiarch>/openblas-<threading>/, outside the default include
# path. Defines CBLAS_FOUND, CBLAS_INCLUDE_DIR and the imported target CBLAS::CBLAS.

if(NOT DEFINED BLA_VENDOR)
  set(BLA_VENDOR OpenBLAS)
endif()
find_package(BLAS QUIET)
find_path(CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-pthread openblas openblas-openmp openblas-serial)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CBLAS REQUIRED_VARS BLAS_LIBRARIES CBLAS_INCLUDE_DIR)

if(CBLAS_FOUND AND NOT TARGET CBLAS::CBLAS)
  add_library(CBLAS::CBLAS INTERFACE IMPORTED)
  set_target_properties(CBLAS::CBLAS PROPERTIES INTERFACE_LINK_LIBRARIES BLAS::BLAS
                                                INTERFACE_INCLUDE_DIRECTORIES ${CBLAS_INCLUDE_DIR})
endif()
mark_as_advanced(CBLAS_INCLUDE_DIR)
