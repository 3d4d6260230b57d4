# SPDX-License-Identifier: Apache-2.0
# tdm_module(name SOURCES ... [DEPS ...])  - one static library per module, its folder public.
# tdm_test(name SOURCES ... [DEPS ...] [LABELS ...] [ARGS ...] [SPLIT fn ...]) - a cmocka test run by ctest.
function(tdm_module name)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS" ${ARGN})
  add_library(tdm_${name} STATIC ${M_SOURCES})
  target_include_directories(tdm_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
  if(M_DEPS)
    target_link_libraries(tdm_${name} PUBLIC ${M_DEPS})
  endif()
endfunction()

# tdm_test(name SOURCES ... DEPS ... [LABELS ...] [ARGS ...] [SPLIT test_fn ...]):
# a cmocka test binary as a ctest. A test that skips (TDM_SKIP, test_skip.h)
# makes the binary exit 77, which ctest reports as skipped (SKIP_RETURN_CODE),
# never as passed. SPLIT names test functions that each become a ctest of
# their own, name.fn (--only fn), the binary's main ctest running the rest
# (--skip fn): those that depend on the host (an ISA's kernels, label
# host-isa: a host without that ISA skips those alone), and long cases, so
# that ctest -j balances.
function(tdm_test name)
  cmake_parse_arguments(T "" "" "SOURCES;DEPS;LABELS;ARGS;SPLIT" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_DEPS} tdm::cmocka)
  target_compile_definitions(${name} PRIVATE
    TANDEM_SHARED_DIR="${TANDEM_SHARED_DIR}"
    TANDEM_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    TANDEM_BINARY_DIR="${PROJECT_BINARY_DIR}")
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  set(skips "")
  foreach(fn ${T_SPLIT})
    add_test(NAME ${name}.${fn} COMMAND ${name} ${T_ARGS} --only ${fn})
    set_tests_properties(${name}.${fn} PROPERTIES LABELS "${T_LABELS}" TIMEOUT 600
                         SKIP_RETURN_CODE 77)
    list(APPEND skips --skip ${fn})
  endforeach()
  add_test(NAME ${name} COMMAND ${name} ${T_ARGS} ${skips})
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}" TIMEOUT 600 SKIP_RETURN_CODE 77)
endfunction()
