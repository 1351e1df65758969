// accumulate_fp32_cuda (dst += src into fp32) against its CPU twin, bit for bit: every source dtype, aligned and
// misaligned pointers, lengths with and without a tail (the twin itself: tests/core/test_accumulate.cpp).
#include <gtest/gtest.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/accumulate_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;

TEST(CudaAccumulate, MatchesCpuTwinBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{1000}, int64_t{(1 << 20) + 13}}) {
      for (int64_t offset : {int64_t{0}, int64_t{1}}) {  // offset 1: neither pointer 16-byte aligned
        SCOPED_TRACE(std::string(c10::toString(st)) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        at::Tensor dst = at::randn({n + offset}), src = (at::randn({n + offset}) * 3).to(st);
        at::Tensor dst_gpu = dst.cuda(), src_gpu = src.cuda();
        k::accumulate_fp32_cpu(dst.data_ptr<float>() + offset, static_cast<char*>(src.data_ptr()) + offset * src.element_size(),
                               bmt::to_core_dtype(st), n);
        k::accumulate_fp32_cuda(dst_gpu.data_ptr<float>() + offset,
                                static_cast<char*>(src_gpu.data_ptr()) + offset * src.element_size(), bmt::to_core_dtype(st),
                                n, c10::cuda::getCurrentCUDAStream().stream());
        EXPECT_TRUE(at::equal(dst, dst_gpu.cpu()));
      }
    }
  }
}
