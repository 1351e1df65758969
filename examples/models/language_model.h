// LanguageModel: what the trainer needs from a decoder-only model, and the shape/size configuration shared by
// the GPT-2 and Llama architectures (models/gpt.h, models/llama.h).
//
// A model is a torch::nn::Module whose parameters are bmt::DistributedParameters (ZeRO-sharded); every
// transformer layer is wrapped in a bmt::Block inside a bmt::TransformerBlockList registered as "layers".
// forward() is collective: every rank of the ZeRO group must call it (with its own batch).
//
// Tensor parallelism (bmt::config().tp_size > 1): a model has one definition; its tensor-parallel layout is a
// bmt::nn::TpPlan (ParallelOptions::tp_plan, by default the architecture's gpt_tp_plan / llama_tp_plan, layout
// in models/gpt.h) applied while it is built. The ranks of one tp group must call every method together with the
// same ids (they split heads, ff and vocabulary, not the batch); parameter names and state_dict values are those
// of the tp_size 1 model. Every model computes on token rows (TokenRows); at tp_size 1 a plan changes nothing.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bmt/nn/planned_layers.h"
#include "bmt/pipeline/pipeline.h"

namespace bmt {
namespace optim {
class OptimManager;
}
}  // namespace bmt

namespace examples {

struct ModelConfig {
  std::string arch = "gpt";  // "gpt" (GPT-2: LayerNorm, learned positions, GELU, tied) or "llama"
  int64_t vocab_size = 50304;
  int64_t max_seq_len = 1024;  // learned positions (gpt) / longest sequence (llama)
  int64_t num_layers = 12;
  int64_t dim = 768;
  int64_t num_heads = 12;
  int64_t num_kv_heads = 0;  // llama grouped-query attention; 0 = num_heads
  int64_t ffn_dim = 3072;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;

  int64_t head_dim() const { return dim / num_heads; }
  int64_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  // Throws bmt::core::Error naming the inconsistent field (dim % heads, heads % kv_heads, positive sizes).
  void validate() const;
  // Throws bmt::core::Error naming the layer and the sizes when tp_size does not divide the attention heads,
  // kv heads (llama), ffn_dim or vocab_size.
  void validate_tensor_parallel(int tp_size) const;
  std::string describe() const;  // "gpt L2 d64 h4 ff256 vocab13 seq64"
};

struct ParallelOptions {
  // A constructor, not an aggregate: {zero, checkpointing} braces stay valid without naming tp_plan.
  ParallelOptions(int zero = 3, bool checkpoint = false, std::optional<bmt::nn::TpPlan> plan = std::nullopt)
      : zero_level(zero), checkpointing(checkpoint), tp_plan(std::move(plan)) {}
  int zero_level = 3;          // 2 or 3, for every Block
  bool checkpointing = false;  // recompute each layer's forward in backward
  // FP8 GEMMs in every transformer layer's linears (gpt and llama, any tp: PlannedLinear::set_fp8): q/k/v, the
  // attention output and the MLP. Embeddings and the LM head stay in the parameter dtype, and so do the layers
  // listed in fp8_bf16_layers (indices; negative ones count from the end, -1 the last), e.g. {0, -1} for the first
  // and last layers, which FP8 recipes often keep in bf16. Default: none (every layer FP8, as measured).
  bool fp8 = false;
  std::vector<int64_t> fp8_bf16_layers;
  // Which linears of an FP8 layer run in FP8: "all" (default), "mlp" (the attention's q/k/v and output stay in the
  // parameter dtype) or "attn" (the MLP stays): a fidelity knob, measured in BENCHMARKS.md.
  std::string fp8_linears = "all";
  // With fp8: the LM head's GEMMs in FP8 too (gpt: the tied projection of wte; llama: output). Off by default: the
  // head's logits feed the loss directly, and FP8 recipes keep it in bf16; a speed knob, measured in BENCHMARKS.md.
  bool fp8_head = false;
  // With fp8, instead of fp8_head: only the LM head's two backward GEMMs in FP8, its forward (the logits, so the loss)
  // in the parameter dtype. fp8_head costs held-out loss at 124M (BENCHMARKS.md, session 31); this keeps most of its
  // GEMM time saved (two of the three GEMMs) with exact logits.
  bool fp8_head_backward = false;
  // The tensor-parallel layout; unset: the architecture's plan (gpt_tp_plan / llama_tp_plan) with
  // bmt::config().sequence_parallel. Ignored at tp_size 1 except for its validation.
  std::optional<bmt::nn::TpPlan> tp_plan;
  // Pipeline parallelism (bmt::config().pipe_size > 1; gpt only): the schedule of the layers' pipeline.
  bmt::PipeSchedule pipe_schedule = bmt::PipeSchedule::k1F1B;
};

// The layout every model computes on: the batch's tokens as rows (B·T flattened, row = b·T + t). Under sequence
// parallelism at tp_size > 1 (bmt::config().sequence_parallel, the default) the rows are padded to a multiple of
// tp_size and tp rank r holds the r-th contiguous chunk of them between tensor-parallel regions; otherwise every
// rank holds all rows.
struct TokenRows {
  int64_t batch = 0, seq = 0;
  int64_t rows = 0;         // B·T
  int64_t padded_rows = 0;  // rows rounded up to a multiple of tp_size (sequence parallel), else rows
  at::Tensor ids;           // (padded_rows,) int64, padding id 0
  at::Tensor positions;     // (local rows,) int64: position in its sequence of every row this rank holds
  at::Tensor shape;         // an empty (B, T, 0) tensor: carries B and T through the Blocks without data
};
TokenRows token_rows(const at::Tensor& ids);
// Inside a layer: full rows (padded_rows or rows, F) -> (B, T, F) without the padding, and back (zero padding).
at::Tensor rows_to_batch(const at::Tensor& x, const at::Tensor& shape);
at::Tensor batch_to_rows(const at::Tensor& x, const at::Tensor& shape);

class LanguageModel : public torch::nn::Module {
 public:
  // ids (B, T) int64 with T <= max_seq_len -> logits (B, T, vocab) in the parameter dtype. With a vocab-parallel
  // head (tp_size > 1): the logits of this tp rank's vocabulary slice, (B, T, vocab / tp_size) for ids
  // [tp_rank · vocab / tp_size, ...).
  at::Tensor forward(const at::Tensor& ids);
  virtual const ModelConfig& config() const = 0;

  // Mean next-token cross-entropy in fp32 of targets (B, T) after ids (B, T), with bmt::loss::fused_cross_entropy:
  // on the whole logits (in-place backward; equal to lm_loss(forward(ids), targets) to fp32 rounding), or with a
  // vocab-parallel head vocabulary-parallel (the full logits never exist; the same value on every tp rank).
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& targets);
  // forward()'s logits (..., V or V / tp) -> the argmax over the whole vocabulary (...) int64 (collective over tp).
  at::Tensor argmax_vocab(const at::Tensor& logits);
  // forward()'s logits of a few positions (..., V / tp) -> (..., V): all-gathered over tp (identity when whole).
  at::Tensor full_vocab_logits(const at::Tensor& logits);

  // Pipeline parallelism (bmt::config().pipe_size > 1, models/pipeline_lm.cpp): the layers are a
  // bmt::PipelineTransformerBlockList ("layers"); stage 0 holds the embeddings, the last stage the final norm and
  // the head (gpt: a tied copy of wte). One training step: forward and backward of ids/targets (B, T) split
  // into the pipeline's micro-batches along B, the loss scaled by `optim`; returns the mean loss on every stage.
  // loss() without grad (evaluation) runs the forward through the pipeline; forward() is not available.
  bool pipelined() const { return pipe_ != nullptr; }
  at::Tensor pipeline_step(const at::Tensor& ids, const at::Tensor& targets, bmt::optim::OptimManager& optim);

  // Total parameters (full, unsharded) and the parameters whose matmuls run per token (all but positions).
  int64_t num_params();
  // Training FLOPs per token at sequence length seq: 6·N_matmul + 12·L·d·seq (attention scores and mixing).
  double train_flops_per_token(int64_t seq);

 protected:
  // The logits of every (padded) row, (padded_rows, vocab), or this rank's vocabulary slice (vocab / tp).
  virtual at::Tensor logit_rows(const TokenRows& rows) = 0;
  // Pipelined models: the hidden rows entering layer 0 (first stage) and the logit rows from the last layer's
  // output (last stage); logit_rows(rows) == head_rows(layers(embed_rows(rows)), rows).
  virtual at::Tensor embed_rows(const TokenRows& rows);
  virtual at::Tensor head_rows(const at::Tensor& hidden, const TokenRows& rows);
  // The loss of logit_rows' output (both vocabulary layouts).
  at::Tensor rows_loss(const at::Tensor& logits, const TokenRows& rows, const at::Tensor& targets);
  // The micro-batch callbacks of a pipeline step over ids/targets (embedding on the first stage, head and loss
  // on the last), shared by training (pipeline_step) and evaluation (pipeline_eval_loss).
  struct PipelineBatch;
  bmt::PipelineTransformerBlockList::Step pipeline_callbacks(const at::Tensor& ids, const at::Tensor& targets);
  at::Tensor pipeline_eval_loss(const at::Tensor& ids, const at::Tensor& targets);
  std::shared_ptr<bmt::PipelineTransformerBlockList> pipe_;
  // Builds the num_layers Blocks of make_layer and registers them as "layers": with pipe_size > 1 this stage's
  // part as pipe_ (returns null), else a TransformerBlockList of all of them (returned).
  std::shared_ptr<bmt::TransformerBlockList> register_layers(int64_t num_layers, const bmt::BlockFactory& make_layer,
                                                             const ParallelOptions& parallel);
  // The architecture's plan unless ParallelOptions::tp_plan gives one; with the default plan also checks that
  // tp_size divides the config's sizes (ModelConfig::validate_tensor_parallel).
  bmt::nn::TpPlan plan_for(const ParallelOptions& parallel, const bmt::nn::TpPlan& default_plan) const;
  // Called by the model once its embedding and head are built: whether they are vocab-parallel. Under sequence
  // parallelism both must be (they split the token rows over tp and gather them back): error naming them otherwise.
  void set_vocab_layout(const bmt::nn::TpBuilder& tp, const std::string& embedding, bool embedding_vocab_parallel,
                        const std::string& head, bool head_vocab_parallel);

 private:
  bool vocab_parallel_logits_ = false;
};

// Builds the model of config.arch with parameters of `dtype` on bmt::config().device (uninitialised: call
// bmt::init_parameters(*model) afterwards).
// Whether transformer layer `layer` of `num_layers` runs its linears in FP8 (parallel.fp8, not in fp8_bf16_layers).
// Throws naming the index when fp8_bf16_layers holds one outside [-num_layers, num_layers).
bool fp8_layer(const ParallelOptions& parallel, int64_t layer, int64_t num_layers);
// Whether an FP8 layer's attention (attention = true) or MLP linears run in FP8 (parallel.fp8_linears); throws
// naming the value when it is not all, mlp or attn.
bool fp8_linear_group(const ParallelOptions& parallel, bool attention);
// Whether the LM head runs in FP8 (parallel.fp8_head or fp8_head_backward, the latter its backward GEMMs only);
// throws when one is set without fp8, or both are.
bool fp8_head(const ParallelOptions& parallel);

std::shared_ptr<LanguageModel> make_model(const ModelConfig& config, const ParallelOptions& parallel,
                                          at::ScalarType dtype);

// The parameter dtype for the configured device: bf16 on GPUs, fp32 on CPUs.
at::ScalarType default_param_dtype();

// Mean next-token cross-entropy in fp32: logits (B, T, V) any dtype, targets (B, T) int64 (whole vocabulary).
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace examples
