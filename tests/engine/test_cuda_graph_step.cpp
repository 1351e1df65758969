// CudaGraphStep off the GPU: on a CPU device (or a build without CUDA) every call runs the step eagerly, returns
// what the function returns, counts eager calls and says why graphs are off; bad options are refused. The GPU
// behaviour (capture, replay, fallback on a new shape) is tested in tests/cuda/test_cuda_graph_cuda.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "bmt/core/error.h"
#include "bmt/engine/cuda_graph_step.h"

namespace {

TEST(CudaGraphStep, RunsEagerlyOnCpuAndSaysWhy) {
  int calls = 0;
  bmt::CudaGraphStep step([&](const std::vector<at::Tensor>& in) {
    ++calls;
    return std::vector<at::Tensor>{in[0] * 2, in[0].sum()};
  });
  for (int i = 0; i < 5; ++i) {
    at::Tensor x = at::arange(4 + i, at::kFloat);  // a new shape every call: eager regardless
    std::vector<at::Tensor> out = step({x}, /*key=*/i);
    ASSERT_EQ(out.size(), 2u);
    EXPECT_TRUE(at::equal(out[0], x * 2));
    EXPECT_EQ(out[1].item<float>(), x.sum().item<float>());
    EXPECT_EQ(step.last_mode(), "eager");
  }
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(step.num_eager(), 5);
  EXPECT_EQ(step.num_captures(), 0);
  EXPECT_EQ(step.num_replays(), 0);
  EXPECT_FALSE(step.captured());
  EXPECT_NE(step.disabled_reason().find("not CUDA"), std::string::npos) << step.disabled_reason();
  EXPECT_FALSE(bmt::current_stream_capturing(c10::Device(c10::kCPU)));
}

TEST(CudaGraphStep, RefusesAnEmptyFunctionAndNoWarmUp) {
  EXPECT_THROW(bmt::CudaGraphStep(bmt::GraphStepFn{}), bmt::core::Error);
  bmt::CudaGraphOptions o;
  o.warmup_steps = 0;
  EXPECT_THROW(bmt::CudaGraphStep([](const std::vector<at::Tensor>& in) { return in; }, o), bmt::core::Error);
}

}  // namespace
