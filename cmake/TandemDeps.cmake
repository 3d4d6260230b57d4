# SPDX-License-Identifier: Apache-2.0
# Finds the Debian-packaged dependencies as imported targets (tdm::<name>).
# Nothing is fetched at configure time.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)

pkg_check_modules(CJSON REQUIRED IMPORTED_TARGET libcjson)
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(UTF8PROC REQUIRED IMPORTED_TARGET libutf8proc)
pkg_check_modules(CMOCKA REQUIRED IMPORTED_TARGET cmocka)

# civetweb: Debian's CMake package config also wants the civetweb server binary
# (another package), so the library is found directly as civetweb::civetweb.
find_path(CIVETWEB_INCLUDE_DIR civetweb.h REQUIRED)
find_library(CIVETWEB_LIBRARY civetweb REQUIRED)
add_library(civetweb::civetweb UNKNOWN IMPORTED)
set_target_properties(civetweb::civetweb PROPERTIES
  IMPORTED_LOCATION "${CIVETWEB_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${CIVETWEB_INCLUDE_DIR}")

add_library(tdm::cjson ALIAS PkgConfig::CJSON)
add_library(tdm::pcre2 ALIAS PkgConfig::PCRE2)
add_library(tdm::utf8proc ALIAS PkgConfig::UTF8PROC)
add_library(tdm::cmocka ALIAS PkgConfig::CMOCKA)

# The independent model reference runs on Debian's python3 with python3-numpy.
find_program(TANDEM_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT TANDEM_PYTHON3)
  find_program(TANDEM_PYTHON3 NAMES python3)
endif()
