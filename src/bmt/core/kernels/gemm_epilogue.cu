// The fused-epilogue GEMMs on cuBLASLt (gemm_epilogue_internal.h). No kernels of ours: cuBLASLt's GEMMs apply
// the bias, GELU (keeping the pre-activation), GELU's gradient and the bias gradient as they write.
//
// Row-major -> cuBLASLt's column-major: a row-major [r, c] matrix is a column-major [c, r] one, so
//   out^T[cols, rows] = op(b)^T . a^T   i.e. A' = b (op T if b_transposed), B' = a (op N), D' = out (ld cols),
// which puts the features on D's rows: the bias and the bias gradient are per row of D', as cuBLASLt wants.
//
// One cuBLASLt handle per device, created on first use; the algorithm for each problem (shape, dtype, epilogue,
// operands' alignment) is asked of the heuristic once and cached, so the hot path only builds descriptors. With
// autotune_candidates > 1 the first use times the heuristic's candidates instead (its first choice is not always the
// fastest at a given shape) and caches the fastest.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "bmt/core/error.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"

namespace bmt::core::kernels {
namespace {

#define BMT_CUBLASLT_CHECK(expr)                                                                     \
  do {                                                                                               \
    const cublasStatus_t _st = (expr);                                                               \
    BMT_CHECK(_st == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", #expr, " failed: ", cublasLtGetStatusString(_st)); \
  } while (0)

constexpr int kMaxDevices = 64;

cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::array<cublasLtHandle_t, kMaxDevices> handles{};
  BMT_CHECK(device >= 0 && device < kMaxDevices, "gemm_epilogue_cuda: device ", device, " out of range");
  std::lock_guard<std::mutex> lock(mu);
  if (!handles[device]) BMT_CUBLASLT_CHECK(cublasLtCreate(&handles[device]));
  return handles[device];
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kBFloat16: return CUDA_R_16BF;
    case DType::kFloat16: return CUDA_R_16F;
    default: BMT_ERROR("gemm_epilogue_cuda: dtype ", dtype_name(t), " is not bf16 or fp16");
  }
}

cublasLtEpilogue_t lt_epilogue(const GemmEpilogueArgs& g) {
  switch (g.epilogue) {
    case GemmEpilogue::kBias: return g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::kDGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The largest power of two up to 16 dividing every operand's address.
uint32_t common_alignment(const GemmEpilogueArgs& g) {
  uintptr_t bits = 16;
  for (const void* p : {g.a, g.b, static_cast<const void*>(g.out), static_cast<const void*>(g.bias),
                        static_cast<const void*>(g.aux), g.residual})
    if (p) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

// RAII for the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

template <typename T>
void set_op(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attr, const T& v) {
  BMT_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &v, sizeof(v)));
}

cudaDataType_t fp8_type(Fp8Format f) { return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// -1 without FP8 operands, else the formats, fast accumulation and the FP8 output's format as bits (part of the
// algorithm's cache key)
int fp8_code(const Fp8GemmOperands* f) {
  if (!f) return -1;
  const int out = f->out_scale ? 1 + static_cast<int>(f->out_format) : 0;
  return out * 8 + static_cast<int>(f->a_format) * 4 + static_cast<int>(f->b_format) * 2 + (f->fast_accum ? 1 : 0);
}

// (device, rows, cols, inner, b_transposed, dtype, epilogue, residual?, bias?, alignment, workspace, fp8) -> algorithm
using ProblemKey = std::tuple<int, int64_t, int64_t, int64_t, bool, int, int, bool, bool, uint32_t, size_t, int>;
struct CachedAlgo {
  bool found = false;
  bool tuned = false;  // chosen by timing (else the heuristic's first choice, which a tuning call may replace)
  cublasLtMatmulAlgo_t algo{};
};

// The matmul of one call with everything but the algorithm fixed.
struct Matmul {
  cublasLtHandle_t handle;
  const Descriptors* desc;
  const GemmEpilogueArgs* g;
  void* workspace;
  size_t workspace_nbytes;
  cudaStream_t stream;
  cublasStatus_t operator()(const cublasLtMatmulAlgo_t& algo) const {
    const float alpha = 1.0f, beta = g->residual ? 1.0f : 0.0f;
    // (an FP8 output: C is never read, beta 0, and has the bias's 16-bit type, which cuBLASLt asks of C then)
    const bool out_fp8 = g->fp8 && g->fp8->out_scale;
    const void* c = g->residual ? g->residual : (out_fp8 ? nullptr : g->out);
    return cublasLtMatmul(handle, desc->op, &alpha, g->b, desc->a, g->a, desc->b, &beta, c, desc->c, g->out, desc->d,
                          &algo, workspace, workspace_nbytes, stream);
  }
};

struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    BMT_CHECK(cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess,
              "gemm_epilogue_cuda: cudaEventCreate failed (autotuning)");
  }
  ~EventPair() {
    if (stop) cudaEventDestroy(stop);
    if (start) cudaEventDestroy(start);
  }
};

// Index of the fastest candidate: each runs once (warm-up; a candidate that fails there is skipped), then
// kTimedRuns times between two events. Every run writes the call's real outputs, which the caller's final run
// overwrites (out, aux, the bias gradient); out aliasing the residual is excluded by the caller.
int fastest_candidate(const Matmul& run, const cublasLtMatmulHeuristicResult_t* candidates, int n) {
  constexpr int kTimedRuns = 3;
  EventPair ev;
  int best = 0;
  float best_ms = -1.0f;
  for (int i = 0; i < n; ++i) {
    if (candidates[i].state != CUBLAS_STATUS_SUCCESS || run(candidates[i].algo) != CUBLAS_STATUS_SUCCESS) continue;
    BMT_CHECK(cudaEventRecord(ev.start, run.stream) == cudaSuccess, "gemm_epilogue_cuda: cudaEventRecord failed");
    bool ok = true;
    for (int r = 0; r < kTimedRuns; ++r) ok = ok && run(candidates[i].algo) == CUBLAS_STATUS_SUCCESS;
    BMT_CHECK(cudaEventRecord(ev.stop, run.stream) == cudaSuccess && cudaEventSynchronize(ev.stop) == cudaSuccess,
              "gemm_epilogue_cuda: timing a candidate algorithm failed");
    float ms = 0.0f;
    BMT_CHECK(cudaEventElapsedTime(&ms, ev.start, ev.stop) == cudaSuccess, "gemm_epilogue_cuda: cudaEventElapsedTime");
    if (ok && (best_ms < 0.0f || ms < best_ms)) best = i, best_ms = ms;
  }
  return best;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  BMT_CHECK(cudaStreamIsCapturing(stream, &status) == cudaSuccess, "gemm_epilogue_cuda: cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

bool gemm_epilogue_cuda(const GemmEpilogueArgs& g, void* workspace, size_t workspace_nbytes, void* stream) {
  check_gemm_epilogue_args(g, "gemm_epilogue_cuda");
  if (g.dtype != DType::kBFloat16 && g.dtype != DType::kFloat16) return false;
  if (g.rows == 0 || g.cols == 0 || g.inner == 0) return false;  // nothing to multiply: the caller's ops handle it
  if (g.aux && g.cols % 8 != 0) return false;                   // cuBLASLt: the aux leading dimension % 8 == 0
  const uint32_t align = common_alignment(g);
  if (align < 2) return false;
  const Fp8GemmOperands* f8 = g.fp8;
  if (f8) {  // cuBLASLt's FP8 GEMMs: "TN" only (A' = b transposed), 16-byte operands, not E5M2 x E5M2
    if (!g.b_transposed || g.rows % 16 != 0 || g.cols % 16 != 0 || g.inner % 16 != 0 || align < 16) return false;
    if (f8->a_format == Fp8Format::kE5M2 && f8->b_format == Fp8Format::kE5M2) return false;
  }
  int device = 0;
  BMT_CHECK(cudaGetDevice(&device) == cudaSuccess, "gemm_epilogue_cuda: cudaGetDevice failed");
  cublasLtHandle_t handle = handle_for(device);

  const cudaDataType_t type = cuda_type(g.dtype);
  Descriptors desc;
  BMT_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = g.b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  set_op(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set_op(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set_op(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g));
  if (g.bias) set_op(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<void*>(g.bias));
  if (f8) {  // A' = b, B' = a: each dequantised by its own inverse scale
    set_op(desc.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(f8->b_inv_scale));
    set_op(desc.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(f8->a_inv_scale));
    set_op(desc.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(f8->fast_accum ? 1 : 0));
  }
  const bool out_fp8 = f8 && f8->out_scale;
  if (out_fp8) {  // D = fp8(scale_D . v), amax_D = max |v|; the bias (and aux) types named: D's type is not theirs
    set_op(desc.op, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void*>(f8->out_scale));
    set_op(desc.op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(f8->out_amax));
    if (g.bias) set_op(desc.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, type);
  }
  if (g.aux) {
    set_op(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(g.aux));
    set_op(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, static_cast<int64_t>(g.cols));
    if (out_fp8) set_op(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, type);
  }
  // A' = b: column-major [inner, cols] (ld inner) read transposed, or [cols, inner] (ld cols) as is.
  const cudaDataType_t a_type = f8 ? fp8_type(f8->b_format) : type, b_type = f8 ? fp8_type(f8->a_format) : type;
  if (g.b_transposed)
    BMT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, a_type, g.inner, g.cols, g.inner));
  else
    BMT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.a, a_type, g.cols, g.inner, g.cols));
  BMT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.b, b_type, g.inner, g.rows, g.inner));  // B' = a
  // C' = D' = out (an FP8 out: C' the 16-bit type, never read)
  BMT_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&desc.c, type, g.cols, g.rows, g.cols));
  BMT_CUBLASLT_CHECK(
      cublasLtMatrixLayoutCreate(&desc.d, out_fp8 ? fp8_type(f8->out_format) : type, g.cols, g.rows, g.cols));

  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  const Matmul run{handle, &desc, &g, workspace, workspace_nbytes, cuda_stream};
  static std::mutex cache_mu;
  static std::map<ProblemKey, CachedAlgo> cache;
  const ProblemKey key{device, g.rows, g.cols, g.inner, g.b_transposed, static_cast<int>(g.dtype),
                       static_cast<int>(g.epilogue), g.residual != nullptr, g.bias != nullptr, align,
                       workspace_nbytes, fp8_code(f8)};
  CachedAlgo algo;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(key);
    // (the capture query is a host call: asked only while this problem is still untuned)
    const bool untuned = it == cache.end() || (!it->second.tuned && it->second.found);
    const bool tune = g.autotune_candidates > 1 && g.out != g.residual && untuned && !stream_capturing(cuda_stream);
    if (it != cache.end() && (it->second.tuned || !tune || !it->second.found)) {
      algo = it->second;
    } else {
      BMT_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
      const uint64_t ws = workspace_nbytes;
      BMT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &ws, sizeof(ws)));
      for (cublasLtMatmulPreferenceAttributes_t attr :
           {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        BMT_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(desc.pref, attr, &align, sizeof(align)));
      constexpr int kMaxCandidates = 16;
      cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};
      const int wanted = tune ? std::min(g.autotune_candidates, kMaxCandidates) : 1;
      int returned = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.c, desc.d,
                                                               desc.pref, wanted, results, &returned);
      BMT_CHECK(st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED,
                "cuBLASLt: cublasLtMatmulAlgoGetHeuristic failed: ", cublasLtGetStatusString(st), " (", g.rows, "x",
                g.cols, "x", g.inner, ", ", gemm_epilogue_name(g.epilogue), ")");
      if (st != CUBLAS_STATUS_SUCCESS) returned = 0;
      const int pick = returned > 1 ? fastest_candidate(run, results, returned) : 0;
      algo.found = returned > 0 && results[pick].state == CUBLAS_STATUS_SUCCESS;
      algo.tuned = tune;
      if (algo.found) algo.algo = results[pick].algo;
      cache[key] = algo;
    }
  }
  if (!algo.found) return false;
  BMT_CUBLASLT_CHECK(run(algo.algo));
  return true;
}

}  // namespace bmt::core::kernels
