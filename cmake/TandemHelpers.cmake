# SPDX-License-Identifier: Apache-2.0
# tdm_module(name SOURCES ... [DEPS ...])  - one static library per module, its folder public.
# tdm_test(name SOURCES ... [DEPS ...] [LABELS ...] [ARGS ...]) - a cmocka test run by ctest.
function(tdm_module name)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS" ${ARGN})
  add_library(tdm_${name} STATIC ${M_SOURCES})
  target_include_directories(tdm_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
  if(M_DEPS)
    target_link_libraries(tdm_${name} PUBLIC ${M_DEPS})
  endif()
endfunction()

function(tdm_test name)
  cmake_parse_arguments(T "" "" "SOURCES;DEPS;LABELS;ARGS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_DEPS} tdm::cmocka)
  target_compile_definitions(${name} PRIVATE
    TANDEM_SHARED_DIR="${TANDEM_SHARED_DIR}"
    TANDEM_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    TANDEM_BINARY_DIR="${PROJECT_BINARY_DIR}")
  add_test(NAME ${name} COMMAND ${name} ${T_ARGS})
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  # cmocka's skip() makes the test print SKIPPED and exit 0; ctest reports it as passed.
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}" TIMEOUT 600)
endfunction()
