// Fused cross-entropy kernels over a (possibly vocabulary-parallel) slice of the logits. Torch-free.
//
// Logits are a row-major (rows, cols) matrix of fp32/fp16/bf16 holding the vocabulary ids
// [vocab_begin, vocab_begin + cols) of a vocabulary of vocab_total ids (vocab_begin = 0, cols = vocab_total when
// nothing is split). target[i] is a vocabulary id or ignore_index; ignored rows contribute nothing.
//
// Forward = statistics per row, in fp32, then a cheap combination in the caller:
//   stats kernel  -> local max m, s = sum_j exp(x_j - m), the target logit if it is in this slice (else 0),
//                    z = sum_j (x_j - m)  (the logit sum shifted by the max, for label smoothing)
//   combine ranks -> M = max_r m_r (all-reduce max), then per rank s_r *= exp(m_r - M), z_r += cols * (m_r - M),
//                    and one all-reduce sum of (s, target logit, z): S, x_t, Z = sum_j (x_j - M) over the vocabulary
//   row loss      =  (1 - eps) * (M - x_t) - eps * Z / V + log(S)      (eps = label smoothing, V = vocab_total)
// which equals torch's cross_entropy with label_smoothing: (1-eps)(lse - x_t) + eps(lse - mean_x), lse = M+log S.
// Differences to the max are taken before summing or adding log S, so that logits with a large common offset
// lose no precision (the eps term is skipped when eps == 0).
// Backward (no communication): grad_logits = (exp(x - M) / S - (1-eps) * onehot(t) - eps / V) * grad_row[i],
// zero on ignored rows; may run in place (grad_logits == logits), written in the logits' dtype.
//
// Invariants: 64-bit sizes and indices; everything accumulated in fp32; one kernel launch per CUDA call,
// enqueued on the stream passed in (a cudaStream_t); nothing is launched when rows == 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

class ThreadPool;

struct CrossEntropyArgs {
  const void* logits = nullptr;     // (rows, cols) row-major, dtype
  DType dtype = DType::kFloat32;    // float32, float16 or bfloat16
  int64_t rows = 0;
  int64_t cols = 0;                 // >= 1
  const int64_t* target = nullptr;  // rows vocabulary ids (same memory space as logits)
  int64_t vocab_begin = 0;          // vocabulary id of column 0
  int64_t vocab_total = 0;          // size of the whole vocabulary (over every slice)
  int64_t ignore_index = -100;
};

// The statistics buffer is struct-of-arrays, kCrossEntropyNumStats * rows floats: the max row first (so that
// it can be all-reduced with kMax on its own), then the three rows that are all-reduced with kSum in one call.
enum CrossEntropyStat : int { kStatMax = 0, kStatSumExp = 1, kStatTargetLogit = 2, kStatShiftedSum = 3 };
constexpr int kCrossEntropyNumStats = 4;

// Validates the sizes, dtype and pointers; throws bmt::core::Error naming `what`.
void cross_entropy_check_args(const CrossEntropyArgs& a, const char* what);

// Statistics of every row (see above; ignored rows get all four set to 0). Host memory. Throws if a target is
// neither ignore_index nor in [0, vocab_total). Rows are split over `pool` and the caller; blocks.
void cross_entropy_stats_cpu(const CrossEntropyArgs& a, float* stats, ThreadPool& pool);

// Writes grad_logits (rows, cols) in a.dtype (may equal a.logits). row_max, row_sumexp: the combined M and S of
// every row; grad_row: d loss / d row loss (e.g. 1/count for a mean). Host memory; blocks.
void cross_entropy_backward_cpu(const CrossEntropyArgs& a, const float* row_max, const float* row_sumexp,
                                const float* grad_row, float label_smoothing, void* grad_logits, ThreadPool& pool);

// CUDA twins (builds with BMT_WITH_CUDA): device pointers, one launch each on `stream`, no host synchronisation.
// Out-of-range targets are not detected on the device (the caller checks them): they behave as "not in slice".
void cross_entropy_stats_cuda(const CrossEntropyArgs& a, float* stats, void* stream);
void cross_entropy_backward_cuda(const CrossEntropyArgs& a, const float* row_max, const float* row_sumexp,
                                 const float* grad_row, float label_smoothing, void* grad_logits, void* stream);

// The loss of one row from its combined statistics, the formula above (the LibTorch layer evaluates the same
// expression with tensor ops; tests use this one).
inline float cross_entropy_row_loss(float row_max, float row_sumexp, float target_logit, float shifted_sum,
                                    float label_smoothing, int64_t vocab_total) {
  float loss = (1.0f - label_smoothing) * (row_max - target_logit);
  if (label_smoothing != 0.0f) loss -= label_smoothing * (shifted_sum / static_cast<float>(vocab_total));
  return loss + std::log(row_sumexp);
}

}  // namespace bmt::core::kernels
