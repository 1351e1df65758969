#include "models/language_model.h"

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "bmt/params/parameter.h"
#include "models/gpt.h"
#include "models/llama.h"

namespace examples {

void ModelConfig::validate() const {
  BMT_CHECK(arch == "gpt" || arch == "llama", "model: unknown architecture '", arch, "' (expected gpt or llama)");
  BMT_CHECK(vocab_size > 0 && max_seq_len > 0 && num_layers > 0 && dim > 0 && num_heads > 0 && ffn_dim > 0,
            "model: every size must be positive (", describe(), ")");
  BMT_CHECK(dim % num_heads == 0, "model: dim ", dim, " is not a multiple of num_heads ", num_heads);
  BMT_CHECK(kv_heads() <= num_heads && num_heads % kv_heads() == 0, "model: num_heads ", num_heads,
            " is not a multiple of num_kv_heads ", kv_heads());
  BMT_CHECK(arch != "llama" || head_dim() % 2 == 0, "model: rotary embeddings need an even head_dim, got ", head_dim());
}

void ModelConfig::validate_tensor_parallel(int tp) const {
  if (tp <= 1) return;
  const std::string who = "model " + describe() + " at tp_size " + std::to_string(tp) + ": ";
  auto check = [&](int64_t n, const char* what, const char* layers) {
    BMT_CHECK(n % tp == 0, who, what, " = ", n, " is not divisible by tp_size ", tp, " (", layers,
              " are split over the tp ranks); choose a tp_size that divides it");
  };
  const bool gpt = arch == "gpt";
  check(num_heads, "num_heads", gpt ? "the heads of layers.*.attn.c_attn / attn.c_proj"
                                    : "the query heads of layers.*.attention.wq / attention.wo");
  if (!gpt) check(kv_heads(), "num_kv_heads", "the kv heads of layers.*.attention.wk / attention.wv");
  check(ffn_dim, "ffn_dim", gpt ? "the features of layers.*.mlp.c_fc / mlp.c_proj"
                                : "the features of layers.*.feed_forward.w1 / w3 / w2");
  check(vocab_size, "vocab_size", gpt ? "the vocabulary rows of wte (embedding and tied projection)"
                                      : "the vocabulary rows of tok_embeddings and output");
}

std::string ModelConfig::describe() const {
  std::string s = arch + " L" + std::to_string(num_layers) + " d" + std::to_string(dim) + " h" +
                  std::to_string(num_heads);
  if (arch == "llama" && kv_heads() != num_heads) s += " kv" + std::to_string(kv_heads());
  return s + " ff" + std::to_string(ffn_dim) + " vocab" + std::to_string(vocab_size) + " seq" +
         std::to_string(max_seq_len);
}

namespace {

// Elements of the whole (unsplit) parameter.
int64_t logical_numel(const at::Tensor& p) {
  int64_t n = 1;
  for (int64_t d : bmt::meta_of(p).logical_shape()) n *= d;
  return n;
}

int64_t padded_row_count(int64_t rows) {
  const bmt::Config& cfg = bmt::config();
  if (cfg.tp_size <= 1 || !cfg.sequence_parallel) return rows;
  return (rows + cfg.tp_size - 1) / cfg.tp_size * cfg.tp_size;
}

}  // namespace

TokenRows token_rows(const at::Tensor& ids) {
  const bmt::Config& cfg = bmt::config();
  BMT_CHECK(ids.dim() == 2, "model: ids must be (batch, seq), got shape ", ids.sizes());
  TokenRows r;
  r.batch = ids.size(0);
  r.seq = ids.size(1);
  r.rows = r.batch * r.seq;
  r.padded_rows = padded_row_count(r.rows);
  at::Tensor flat = ids.reshape({-1});
  r.ids = r.padded_rows > r.rows ? at::cat({flat, at::zeros({r.padded_rows - r.rows}, flat.options())}) : flat;
  const bool split = cfg.tp_size > 1 && cfg.sequence_parallel;
  const int64_t local = split ? r.padded_rows / cfg.tp_size : r.padded_rows;
  const int64_t begin = split ? local * cfg.tp_rank : 0;
  r.positions = at::arange(begin, begin + local, ids.options().dtype(at::kLong)).remainder(std::max<int64_t>(r.seq, 1));
  r.shape = at::empty({r.batch, r.seq, 0}, ids.options());
  return r;
}

at::Tensor rows_to_batch(const at::Tensor& x, const at::Tensor& shape) {
  const int64_t B = shape.size(0), T = shape.size(1);
  // narrow() only where there are padding rows: its backward allocates a zero tensor of x's size and copies the
  // gradient in, even when the slice is the whole tensor (a logits-sized buffer for the language-model head).
  const at::Tensor rows = x.size(0) == B * T ? x : x.narrow(0, 0, B * T);
  return rows.reshape({B, T, x.size(-1)});
}

at::Tensor batch_to_rows(const at::Tensor& x, const at::Tensor& shape) {
  const int64_t rows = shape.size(0) * shape.size(1), padded = padded_row_count(rows);
  at::Tensor y = x.reshape({rows, x.size(-1)});
  return padded > rows ? at::constant_pad_nd(y, {0, 0, 0, padded - rows}) : y;
}

at::Tensor LanguageModel::forward(const at::Tensor& ids) {
  BMT_CHECK(!pipelined(), "model: forward() (whole logits) is not available with pipeline parallelism (pipe_size ",
            bmt::config().pipe_size, "): train with pipeline_step and evaluate with loss(), or run at pipe_size 1");
  TokenRows rows = token_rows(ids);
  at::Tensor logits = logit_rows(rows);
  return rows_to_batch(logits, rows.shape);
}

at::Tensor LanguageModel::loss(const at::Tensor& ids, const at::Tensor& targets) {
  BMT_CHECK(targets.sizes() == ids.sizes(), "model: targets of shape ", targets.sizes(), " for ids of shape ",
            ids.sizes());
  if (pipelined()) return pipeline_eval_loss(ids, targets);
  TokenRows rows = token_rows(ids);
  return rows_loss(logit_rows(rows), rows, targets);
}

at::Tensor LanguageModel::rows_loss(const at::Tensor& logit_rows_out, const TokenRows& rows, const at::Tensor& targets) {
  bmt::loss::FusedCrossEntropyOptions o;
  if (!vocab_parallel_logits_) {
    // The fused kernel keeps only the parameter-dtype logits for the backward and writes the gradient over them;
    // the unfused fp32 path (lm_loss) holds several fp32 copies of the (B·T, V) logits at the memory peak.
    o.inplace = true;
    at::Tensor logits = rows_to_batch(logit_rows_out, rows.shape);
    return bmt::loss::fused_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(at::kLong),
                                          o);
  }
  at::Tensor t = targets.reshape({-1}).to(at::kLong);
  if (rows.padded_rows > rows.rows)
    t = at::cat({t, at::full({rows.padded_rows - rows.rows}, o.ignore_index, t.options())});
  o.parallel = true;
  return bmt::loss::fused_cross_entropy(logit_rows_out, t, o);
}

at::Tensor LanguageModel::argmax_vocab(const at::Tensor& logits) {
  const bmt::Config& cfg = bmt::config();
  if (!vocab_parallel_logits_) return logits.argmax(-1);
  at::NoGradGuard no_grad;
  auto [values, index] = logits.max(-1);
  index = index + static_cast<int64_t>(cfg.tp_rank) * logits.size(-1);
  // (tp, ...): every rank's best; the first rank with the largest value wins (argmax's first-index rule).
  at::Tensor all_values = bmt::distributed::raw_all_gather(values.to(at::kFloat).contiguous(), *cfg.tp_comm);
  at::Tensor all_index = bmt::distributed::raw_all_gather(index.contiguous(), *cfg.tp_comm);
  return all_index.gather(0, all_values.argmax(0, /*keepdim=*/true)).squeeze(0);
}

at::Tensor LanguageModel::full_vocab_logits(const at::Tensor& logits) {
  const bmt::Config& cfg = bmt::config();
  if (!vocab_parallel_logits_) return logits;
  at::NoGradGuard no_grad;
  at::Tensor all = bmt::distributed::raw_all_gather(logits.contiguous(), *cfg.tp_comm);  // (tp, ..., V / tp)
  return at::cat(all.unbind(0), -1);
}

std::shared_ptr<bmt::TransformerBlockList> LanguageModel::register_layers(int64_t num_layers,
                                                                          const bmt::BlockFactory& make_layer,
                                                                          const ParallelOptions& parallel) {
  if (bmt::config().topology.pipe_size > 1) {
    bmt::PipelineOptions po;
    po.schedule = parallel.pipe_schedule;
    pipe_ = register_module("layers", std::make_shared<bmt::PipelineTransformerBlockList>(num_layers, make_layer, po));
    return nullptr;
  }
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < num_layers; ++i) blocks.push_back(make_layer(i));
  return register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
}

bmt::nn::TpPlan LanguageModel::plan_for(const ParallelOptions& parallel, const bmt::nn::TpPlan& default_plan) const {
  if (parallel.tp_plan) return *parallel.tp_plan;
  config().validate_tensor_parallel(bmt::config().tp_size);
  return default_plan;
}

void LanguageModel::set_vocab_layout(const bmt::nn::TpBuilder& tp, const std::string& embedding,
                                     bool embedding_vocab_parallel, const std::string& head,
                                     bool head_vocab_parallel) {
  auto style = [](bool vp, const char* name) { return vp ? name : "replicated"; };
  BMT_CHECK(!tp.sequence_parallel() || (embedding_vocab_parallel && head_vocab_parallel), "model ",
            config().describe(), ": under sequence parallelism the token embedding '", embedding,
            "' and the output head '", head, "' split the token rows over tp and gather them back, so the tp plan "
            "must make them vocab_embedding and vocab_head; it makes them ",
            style(embedding_vocab_parallel, "vocab_embedding"), " and ", style(head_vocab_parallel, "vocab_head"),
            " (or turn sequence parallelism off)");
  vocab_parallel_logits_ = head_vocab_parallel;
}

int64_t LanguageModel::num_params() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += logical_numel(p);
  return n;
}

double LanguageModel::train_flops_per_token(int64_t seq) {
  int64_t matmul_params = 0;
  for (const auto& item : named_parameters()) {
    if (item.key() == "wpe.weight") continue;  // position lookup: no matmul
    matmul_params += logical_numel(item.value());
  }
  const ModelConfig& c = config();
  return 6.0 * static_cast<double>(matmul_params) +
         12.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.dim) * static_cast<double>(seq);
}

bool fp8_layer(const ParallelOptions& parallel, int64_t layer, int64_t num_layers) {
  bool keep = false;
  for (int64_t i : parallel.fp8_bf16_layers) {
    BMT_CHECK(i >= -num_layers && i < num_layers, "model: fp8_bf16_layers (--fp8-bf16-layers) names layer ", i,
              ", but the model has ", num_layers, " layers (use 0..", num_layers - 1, ", or -1 for the last)");
    keep = keep || (i < 0 ? i + num_layers : i) == layer;
  }
  return parallel.fp8 && !keep;
}

bool fp8_linear_group(const ParallelOptions& parallel, bool attention) {
  const std::string& g = parallel.fp8_linears;
  BMT_CHECK(g == "all" || g == "mlp" || g == "attn", "model: fp8_linears (--fp8-linears) must be all, mlp or attn, "
            "got '", g, "'");
  return g == "all" || (g == "attn") == attention;
}

bool fp8_head(const ParallelOptions& parallel) {
  BMT_CHECK(parallel.fp8 || !parallel.fp8_head, "model: fp8_head (--fp8-head) puts the LM head in FP8 beside the "
            "layers; it needs fp8 (--fp8)");
  BMT_CHECK(parallel.fp8 || !parallel.fp8_head_backward, "model: fp8_head_backward (--fp8-head-backward) puts the LM "
            "head's backward GEMMs in FP8 beside the layers; it needs fp8 (--fp8)");
  BMT_CHECK(!(parallel.fp8_head && parallel.fp8_head_backward), "model: fp8_head (--fp8-head) and fp8_head_backward "
            "(--fp8-head-backward) are two choices for the LM head; set one");
  return parallel.fp8_head || parallel.fp8_head_backward;
}

std::shared_ptr<LanguageModel> make_model(const ModelConfig& config, const ParallelOptions& parallel,
                                          at::ScalarType dtype) {
  if (config.arch == "llama") return std::make_shared<Llama>(config, parallel, dtype);
  BMT_CHECK(config.arch == "gpt", "model: unknown architecture '", config.arch, "' (expected gpt or llama)");
  return std::make_shared<Gpt>(config, parallel, dtype);
}

at::ScalarType default_param_dtype() { return bmt::config().device.is_cuda() ? at::kBFloat16 : at::kFloat; }

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets) {
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, V}), targets.reshape({-1}));
}

}  // namespace examples
