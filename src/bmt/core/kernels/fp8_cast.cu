// CUDA FP8 scale and cast, per tensor (fp8_cast_internal.h; shared device pieces in fp8_cast_internal.cuh).
// Scale: stage 1, fp8_scale_workspace_numel blocks of 256 threads each reduce a grid-strided share of |x| to one
// maximum; stage 2, one block reduces those and writes {amax, scale, inv_scale}.
// Cast: without the transposed copy, 16-byte vector loads where aligned; with it, tiles through shared memory so
// that both the row-major and the transposed bytes are written by consecutive threads: 64 x 64 tiles moved 8
// elements per access (16-byte loads, 8-byte stores) when rows and columns are multiples of 8 and the buffers
// aligned (every FP8 GEMM operand: their dimensions are multiples of 16), else 32 x 32 tiles element by element.
// (The element-wise tile ran near a third of HBM bandwidth: it was most of FP8's cast cost.)
#include "bmt/core/kernels/fp8_cast_internal.cuh"

namespace bmt::core::kernels {
namespace {

using namespace fp8_device;

template <DType D>
__global__ void __launch_bounds__(kThreads) amax_partial_kernel(const void* x, int64_t numel, bool vec, uint32_t* partial) {
  constexpr int V = detail::kVecElems<D>;
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {  // numel % V == 0 and an aligned base
    for (int64_t v = i; v < numel / V; v += stride) {
      float e[V];
      detail::load_vec<D>(x, v * V, e);
#pragma unroll
      for (int k = 0; k < V; ++k) m = max(m, abs_bits(e[k]));
    }
  } else {
    for (; i < numel; i += stride) m = max(m, abs_bits(detail::load<D>(x, i)));
  }
  m = block_max(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

__global__ void __launch_bounds__(kThreads) finish_scale_kernel(const uint32_t* partial, int64_t n, float fp8_max,
                                                                float* stats, float* inv_copy) {
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) m = max(m, partial[i]);
  m = block_max(m);
  if (threadIdx.x != 0) return;
  float scale, inv;
  scale_of(m, fp8_max, scale, inv);
  stats[kFp8Amax] = __uint_as_float(m);
  stats[kFp8Scale] = scale;
  stats[kFp8InvScale] = inv;
  if (inv_copy) *inv_copy = inv;
}

template <DType D, Fp8Format F>
__global__ void __launch_bounds__(kThreads) cast_kernel(const void* x, int64_t numel, bool vec, CastScale cs,
                                                       uint8_t* q) {
  constexpr int V = detail::kVecElems<D>;
  const float scale = tensor_scale(cs);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t m = 0;
  if (vec) {  // V bytes out per thread: 8 (one 8-byte store) or 4 (one 4-byte store)
    for (int64_t v = i0; v < numel / V; v += stride) m = max(m, cast_vec<D, F>(x, v * V, scale, q));
  } else {
    for (int64_t i = i0; i < numel; i += stride) {
      const float e = detail::load<D>(x, i);
      m = max(m, abs_bits(e));
      q[i] = to_fp8<F>(e, scale);
    }
  }
  fold_amax(cs, m);
}

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>((work + kThreads - 1) / kThreads, 1), 4096));
}

template <DType D>
void launch_cast(const void* x, int64_t rows, int64_t cols, const CastScale& cs, Fp8Format f, uint8_t* q, uint8_t* qt,
                 cudaStream_t s) {
  const int64_t numel = rows * cols;
  if (!qt) {
    constexpr int V = detail::kVecElems<D>;
    const bool vec = numel % V == 0 && detail::vec_aligned(x) && reinterpret_cast<uintptr_t>(q) % V == 0;
    const unsigned g = grid_for(vec ? numel / V : numel);
    if (f == Fp8Format::kE4M3) cast_kernel<D, Fp8Format::kE4M3><<<g, kThreads, 0, s>>>(x, numel, vec, cs, q);
    else cast_kernel<D, Fp8Format::kE5M2><<<g, kThreads, 0, s>>>(x, numel, vec, cs, q);
    return;
  }
  launch_cast_transpose<D, false>(x, rows, cols, cs, f, q, qt, s);
}

void cast_any(const void* x, DType dtype, int64_t rows, int64_t cols, const CastScale& cs, Fp8Format format,
              uint8_t* q, uint8_t* qt, cudaStream_t s) {
  switch (dtype) {
    case DType::kFloat32: launch_cast<DType::kFloat32>(x, rows, cols, cs, format, q, qt, s); break;
    case DType::kBFloat16: launch_cast<DType::kBFloat16>(x, rows, cols, cs, format, q, qt, s); break;
    default: launch_cast<DType::kFloat16>(x, rows, cols, cs, format, q, qt, s); break;
  }
}

}  // namespace

void fp8_scale_cuda(const void* x, DType dtype, int64_t numel, Fp8Format format, float* stats, uint32_t* workspace,
                    void* stream, float* inv_scale_copy) {
  check_dtype(dtype, "fp8_scale_cuda");
  BMT_CHECK(numel >= 0 && stats && workspace && (numel == 0 || x), "fp8_scale_cuda: bad arguments (numel ", numel, ")");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t blocks = fp8_scale_workspace_numel(numel);
  const int v = dtype == DType::kFloat32 ? 4 : 8;
  const bool vec = numel % v == 0 && detail::vec_aligned(x);
  const unsigned g = static_cast<unsigned>(blocks);
  switch (dtype) {
    case DType::kFloat32: amax_partial_kernel<DType::kFloat32><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
    case DType::kBFloat16: amax_partial_kernel<DType::kBFloat16><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
    default: amax_partial_kernel<DType::kFloat16><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
  }
  finish_scale_kernel<<<1, kThreads, 0, s>>>(workspace, blocks, fp8_max(format), stats, inv_scale_copy);
  check_launch("fp8_scale_cuda");
}

void fp8_scale_from_partials_cuda(const uint32_t* partial, int64_t n, Fp8Format format, float* stats, void* stream,
                                  float* inv_scale_copy) {
  BMT_CHECK(n >= 0 && stats && (n == 0 || partial), "fp8_scale_from_partials_cuda: bad arguments (n ", n, ")");
  finish_scale_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(partial, n, fp8_max(format), stats,
                                                                               inv_scale_copy);
  check_launch("fp8_scale_from_partials_cuda");
}

void fp8_cast_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, const float* stats, Fp8Format format,
                   uint8_t* q, uint8_t* qt, void* stream) {
  check_dtype(dtype, "fp8_cast_cuda");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_cuda: negative shape [", rows, ", ", cols, "]");
  if (rows == 0 || cols == 0 || (!q && !qt)) return;
  BMT_CHECK(x && stats, "fp8_cast_cuda: null buffer");
  CastScale cs;
  cs.stats = stats;
  cast_any(x, dtype, rows, cols, cs, format, q, qt, static_cast<cudaStream_t>(stream));
  check_launch("fp8_cast_cuda");
}

void fp8_cast_delayed_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, const float* scale,
                           float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt, void* stream) {
  check_dtype(dtype, "fp8_cast_delayed_cuda");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_delayed_cuda: negative shape [", rows, ", ", cols, "]");
  if (rows == 0 || cols == 0 || (!q && !qt)) return;
  BMT_CHECK(x && scale && amax_io, "fp8_cast_delayed_cuda: null buffer");
  CastScale cs;
  cs.scale = scale;
  cs.amax_fold = reinterpret_cast<uint32_t*>(amax_io);  // (a non-negative float's bits order as the float)
  cast_any(x, dtype, rows, cols, cs, format, q, qt, static_cast<cudaStream_t>(stream));
  check_launch("fp8_cast_delayed_cuda");
}

}  // namespace bmt::core::kernels
