// CUDA FP8 byte transpose (fp8_cast_internal.h). 64 x 64 byte tiles through shared memory: each thread loads 4
// consecutive bytes of a row (one 4-byte load) and stores 4 consecutive bytes of a transposed row (4 rows of the
// tile gathered into one 4-byte store), so both sides move whole 32-bit words in consecutive threads. Needs rows and
// columns that are multiples of 4 and 4-byte-aligned buffers (every FP8 GEMM operand: multiples of 16); anything else
// takes the element-wise kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {
namespace {

constexpr int kTile = 64, kThreadsX = 16, kThreadsY = 16;

__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    transpose_words_kernel(const uint8_t* __restrict__ q, int64_t rows, int64_t cols, uint8_t* __restrict__ qt) {
  // (+4 bytes a row: the gathering reads of one column fall in different banks)
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int r = ty; r < kTile; r += kThreadsY) {
    const int64_t gr = r0 + r, gc = c0 + 4 * tx;
    if (gr < rows && gc < cols) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(q + gr * cols + gc);
#pragma unroll
      for (int i = 0; i < 4; ++i) tile[r][4 * tx + i] = static_cast<uint8_t>(w >> (8 * i));
    }
  }
  __syncthreads();
  for (int c = ty; c < kTile; c += kThreadsY) {  // row c of the transposed tile: column c0 + c of q
    const int64_t gc = c0 + c, gr = r0 + 4 * tx;
    if (gc < cols && gr < rows) {
      uint32_t w = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(tile[4 * tx + i][c]) << (8 * i);
      *reinterpret_cast<uint32_t*>(qt + gc * rows + gr) = w;
    }
  }
}

__global__ void transpose_bytes_kernel(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt) {
  const int64_t n = rows * cols, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    qt[(i % cols) * rows + i / cols] = q[i];
}

}  // namespace

void fp8_transpose_cuda(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt, void* stream) {
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_transpose_cuda: negative shape ", rows, "x", cols);
  if (rows == 0 || cols == 0) return;
  BMT_CHECK(q && qt, "fp8_transpose_cuda: null buffer for a ", rows, "x", cols, " matrix");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool words = rows % 4 == 0 && cols % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(qt) % 4 == 0;
  if (words) {
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
    BMT_CHECK(grid.y <= 65535, "fp8_transpose_cuda: ", rows, " rows exceed the grid (65535 tiles of ", kTile, ")");
    transpose_words_kernel<<<grid, dim3(kThreadsX, kThreadsY), 0, s>>>(q, rows, cols, qt);
  } else {
    const int64_t blocks = std::min<int64_t>((rows * cols + 255) / 256, 4096);
    transpose_bytes_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(q, rows, cols, qt);
  }
  const cudaError_t e = cudaGetLastError();
  BMT_CHECK(e == cudaSuccess, "fp8_transpose_cuda: launch failed: ", cudaGetErrorString(e));
}

}  // namespace bmt::core::kernels
