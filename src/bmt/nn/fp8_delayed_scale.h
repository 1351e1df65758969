// Delayed FP8 scaling of one tensor whose producer writes it in FP8 itself (core/kernels/fp8_delayed_scale: the
// recipe, its state and its record): the FP8 MLP's GELU output, which c_fc's GEMM writes in E4M3 with the scale of
// the amaxes of the last `history_len` calls, so no cast pass reads a bf16 copy of it (nn::fp8_gelu_mlp with
// fp8_delayed_gelu_enabled()). A module owns one per tensor (the GPT's MLP: GptMlp::gelu_scale).
//
// The state lives on the device of the first record, is not in checkpoints (a loaded model starts again from a
// dynamic cast: ready() is false until its first record) and is the same object across a CUDA graph's replays
// (every update is in place).
#pragma once

#include <ATen/ATen.h>

#include "bmt/nn/fp8_format.h"

namespace bmt::nn {

class Fp8DelayedScale {
 public:
  explicit Fp8DelayedScale(int64_t history_len = 16, Fp8Format format = Fp8Format::kE4M3);

  // Whether a record has set the scale (before: the producer's caller casts dynamically, then record_amax()).
  bool ready() const { return records_ > 0; }
  int64_t history_len() const { return len_; }
  Fp8Format format() const { return format_; }

  // The producer's operands, valid once ready(): the scale to write with (0-dim float32) and where it folds its
  // output's amax (0-dim float32, 0 on entry).
  const at::Tensor& scale() const;
  const at::Tensor& amax() const;
  // The amaxes kept, newest first (float32 [history_len]); undefined before the first record.
  const at::Tensor& history() const { return history_; }

  // After the producer wrote with scale() and folded its amax into amax(): records it, returns this call's inverse
  // scale for the bytes' consumers (0-dim float32; NaN when the amax was not finite) and moves scale() on.
  at::Tensor record();
  // A dynamic cast's amax (a 0-dim float32, e.g. Fp8Tensor::stats[0]) recorded as if a producer had folded it.
  void record_amax(const at::Tensor& amax);

 private:
  void allocate(const at::Tensor& like);

  int64_t len_;
  Fp8Format format_;
  at::Tensor history_, scale_, inv_, amax_;
  int64_t records_ = 0;
};

// The delayed scales of one FP8 linear's forward operands, its input and its weight (nn::fp8_linear's `scales`, used
// under fp8_delayed_inputs_enabled(): both cast by nn::fp8_cast_delayed, the weight's transposed copy for dgrad in the
// same pass and kept for the backward). A layer owns one: LinearImpl::fp8_scales.
struct Fp8LinearScales {
  Fp8DelayedScale input, weight;
};

// The FP8 MLP's GELU output by c_fc's GEMM in E4M3 with a delayed scale (when the MLP is given an Fp8DelayedScale):
// BMT_FP8_DELAYED_GELU=1 | 0 (the default), or set here. Off until measured on a GPU: it changes the numerics (a
// value above the scale's range saturates) for one cast pass fewer over the MLP's widest activation.
bool fp8_delayed_gelu_enabled();
void set_fp8_delayed_gelu_enabled(bool enabled);

}  // namespace bmt::nn
