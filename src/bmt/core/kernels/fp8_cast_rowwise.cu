// CUDA FP8 cast with rowwise scaling (fp8_cast_internal.h; shared device pieces in fp8_cast_internal.cuh).
// Row-major copy: one block per row reads the row for its maximum, then again (from L2: rows are KBs) to cast it.
// Transposed copy, scaled per column of x: the column maxima by atomicMax on |x|'s bits into the zeroed workspace
// (tiles of 64 rows, one column per thread, consecutive threads on consecutive columns), then the transposing cast
// of fp8_cast.cu with each tile's column scales in shared memory.
#include "bmt/core/kernels/fp8_cast_internal.cuh"

namespace bmt::core::kernels {
namespace {

using namespace fp8_device;

constexpr int kColRows = 64;  // rows per block of the column maxima

template <Fp8Format F>
__host__ __device__ constexpr float fp8_max_of() { return F == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

template <DType D, Fp8Format F>
__global__ void __launch_bounds__(kThreads) row_cast_kernel(const void* x, int64_t cols, bool vec, uint8_t* q,
                                                           float* q_inv) {
  constexpr int V = detail::kVecElems<D>;
  __shared__ float row_scale;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * cols;
  uint32_t m = 0;
  if (vec) {  // cols % V == 0, aligned buffers: every row starts aligned
    for (int64_t v = threadIdx.x; v < cols / V; v += kThreads) {
      float e[V];
      detail::load_vec<D>(x, base + v * V, e);
#pragma unroll
      for (int k = 0; k < V; ++k) m = max(m, abs_bits(e[k]));
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) m = max(m, abs_bits(detail::load<D>(x, base + c)));
  }
  m = block_max(m);
  if (threadIdx.x == 0) {
    float scale, inv;
    scale_of(m, fp8_max_of<F>(), scale, inv);
    row_scale = scale;
    q_inv[blockIdx.x] = inv;
  }
  __syncthreads();
  const float scale = row_scale;
  if (vec) {
    for (int64_t v = threadIdx.x; v < cols / V; v += kThreads) cast_vec<D, F>(x, base + v * V, scale, q);
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) q[base + c] = to_fp8<F>(detail::load<D>(x, base + c), scale);
  }
}

template <DType D>
__global__ void __launch_bounds__(kThreads) column_max_kernel(const void* x, int64_t rows, int64_t cols,
                                                             uint32_t* col_max) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kColRows;
  const int64_t r1 = r0 + kColRows < rows ? r0 + kColRows : rows;
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r) m = max(m, abs_bits(detail::load<D>(x, r * cols + c)));
  atomicMax(col_max + c, m);
}

template <DType D>
void launch_rowwise(const void* x, int64_t rows, int64_t cols, Fp8Format f, uint8_t* q, float* q_inv, uint8_t* qt,
                    float* qt_inv, uint32_t* workspace, cudaStream_t s) {
  if (q) {
    constexpr int V = detail::kVecElems<D>;
    const bool vec = cols % V == 0 && detail::vec_aligned(x) && reinterpret_cast<uintptr_t>(q) % V == 0;
    BMT_CHECK(rows <= 0x7fffffff, "fp8_cast_rowwise_cuda: ", rows, " rows exceed the grid's x limit");
    const unsigned g = static_cast<unsigned>(rows);
    if (f == Fp8Format::kE4M3) row_cast_kernel<D, Fp8Format::kE4M3><<<g, kThreads, 0, s>>>(x, cols, vec, q, q_inv);
    else row_cast_kernel<D, Fp8Format::kE5M2><<<g, kThreads, 0, s>>>(x, cols, vec, q, q_inv);
  }
  if (qt) {
    BMT_CHECK((rows + kColRows - 1) / kColRows <= 65535, "fp8_cast_rowwise_cuda: ", rows,
              " rows exceed the grid's y limit");
    const cudaError_t err = cudaMemsetAsync(workspace, 0, static_cast<size_t>(cols) * sizeof(uint32_t), s);
    BMT_CHECK(err == cudaSuccess, "fp8_cast_rowwise_cuda: clearing the column maxima failed: ",
              cudaGetErrorString(err));
    const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
                    static_cast<unsigned>((rows + kColRows - 1) / kColRows));
    column_max_kernel<D><<<grid, kThreads, 0, s>>>(x, rows, cols, workspace);
    CastScale cs;
    cs.col_max = workspace;
    cs.fp8_max = fp8_max(f);
    cs.col_inv = qt_inv;
    launch_cast_transpose<D, true>(x, rows, cols, cs, f, nullptr, qt, s);
  }
}

}  // namespace

void fp8_cast_rowwise_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q,
                           float* q_inv, uint8_t* qt, float* qt_inv, uint32_t* workspace, void* stream) {
  check_dtype(dtype, "fp8_cast_rowwise_cuda");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_rowwise_cuda: negative shape [", rows, ", ", cols, "]");
  BMT_CHECK(!q == !q_inv && !qt == !qt_inv, "fp8_cast_rowwise_cuda: each copy needs its inverse scales");
  BMT_CHECK(!qt || workspace, "fp8_cast_rowwise_cuda: the transposed copy needs a workspace of ", cols, " words");
  if (rows == 0 || cols == 0 || (!q && !qt)) return;
  BMT_CHECK(x, "fp8_cast_rowwise_cuda: null input");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch_rowwise<DType::kFloat32>(x, rows, cols, format, q, q_inv, qt, qt_inv, workspace, s); break;
    case DType::kBFloat16: launch_rowwise<DType::kBFloat16>(x, rows, cols, format, q, q_inv, qt, qt_inv, workspace, s); break;
    default: launch_rowwise<DType::kFloat16>(x, rows, cols, format, q, q_inv, qt, qt_inv, workspace, s); break;
  }
  check_launch("fp8_cast_rowwise_cuda");
}

}  // namespace bmt::core::kernels
