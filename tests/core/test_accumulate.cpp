// accumulate_fp32_cpu, the CPU twin of the CUDA gradient accumulation kernel, against at::add_ on the same values
// (fp32 / bf16 / fp16 sources, inf and an fp16 subnormal included) and its argument check.
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <limits>

#include "bmt/core/error.h"
#include "bmt/core/kernels/accumulate_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;

TEST(Accumulate, CpuTwinEqualsTorchAdd) {
  at::manual_seed(4);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor dst = at::randn({1001}), src = (at::randn({1001}) * 100).to(st);
    src[5] = std::numeric_limits<float>::infinity();
    if (st == at::kHalf) src[6] = 1e-7;  // an fp16 subnormal
    at::Tensor expected = dst + src.to(at::kFloat);
    k::accumulate_fp32_cpu(dst.data_ptr<float>(), src.data_ptr(), bmt::to_core_dtype(st), dst.numel());
    EXPECT_TRUE(at::equal(dst, expected)) << c10::toString(st);
  }
  EXPECT_THROW(k::accumulate_fp32_cpu(nullptr, nullptr, bmt::core::DType::kInt64, 1), bmt::core::Error);
}
