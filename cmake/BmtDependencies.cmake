# Finds LibTorch (from the pip package), CUDA + NCCL (optional) and GoogleTest, with clear errors.
# Needs no system package beyond a C++ compiler: gloo's and nlohmann-json's headers are carried in third_party/
# (docs/design.md, "Dependencies"), GoogleTest only for BUILD_TESTING.
find_package(Python3 COMPONENTS Interpreter REQUIRED OPTIONAL_COMPONENTS Development.Module)

# BMT_TORCH_PYTHON: the command that imports the torch bmtrain will run with. pip's build isolation (plain
# `pip install .`) hides the installed packages behind a PYTHONPATH sitecustomize; the same interpreter with -E
# (PYTHON* variables ignored) sees the environment pip was started from, so the build uses that torch instead of
# downloading another one (pyproject.toml does not list torch as a build requirement for that reason).
execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch" RESULT_VARIABLE _bmt_rc OUTPUT_QUIET ERROR_QUIET)
if(_bmt_rc EQUAL 0)
  set(BMT_TORCH_PYTHON ${Python3_EXECUTABLE})
else()
  execute_process(COMMAND ${Python3_EXECUTABLE} -E -c "import torch" RESULT_VARIABLE _bmt_rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT _bmt_rc EQUAL 0)
    message(FATAL_ERROR "bmtrain: cannot import torch with ${Python3_EXECUTABLE} (nor with -E, outside pip's build "
                        "isolation). Install torch into that environment first (pip install torch==2.11.0; "
                        "scripts/setup.sh does), or, for a build frontend that makes its own virtual environment "
                        "(python -m build, uv), build without isolation: python -m build --no-isolation, "
                        "pip install --no-build-isolation .")
  endif()
  set(BMT_TORCH_PYTHON ${Python3_EXECUTABLE} -E)
  message(STATUS "bmtrain: torch taken from the environment outside the build isolation (${Python3_EXECUTABLE} -E)")
endif()
if(NOT Torch_DIR)
  execute_process(COMMAND ${BMT_TORCH_PYTHON} -c "import torch; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _bmt_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE)
  list(APPEND CMAKE_PREFIX_PATH ${_bmt_torch_prefix})
endif()
execute_process(COMMAND ${BMT_TORCH_PYTHON} -c "import torch; print(int(torch.version.cuda is not None))"
                OUTPUT_VARIABLE BMT_TORCH_HAS_CUDA OUTPUT_STRIP_TRAILING_WHITESPACE)
# site-packages holding torch (and, in a CUDA torch's environment, the nvidia-* wheels it loads).
execute_process(COMMAND ${BMT_TORCH_PYTHON} -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"
                OUTPUT_VARIABLE BMT_TORCH_SITE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)

# Decide CUDA before find_package(Torch): a CUDA torch needs the toolkit to be found either way.
find_program(BMT_NVCC nvcc HINTS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
if(BMT_WITH_CUDA STREQUAL "AUTO")
  if(BMT_TORCH_HAS_CUDA AND BMT_NVCC)
    set(BMT_CUDA ON)
  else()
    set(BMT_CUDA OFF)
  endif()
elseif(BMT_WITH_CUDA)
  if(NOT BMT_TORCH_HAS_CUDA)
    message(FATAL_ERROR "bmtrain: BMT_WITH_CUDA=ON but the torch found by ${Python3_EXECUTABLE} is a CPU-only build. Install a CUDA torch (pip install torch==2.11.0) or configure with -DBMT_WITH_CUDA=OFF.")
  endif()
  if(NOT BMT_NVCC)
    message(FATAL_ERROR "bmtrain: BMT_WITH_CUDA=ON but nvcc was not found. Install the CUDA toolkit (put nvcc on PATH or set CUDA_HOME) or configure with -DBMT_WITH_CUDA=OFF.")
  endif()
  set(BMT_CUDA ON)
else()
  set(BMT_CUDA OFF)
endif()

if(BMT_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${BMT_NVCC})
  endif()
  set(CMAKE_CUDA_ARCHITECTURES ${BMT_CUDA_ARCHITECTURES})
  # The shared CUDA runtime, the one torch loads: the static one (CMake's default) put a second runtime, with its
  # own copies of C++ runtime internals, into libbmtrain, which crashed inside Python (iostreams in init_distributed).
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # One NCCL per process: prefer the pip package torch itself loads, then the toolkit's.
  execute_process(COMMAND ${BMT_TORCH_PYTHON} -c "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])"
                  OUTPUT_VARIABLE _bmt_pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_bmt_pip_nccl}/include ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_path(NCCL_INCLUDE_DIR nccl.h)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_bmt_pip_nccl}/lib ENV NCCL_ROOT ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "bmtrain: CUDA is enabled but NCCL was not found (nccl.h: ${NCCL_INCLUDE_DIR}, libnccl: ${NCCL_LIBRARY}). pip install nvidia-nccl-cu13, set NCCL_ROOT, or configure with -DBMT_WITH_CUDA=OFF.")
  endif()
  # cuBLASLt (the fused-epilogue GEMMs): the copy torch loads (its pip wheel's nvidia libraries), else the toolkit's.
  find_library(BMT_CUBLASLT_LIBRARY NAMES libcublasLt.so.13 libcublasLt.so.12 cublasLt
               HINTS ${BMT_TORCH_SITE_DIR}/nvidia/cu13/lib ${BMT_TORCH_SITE_DIR}/nvidia/cublas/lib NO_DEFAULT_PATH)
  if(NOT BMT_CUBLASLT_LIBRARY)
    set(BMT_CUBLASLT_LIBRARY CUDA::cublasLt)
  endif()
  add_library(bmt_cublaslt INTERFACE)
  target_link_libraries(bmt_cublaslt INTERFACE ${BMT_CUBLASLT_LIBRARY})
  message(STATUS "bmtrain: cuBLASLt ${BMT_CUBLASLT_LIBRARY}")
  add_library(bmt_nccl INTERFACE)
  target_include_directories(bmt_nccl INTERFACE ${NCCL_INCLUDE_DIR})
  target_link_libraries(bmt_nccl INTERFACE ${NCCL_LIBRARY})
  message(STATUS "bmtrain: CUDA ON (arch ${CMAKE_CUDA_ARCHITECTURES}), NCCL ${NCCL_LIBRARY}")
else()
  message(STATUS "bmtrain: CUDA OFF (CPU-only build, Gloo backend)")
endif()

if(BMT_CUDA AND NOT TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  # Torch's CMake adds -gencode flags for its own default list (incl. archs nvcc 13 dropped) unless told.
  set(_bmt_arch_list "")
  foreach(_a ${BMT_CUDA_ARCHITECTURES})
    string(REGEX REPLACE "^([0-9]+)([0-9])$" "\\1.\\2" _dotted "${_a}")
    list(APPEND _bmt_arch_list "${_dotted}")
  endforeach()
  set(TORCH_CUDA_ARCH_LIST "${_bmt_arch_list}")
endif()
find_package(Torch REQUIRED)
# TorchConfig adds its flags to CMAKE_CXX_FLAGS for consumers; keep them.
set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")
get_filename_component(BMT_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)

# Header-only dependencies, carried in the repository (third_party/*/README.md says where each comes from).
# gloo: torch's wheel ships c10d's ProcessGroupGloo.hpp but not the gloo headers it includes; these are gloo's own
# headers at the commit torch 2.11 was built with (its symbols come from libtorch_cpu). Another torch may have been
# built with another gloo: say so rather than build silently against mismatched declarations.
set(BMT_GLOO_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/gloo)
set(BMT_GLOO_HEADERS_TORCH "2.11")
if(NOT Torch_VERSION VERSION_GREATER_EQUAL BMT_GLOO_HEADERS_TORCH OR Torch_VERSION VERSION_GREATER_EQUAL 2.12)
  message(WARNING "bmtrain: third_party/gloo holds the gloo headers torch ${BMT_GLOO_HEADERS_TORCH} was built with, "
                  "but torch ${Torch_VERSION} was found; its gloo may differ (class layouts the Gloo communicator "
                  "relies on). Use torch==2.11.* or refresh third_party/gloo (third_party/gloo/README.md says how).")
endif()
# nlohmann-json 3.11.3, the single-header release.
set(BMT_JSON_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/nlohmann_json)

if(BUILD_TESTING)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    set(_bmt_gtest_src "${BMT_GTEST_SOURCE_DIR}")
    if(NOT _bmt_gtest_src AND EXISTS /usr/src/googletest/CMakeLists.txt)
      set(_bmt_gtest_src /usr/src/googletest)
    endif()
    if(NOT _bmt_gtest_src)
      message(FATAL_ERROR "bmtrain: GoogleTest not found. apt-get install libgtest-dev, pass -DBMT_GTEST_SOURCE_DIR=<googletest source>, or -DBUILD_TESTING=OFF.")
    endif()
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(${_bmt_gtest_src} ${CMAKE_BINARY_DIR}/_deps/googletest EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  endif()
  include(GoogleTest)
endif()
