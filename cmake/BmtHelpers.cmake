function(bmt_set_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  if(BMT_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

# bmt_test_timeout(<out var> <seconds>): a test's timeout times BMT_TEST_TIMEOUT_SCALE (an instrumented build,
# e.g. under sanitizers, runs slower; scripts/sanitize_check.sh sets it).
function(bmt_test_timeout out seconds)
  math(EXPR _t "${seconds} * ${BMT_TEST_TIMEOUT_SCALE}")
  set(${out} ${_t} PARENT_SCOPE)
endfunction()

# bmt_add_test(NAME name SOURCES a.cpp ... LABELS cpu|multirank|cuda [TIMEOUT s] [PROCESSORS n] [RUN_SERIAL])
# One gtest binary; each TEST becomes a CTest test carrying the labels.
function(bmt_add_test)
  cmake_parse_arguments(T "RUN_SERIAL" "NAME;TIMEOUT;PROCESSORS" "SOURCES;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  bmt_test_timeout(T_TIMEOUT ${T_TIMEOUT})
  if(NOT T_SOURCES)
    return()
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  set_target_properties(${T_NAME} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_link_libraries(${T_NAME} PRIVATE bmt bmt_test_support GTest::gtest GTest::gtest_main)
  target_precompile_headers(${T_NAME} REUSE_FROM bmt_test_support)
  bmt_set_warnings(${T_NAME})
  # gtest_discover_tests flattens list-valued properties (and the pairs after them): one label per binary.
  list(GET T_LABELS 0 _label)
  # PROCESSORS: the most ranks one test of the binary starts (ctest -j counts each rank as a job slot; CTest runs
  # a test whose PROCESSORS exceed -j alone). RUN_SERIAL: tests that measure time.
  set(_props LABELS ${_label} TIMEOUT ${T_TIMEOUT})
  if(T_PROCESSORS)
    list(APPEND _props PROCESSORS ${T_PROCESSORS})
  endif()
  if(T_RUN_SERIAL)
    list(APPEND _props RUN_SERIAL TRUE)
  endif()
  gtest_discover_tests(${T_NAME} PROPERTIES ${_props} DISCOVERY_TIMEOUT 120)
endfunction()

# A skipped test must show as Skipped, not Passed (scripts/check_skips.py fails CI on any skip that
# tests/allowed_skips.txt does not allow): gtest's "[  SKIPPED ]" (gtest_discover_tests sets it itself) and pytest's
# "N skipped" summary.
set(BMT_GTEST_SKIP_REGEX "\\[  SKIPPED \\]")
set(BMT_PYTEST_SKIP_REGEX "[0-9]+ skipped")

# bmt_add_pytest(NAME name FILE test_x.py LABELS cpu|multirank [TIMEOUT s] [PROCESSORS n] [ENVIRONMENT VAR=v ...])
# One pytest file as one CTest test (timeout scaled as bmt_add_test's; pytest's skips show as Skipped).
function(bmt_add_pytest)
  cmake_parse_arguments(T "" "NAME;FILE;TIMEOUT;PROCESSORS" "LABELS;ENVIRONMENT" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  bmt_test_timeout(T_TIMEOUT ${T_TIMEOUT})
  add_test(NAME ${T_NAME} COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider ${T_FILE})
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       SKIP_REGULAR_EXPRESSION "${BMT_PYTEST_SKIP_REGEX}")
  if(T_PROCESSORS)
    set_tests_properties(${T_NAME} PROPERTIES PROCESSORS ${T_PROCESSORS})
  endif()
  if(T_ENVIRONMENT)
    set_tests_properties(${T_NAME} PROPERTIES ENVIRONMENT "${T_ENVIRONMENT}")
  endif()
endfunction()
