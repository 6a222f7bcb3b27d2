# Finds xxHash (Debian: libxxhash-dev), whose XXH3-64 digests checkpoints of
# format 3 (docs/file_format.md). Defines the imported target xxHash::xxhash,
# XXHash_FOUND and XXHash_VERSION; pkg-config, when present, supplies hints.
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_XXHASH QUIET libxxhash)
endif()
find_path(XXHash_INCLUDE_DIR NAMES xxhash.h HINTS ${PC_XXHASH_INCLUDE_DIRS})
find_library(XXHash_LIBRARY NAMES xxhash HINTS ${PC_XXHASH_LIBRARY_DIRS})
if(XXHash_INCLUDE_DIR AND EXISTS "${XXHash_INCLUDE_DIR}/xxhash.h")
  file(STRINGS "${XXHash_INCLUDE_DIR}/xxhash.h" _xxh_lines REGEX "^#define XXH_VERSION_(MAJOR|MINOR|RELEASE) +[0-9]+")
  foreach(part MAJOR MINOR RELEASE)
    string(REGEX REPLACE ".*#define XXH_VERSION_${part} +([0-9]+).*" "\\1" _xxh_${part} "${_xxh_lines}")
  endforeach()
  set(XXHash_VERSION "${_xxh_MAJOR}.${_xxh_MINOR}.${_xxh_RELEASE}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(XXHash REQUIRED_VARS XXHash_LIBRARY XXHash_INCLUDE_DIR
                                  VERSION_VAR XXHash_VERSION)
if(XXHash_FOUND AND NOT TARGET xxHash::xxhash)
  add_library(xxHash::xxhash UNKNOWN IMPORTED)
  set_target_properties(xxHash::xxhash PROPERTIES IMPORTED_LOCATION "${XXHash_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${XXHash_INCLUDE_DIR}")
endif()
mark_as_advanced(XXHash_INCLUDE_DIR XXHash_LIBRARY)
