#include "models/language_model.h"

#include "bmt/core/error.h"
#include "bmt/init.h"
#include "bmt/parameter.h"
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

std::string ModelConfig::describe() const {
  std::string s = arch + " L" + std::to_string(num_layers) + " d" + std::to_string(dim) + " h" +
                  std::to_string(num_heads);
  if (arch == "llama" && kv_heads() != num_heads) s += " kv" + std::to_string(kv_heads());
  return s + " ff" + std::to_string(ffn_dim) + " vocab" + std::to_string(vocab_size) + " seq" +
         std::to_string(max_seq_len);
}

int64_t LanguageModel::num_params() {
  int64_t n = 0;
  for (const auto& p : parameters()) n += bmt::meta_of(p).full_numel;
  return n;
}

double LanguageModel::train_flops_per_token(int64_t seq) {
  int64_t matmul_params = 0;
  for (const auto& item : named_parameters()) {
    if (item.key() == "wpe.weight") continue;  // position lookup: no matmul
    matmul_params += bmt::meta_of(item.value()).full_numel;
  }
  const ModelConfig& c = config();
  return 6.0 * static_cast<double>(matmul_params) +
         12.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.dim) * static_cast<double>(seq);
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
