// CPU twin of the fused Adam kernel (see adam.h for the update and its invariants). Three code paths with
// identical arithmetic: scalar, AVX2 (+F16C, 8 lanes) and AVX-512F (16 lanes), chosen at run time with
// __builtin_cpu_supports; the vector paths are compiled with function-level target pragmas, so the library needs
// no -march flag. fp16/bf16 loads and stores convert in registers with round-to-nearest-even. Loop tails go
// through a zero-padded stack block processed by the same vector code, so every element of a tensor takes the same
// path whatever the chunking. Floating-point contraction is disabled for this file: an FMA would round differently
// from the scalar and CUDA paths.
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (bug 105593): silence the bogus warning.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "bmt/core/kernels/adam.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/thread_pool.h"

namespace bmt::core::kernels {
namespace {

// ---------------------------------------------------------------------------------------------- scalar path --
template <DType D>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(base)[i];
  if constexpr (D == DType::kBFloat16) return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  if constexpr (D == DType::kFloat16) return fp16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  return 0.0f;
}

template <DType D>
inline void store_scalar(void* base, int64_t i, float x) {
  if constexpr (D == DType::kFloat32) static_cast<float*>(base)[i] = x;
  if constexpr (D == DType::kBFloat16) static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(x);
  if constexpr (D == DType::kFloat16) static_cast<uint16_t*>(base)[i] = float_to_fp16_bits(x);
}

template <DType PD, DType GD>
void scalar_range(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float g = load_scalar<GD>(t.grad, i) * inv_scale;
    float p = t.master ? t.master[i] : load_scalar<PD>(t.param, i);
    float m = t.exp_avg[i] * t.beta1 + g * t.one_minus_beta1;
    float v = t.exp_avg_sq[i] * t.beta2 + (g * g) * t.one_minus_beta2;
    float d = std::sqrt(v) / t.bias_correction2_sqrt + t.eps;
    p = p * t.decay - t.step_size * (m / d);
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (t.master) t.master[i] = p;
    store_scalar<PD>(t.param, i, p);
  }
}

// Runs the vector body `Body::full<PD,GD>` on [begin, end): whole vectors in place, the tail through a padded
// stack block so that it takes the exact same instructions.
template <int W, typename FullFn>
void vector_range(const AdamTensorArgs& t, int64_t begin, int64_t end, FullFn full) {
  int64_t n_full = (end - begin) / W * W;
  if (n_full > 0) full(t, begin, begin + n_full);
  int64_t tail = end - begin - n_full;
  if (tail == 0) return;
  int64_t start = begin + n_full;
  alignas(64) float master[W] = {}, m[W] = {}, v[W] = {};
  alignas(64) unsigned char param[W * 4] = {}, grad[W * 4] = {};
  size_t pb = dtype_nbytes(t.param_dtype), gb = dtype_nbytes(t.grad_dtype);
  std::memcpy(param, static_cast<const char*>(t.param) + start * pb, tail * pb);
  std::memcpy(grad, static_cast<const char*>(t.grad) + start * gb, tail * gb);
  if (t.master) std::memcpy(master, t.master + start, tail * 4);
  std::memcpy(m, t.exp_avg + start, tail * 4);
  std::memcpy(v, t.exp_avg_sq + start, tail * 4);
  AdamTensorArgs block = t;
  block.param = param;
  block.grad = grad;
  block.master = t.master ? master : nullptr;
  block.exp_avg = m;
  block.exp_avg_sq = v;
  block.numel = W;
  full(block, 0, W);
  std::memcpy(static_cast<char*>(t.param) + start * pb, param, tail * pb);
  if (t.master) std::memcpy(t.master + start, master, tail * 4);
  std::memcpy(t.exp_avg + start, m, tail * 4);
  std::memcpy(t.exp_avg_sq + start, v, tail * 4);
}

// ------------------------------------------------------------------------------------------------ AVX2 path --
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace avx2 {
constexpr int W = 8;

template <DType D>
inline __m256 load(const void* base, int64_t i) {
  if constexpr (D == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBFloat16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_cvtph_ps(h);
  }
}

template <DType D>
inline void store(void* base, int64_t i, __m256 x) {
  if constexpr (D == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBFloat16) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, quiet_nan, is_nan);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), _mm256_castsi256_si128(packed));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType PD, DType GD>
void full(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end) {
  const __m256 scale = _mm256_set1_ps(inv_scale), b1 = _mm256_set1_ps(t.beta1), omb1 = _mm256_set1_ps(t.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(t.beta2), omb2 = _mm256_set1_ps(t.one_minus_beta2), eps = _mm256_set1_ps(t.eps);
  const __m256 decay = _mm256_set1_ps(t.decay), step = _mm256_set1_ps(t.step_size);
  const __m256 bc2 = _mm256_set1_ps(t.bias_correction2_sqrt);
  for (int64_t i = begin; i < end; i += W) {
    __m256 g = _mm256_mul_ps(load<GD>(t.grad, i), scale);
    __m256 p = t.master ? _mm256_loadu_ps(t.master + i) : load<PD>(t.param, i);
    __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t.exp_avg + i), b1), _mm256_mul_ps(g, omb1));
    __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t.exp_avg_sq + i), b2),
                             _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
    __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
    p = _mm256_sub_ps(_mm256_mul_ps(p, decay), _mm256_mul_ps(step, _mm256_div_ps(m, d)));
    _mm256_storeu_ps(t.exp_avg + i, m);
    _mm256_storeu_ps(t.exp_avg_sq + i, v);
    if (t.master) _mm256_storeu_ps(t.master + i, p);
    store<PD>(t.param, i, p);
  }
}
}  // namespace avx2
#pragma GCC pop_options

// --------------------------------------------------------------------------------------------- AVX-512 path --
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,f16c")
namespace avx512 {
constexpr int W = 16;

template <DType D>
inline __m512 load(const void* base, int64_t i) {
  if constexpr (D == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBFloat16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_cvtph_ps(h);
  }
}

template <DType D>
inline void store(void* base, int64_t i, __m512 x) {
  if constexpr (D == DType::kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBFloat16) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, r, quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), _mm512_cvtepi32_epi16(r));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType PD, DType GD>
void full(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end) {
  const __m512 scale = _mm512_set1_ps(inv_scale), b1 = _mm512_set1_ps(t.beta1), omb1 = _mm512_set1_ps(t.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(t.beta2), omb2 = _mm512_set1_ps(t.one_minus_beta2), eps = _mm512_set1_ps(t.eps);
  const __m512 decay = _mm512_set1_ps(t.decay), step = _mm512_set1_ps(t.step_size);
  const __m512 bc2 = _mm512_set1_ps(t.bias_correction2_sqrt);
  for (int64_t i = begin; i < end; i += W) {
    __m512 g = _mm512_mul_ps(load<GD>(t.grad, i), scale);
    __m512 p = t.master ? _mm512_loadu_ps(t.master + i) : load<PD>(t.param, i);
    __m512 m = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(t.exp_avg + i), b1), _mm512_mul_ps(g, omb1));
    __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(t.exp_avg_sq + i), b2),
                             _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_sub_ps(_mm512_mul_ps(p, decay), _mm512_mul_ps(step, _mm512_div_ps(m, d)));
    _mm512_storeu_ps(t.exp_avg + i, m);
    _mm512_storeu_ps(t.exp_avg_sq + i, v);
    if (t.master) _mm512_storeu_ps(t.master + i, p);
    store<PD>(t.param, i, p);
  }
}
}  // namespace avx512
#pragma GCC pop_options

// ----------------------------------------------------------------------------------------------- dispatch --
template <DType PD, DType GD>
void run_isa(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end, CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      vector_range<avx512::W>(t, begin, end, [inv_scale](const AdamTensorArgs& a, int64_t b, int64_t e) {
        avx512::full<PD, GD>(a, inv_scale, b, e);
      });
      return;
    case CpuIsa::kAvx2:
      vector_range<avx2::W>(t, begin, end, [inv_scale](const AdamTensorArgs& a, int64_t b, int64_t e) {
        avx2::full<PD, GD>(a, inv_scale, b, e);
      });
      return;
    case CpuIsa::kScalar: scalar_range<PD, GD>(t, inv_scale, begin, end); return;
  }
}

template <DType PD>
void dispatch_grad(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end, CpuIsa isa) {
  switch (t.grad_dtype) {
    case DType::kFloat32: return run_isa<PD, DType::kFloat32>(t, inv_scale, begin, end, isa);
    case DType::kBFloat16: return run_isa<PD, DType::kBFloat16>(t, inv_scale, begin, end, isa);
    case DType::kFloat16: return run_isa<PD, DType::kFloat16>(t, inv_scale, begin, end, isa);
    default: BMT_ERROR("adam: unsupported gradient dtype ", dtype_name(t.grad_dtype));
  }
}

bool is_float_dtype(DType d) { return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16; }

CpuIsa detect_isa() {
  CpuIsa best = CpuIsa::kScalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) best = CpuIsa::kAvx2;
  if (best == CpuIsa::kAvx2 && __builtin_cpu_supports("avx512f")) best = CpuIsa::kAvx512;
#endif
  if (const char* env = std::getenv("BMT_CPU_ISA")) {
    std::string s(env);
    CpuIsa want = s == "scalar" ? CpuIsa::kScalar : s == "avx2" ? CpuIsa::kAvx2 : s == "avx512" ? CpuIsa::kAvx512 : best;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

CpuIsa adam_cpu_best_isa() {
  static const CpuIsa isa = detect_isa();
  return isa;
}

bool adam_cpu_isa_supported(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f");
  }
#endif
  return isa == CpuIsa::kScalar;
}

void adam_check_args(const AdamTensorArgs& t, const char* what) {
  BMT_CHECK(t.numel >= 0, "adam: ", what, " has a negative element count ", t.numel);
  BMT_CHECK(is_float_dtype(t.param_dtype), "adam: ", what, " has dtype ", dtype_name(t.param_dtype),
            "; only float32, float16 and bfloat16 parameters can be optimised");
  BMT_CHECK(is_float_dtype(t.grad_dtype), "adam: the gradient of ", what, " has dtype ", dtype_name(t.grad_dtype),
            "; use float32, float16 or bfloat16 gradients");
  if (t.numel == 0) return;  // empty shards: nothing is read, pointers may be null
  BMT_CHECK((t.param_dtype == DType::kFloat32) == (t.master == nullptr), "adam: ", what,
            ": a fp32 master copy is required for half-precision parameters and must be absent for fp32 ones");
  BMT_CHECK(t.param && t.grad && t.exp_avg && t.exp_avg_sq, "adam: ", what, " has a null buffer pointer");
}

void adam_cpu_range_isa(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end, CpuIsa isa) {
  BMT_ASSERT(begin >= 0 && begin <= end && end <= t.numel, "adam range [", begin, ", ", end, ") of ", t.numel);
  BMT_CHECK(adam_cpu_isa_supported(isa), "adam: this CPU does not support ", cpu_isa_name(isa));
  if (begin == end) return;
  switch (t.param_dtype) {
    case DType::kFloat32: return dispatch_grad<DType::kFloat32>(t, inv_scale, begin, end, isa);
    case DType::kBFloat16: return dispatch_grad<DType::kBFloat16>(t, inv_scale, begin, end, isa);
    case DType::kFloat16: return dispatch_grad<DType::kFloat16>(t, inv_scale, begin, end, isa);
    default: BMT_ERROR("adam: unsupported parameter dtype ", dtype_name(t.param_dtype));
  }
}

void adam_cpu_range(const AdamTensorArgs& t, float inv_scale, int64_t begin, int64_t end) {
  adam_cpu_range_isa(t, inv_scale, begin, end, adam_cpu_best_isa());
}

void adam_cpu(const AdamTensorArgs* tensors, size_t num_tensors, float inv_scale, ThreadPool& pool) {
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (size_t k = 0; k < num_tensors; ++k) {
    adam_check_args(tensors[k], "tensor");
    for (int64_t b = 0; b < tensors[k].numel; b += kAdamCpuChunkElems)
      chunks.push_back({k, b, std::min(tensors[k].numel, b + kAdamCpuChunkElems)});
  }
  const CpuIsa isa = adam_cpu_best_isa();
  pool.parallel_for(static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) adam_cpu_range_isa(tensors[chunks[c].tensor], inv_scale, chunks[c].begin, chunks[c].end, isa);
  });
}

}  // namespace bmt::core::kernels
