#include "export/hf_gpt2.h"

#include <filesystem>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "train/checkpoint.h"

namespace examples {

NamedTensors to_hf_gpt2(const bmt::StateDict& state, const ModelConfig& c) {
  BMT_CHECK(c.arch == "gpt", "Hugging Face GPT-2 export needs a gpt model, got ", c.arch);
  auto get = [&](const std::string& key) {
    auto it = state.find(key);
    BMT_CHECK(it != state.end(), "HF export: missing key '", key, "' in the model state");
    return it->second.detach().to(at::kFloat).cpu().contiguous();
  };
  NamedTensors out;
  out.emplace_back("transformer.wte.weight", get("wte.weight"));
  out.emplace_back("transformer.wpe.weight", get("wpe.weight"));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string ours = "layers." + std::to_string(i) + ".", hf = "transformer.h." + std::to_string(i) + ".";
    for (const char* ln : {"ln_1", "ln_2"}) {
      out.emplace_back(hf + ln + ".weight", get(ours + ln + ".weight"));
      out.emplace_back(hf + ln + ".bias", get(ours + ln + ".bias"));
    }
    for (const char* lin : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}) {
      out.emplace_back(hf + lin + ".weight", get(ours + lin + ".weight").t().contiguous());  // Conv1D: (in, out)
      out.emplace_back(hf + lin + ".bias", get(ours + lin + ".bias"));
    }
  }
  out.emplace_back("transformer.ln_f.weight", get("ln_f.weight"));
  out.emplace_back("transformer.ln_f.bias", get("ln_f.bias"));
  return out;
}

std::string hf_gpt2_config_json(const ModelConfig& c) {
  char eps[32];
  std::snprintf(eps, sizeof eps, "%.10g", c.norm_eps);
  auto kv = [](const std::string& k, const std::string& v) { return "  " + json_quote(k) + ": " + v; };
  std::vector<std::string> lines = {
      kv("architectures", "[\"GPT2LMHeadModel\"]"),
      kv("model_type", "\"gpt2\""),
      kv("vocab_size", std::to_string(c.vocab_size)),
      kv("n_positions", std::to_string(c.max_seq_len)),
      kv("n_ctx", std::to_string(c.max_seq_len)),
      kv("n_embd", std::to_string(c.dim)),
      kv("n_layer", std::to_string(c.num_layers)),
      kv("n_head", std::to_string(c.num_heads)),
      kv("n_inner", std::to_string(c.ffn_dim)),
      kv("activation_function", "\"gelu_new\""),
      kv("layer_norm_epsilon", eps),
      kv("resid_pdrop", "0.0"),
      kv("embd_pdrop", "0.0"),
      kv("attn_pdrop", "0.0"),
      kv("initializer_range", "0.02"),
      kv("scale_attn_weights", "true"),
      kv("tie_word_embeddings", "true"),
      kv("torch_dtype", "\"float32\""),
  };
  std::string json = "{\n";
  for (size_t i = 0; i < lines.size(); ++i) json += lines[i] + (i + 1 < lines.size() ? ",\n" : "\n");
  return json + "}\n";
}

void export_hf_gpt2(LanguageModel& model, const std::string& dir) {
  const ModelConfig& c = model.config();
  BMT_CHECK(c.arch == "gpt", "--export-hf supports the gpt model only (got ", c.arch, ")");
  bmt::StateDict state = bmt::state_dict(model);  // collective
  if (bmt::rank() == 0) {
    std::filesystem::create_directories(dir);
    write_safetensors(dir + "/model.safetensors", to_hf_gpt2(state, c));
    write_file_atomic(dir + "/config.json", hf_gpt2_config_json(c));
  }
  bmt::synchronize();
}

}  // namespace examples
