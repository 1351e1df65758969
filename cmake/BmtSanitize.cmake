# BMT_SANITIZE: a comma- or semicolon-separated list of sanitizers (address, undefined, leak, thread) compiled and
# linked into every target defined after this point (the library, tools, tests, examples, benchmarks), e.g.
# -DBMT_SANITIZE=address,undefined (scripts/sanitize_check.sh). Undefined behaviour aborts (-fno-sanitize-recover),
# so it fails a test instead of printing a line nobody reads. Global options keep the precompiled headers
# consistent: a PCH is built with the same flags as the objects that use it. libtorch and gloo stay
# uninstrumented (ASan still sees their heap, through the interposed malloc).
set(BMT_SANITIZE "" CACHE STRING "Sanitizers to build with, e.g. address,undefined (empty: none)")
if(NOT BMT_SANITIZE)
  return()
endif()
string(REPLACE "," ";" _bmt_sanitizers "${BMT_SANITIZE}")
set(_bmt_known address undefined leak thread)
foreach(_s ${_bmt_sanitizers})
  if(NOT _s IN_LIST _bmt_known)
    message(FATAL_ERROR "bmtrain: BMT_SANITIZE names an unknown sanitizer '${_s}' (known: address, undefined, leak, "
                        "thread; e.g. -DBMT_SANITIZE=address,undefined, or empty for none).")
  endif()
endforeach()
if("thread" IN_LIST _bmt_sanitizers AND ("address" IN_LIST _bmt_sanitizers OR "leak" IN_LIST _bmt_sanitizers))
  message(FATAL_ERROR "bmtrain: BMT_SANITIZE=${BMT_SANITIZE}: thread cannot be combined with address or leak "
                      "(the compilers reject it); configure a separate build folder for each.")
endif()
string(REPLACE ";" "," _bmt_sanitize_flag "${_bmt_sanitizers}")
# Inside the generator expression below a literal comma must be spelled $<COMMA>.
string(REPLACE ";" "$<COMMA>" _bmt_sanitize_genex "${_bmt_sanitizers}")
set(_bmt_san_flags -fsanitize=${_bmt_sanitize_genex} -fno-omit-frame-pointer)
if("undefined" IN_LIST _bmt_sanitizers)
  list(APPEND _bmt_san_flags -fno-sanitize-recover=undefined)
endif()
# C++ only: nvcc does not take these (a CUDA build with sanitizers instruments the host C++ files only).
add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_bmt_san_flags}>")
add_link_options(-fsanitize=${_bmt_sanitize_flag})
message(STATUS "bmtrain: sanitizers ${_bmt_sanitize_flag} (compile and link, every target)")
