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

#include <memory>
#include <string>

#include "bmt/nn/fp8_format.h"

namespace bmt::nn {

class Fp8DelayedScale {
 public:
  explicit Fp8DelayedScale(int64_t history_len = 16, Fp8Format format = Fp8Format::kE4M3);
  // A copy starts afresh (the same history length and format, not ready): a copied module keeps scales of its own.
  Fp8DelayedScale(const Fp8DelayedScale& other);
  Fp8DelayedScale& operator=(const Fp8DelayedScale& other);
  Fp8DelayedScale(Fp8DelayedScale&&) noexcept = default;  // (a moved-from scale is only destroyed or assigned)
  Fp8DelayedScale& operator=(Fp8DelayedScale&&) noexcept = default;
  // Another handle on this same state (not a copy): what an autograd node keeps to record a gradient's amax in its
  // backward, so the state outlives the module that owns it.
  Fp8DelayedScale share() const;

  // Whether a record has set the scale (before: the producer's caller casts dynamically, then record_amax()).
  bool ready() const { return s_->records > 0; }
  int64_t history_len() const { return s_->len; }
  Fp8Format format() const { return s_->format; }

  // The producer's operands, valid once ready(): the scale to write with (0-dim float32) and where it folds its
  // output's amax (0-dim float32, 0 on entry).
  const at::Tensor& scale() const;
  const at::Tensor& amax() const;
  // The amaxes kept, newest first (float32 [history_len]); undefined before the first record.
  const at::Tensor& history() const { return s_->history; }

  // After the producer wrote with scale() and folded its amax into amax(): records it, returns this call's inverse
  // scale for the bytes' consumers (0-dim float32; NaN when the amax was not finite) and moves scale() on.
  at::Tensor record();
  // A dynamic cast's amax (a 0-dim float32, e.g. Fp8Tensor::stats[0]) recorded as if a producer had folded it.
  void record_amax(const at::Tensor& amax);

 private:
  struct State {
    State(int64_t history_len, Fp8Format f) : len(history_len), format(f) {}
    int64_t len;
    Fp8Format format;
    at::Tensor history, scale, inv, amax;
    int64_t records = 0;
  };
  struct Shared {};
  Fp8DelayedScale(std::shared_ptr<State> s, Shared) : s_(std::move(s)) {}
  void allocate(const at::Tensor& like);

  std::shared_ptr<State> s_;
};

// The delayed scales of one FP8 linear's forward operands, its input and its weight (nn::fp8_linear's `scales`, used
// under fp8_delayed_inputs_enabled(): both cast by nn::fp8_cast_delayed, the weight's transposed copy for dgrad in the
// same pass and kept for the backward). A layer owns one: LinearImpl::fp8_scales.
struct Fp8LinearScales {
  Fp8DelayedScale input, weight;
  // its output gradient's (E5M2, under fp8_delayed_grads_enabled(): nn::fp8_cast_grad_delayed in the backward)
  Fp8DelayedScale grad{16, Fp8Format::kE5M2};
  // The layer's forward GEMM in the input dtype, only its two backward GEMMs in FP8 (what fp8_linear and its residual
  // and parts variants read from the layer's FP8 state besides the scales; the fused FP8 MLP refuses it): the LM head
  // under fp8_head_backward, whose logits feed the loss exactly.
  bool backward_only = false;
};

// The recipe of the FP8 layers' per-tensor scales: BMT_FP8_RECIPE=current (the default) | delayed, or set here.
// delayed turns on the three switches below (each cast's scale from its tensor's last 16 amaxes, found by the cast
// itself or by the tensor's producer: no amax pass; a value above that window's range saturates); current leaves
// them off (each cast scaled by its tensor's own amax). A switch's own variable, where set, wins over
// BMT_FP8_RECIPE; set_fp8_recipe sets all three. The FP8 LM head (--fp8-head) is a choice of layers, not of recipe.
Fp8Recipe fp8_recipe();
void set_fp8_recipe(Fp8Recipe recipe);
// "current" / "delayed" (the names BMT_FP8_RECIPE, train_gpt's --fp8-recipe and Python take); another name is an
// error naming `who` and the choices.
Fp8Recipe fp8_recipe_from_name(const std::string& name, const char* who);
const char* fp8_recipe_name(Fp8Recipe recipe);

// The FP8 MLP's GELU output by c_fc's GEMM in E4M3 with a delayed scale (when the MLP is given an Fp8DelayedScale):
// BMT_FP8_DELAYED_GELU=1 | 0 (default: the recipe's), or set here. It changes the numerics (a value above the
// scale's range saturates) for one cast pass fewer over the MLP's widest activation.
bool fp8_delayed_gelu_enabled();
void set_fp8_delayed_gelu_enabled(bool enabled);
// The FP8 linears' forward operands (input and weight) by fp8_cast_delayed where a layer passes its Fp8LinearScales:
// BMT_FP8_DELAYED_INPUTS=1 | 0 (default: the recipe's), or set here. As the delayed GELU output, a value above
// its scale's range saturates.
bool fp8_delayed_inputs_enabled();
void set_fp8_delayed_inputs_enabled(bool enabled);
// The FP8 linears' output gradients by fp8_cast_grad_delayed where a layer passes its Fp8LinearScales (E5M2 gradients;
// with BMT_FP8_GRAD=e4m3 they stay dynamic): BMT_FP8_DELAYED_GRADS=1 | 0 (default: the
// recipe's), or set here. A gradient above its scale's range saturates (E5M2's range is 2^32 wide, the window 16
// steps).
bool fp8_delayed_grads_enabled();
void set_fp8_delayed_grads_enabled(bool enabled);

}  // namespace bmt::nn
