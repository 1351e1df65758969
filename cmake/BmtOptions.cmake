# Every BMT_* option in one place.
set(BMT_WITH_CUDA "AUTO" CACHE STRING "Build CUDA kernels and the NCCL backend: AUTO (when torch has CUDA and nvcc exists), ON or OFF")
set_property(CACHE BMT_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(BMT_CUDA_ARCHITECTURES "90" CACHE STRING "CUDA architectures for bmtrain's kernels (90 = Hopper)")
option(BUILD_TESTING "Build the GoogleTest suites" ON)
option(BMT_BUILD_EXAMPLES "Build the example models and train_gpt" ON)
option(BMT_BUILD_BENCHMARKS "Build bench/ programs" ON)
option(BMT_WARNINGS_AS_ERRORS "Treat compiler warnings as errors" OFF)
set(BMT_GTEST_SOURCE_DIR "" CACHE PATH "GoogleTest source tree to build when no installed GTest is found")
