#include "export/hf_llama.h"

#include <cstdio>
#include <filesystem>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "export/hf_gpt2.h"
#include "train/checkpoint.h"

namespace examples {

NamedTensors to_hf_llama(const bmt::StateDict& state, const ModelConfig& c) {
  BMT_CHECK(c.arch == "llama", "Hugging Face Llama export needs a llama model, got ", c.arch);
  auto get = [&](const std::string& key) {
    auto it = state.find(key);
    BMT_CHECK(it != state.end(), "HF export: missing key '", key, "' in the model state");
    return it->second.detach().to(at::kFloat).cpu().contiguous();
  };
  NamedTensors out;
  out.emplace_back("model.embed_tokens.weight", get("tok_embeddings.weight"));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string ours = "layers." + std::to_string(i) + ".", hf = "model.layers." + std::to_string(i) + ".";
    out.emplace_back(hf + "input_layernorm.weight", get(ours + "attention_norm.weight"));
    out.emplace_back(hf + "self_attn.q_proj.weight", get(ours + "attention.wq.weight"));
    out.emplace_back(hf + "self_attn.k_proj.weight", get(ours + "attention.wk.weight"));
    out.emplace_back(hf + "self_attn.v_proj.weight", get(ours + "attention.wv.weight"));
    out.emplace_back(hf + "self_attn.o_proj.weight", get(ours + "attention.wo.weight"));
    out.emplace_back(hf + "post_attention_layernorm.weight", get(ours + "ffn_norm.weight"));
    out.emplace_back(hf + "mlp.gate_proj.weight", get(ours + "feed_forward.w1.weight"));
    out.emplace_back(hf + "mlp.up_proj.weight", get(ours + "feed_forward.w3.weight"));
    out.emplace_back(hf + "mlp.down_proj.weight", get(ours + "feed_forward.w2.weight"));
  }
  out.emplace_back("model.norm.weight", get("norm.weight"));
  out.emplace_back("lm_head.weight", get("output.weight"));
  return out;
}

std::string hf_llama_config_json(const ModelConfig& c) {
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    std::string s = buf;
    return s.find_first_of(".e") == std::string::npos ? s + ".0" : s;
  };
  auto kv = [](const std::string& k, const std::string& v) { return "  " + json_quote(k) + ": " + v; };
  std::vector<std::string> lines = {
      kv("architectures", "[\"LlamaForCausalLM\"]"),
      kv("model_type", "\"llama\""),
      kv("vocab_size", std::to_string(c.vocab_size)),
      kv("max_position_embeddings", std::to_string(c.max_seq_len)),
      kv("hidden_size", std::to_string(c.dim)),
      kv("intermediate_size", std::to_string(c.ffn_dim)),
      kv("num_hidden_layers", std::to_string(c.num_layers)),
      kv("num_attention_heads", std::to_string(c.num_heads)),
      kv("num_key_value_heads", std::to_string(c.kv_heads())),
      kv("head_dim", std::to_string(c.head_dim())),
      kv("hidden_act", "\"silu\""),
      kv("rms_norm_eps", num(c.norm_eps)),
      kv("rope_theta", num(c.rope_theta)),
      kv("rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": " + num(c.rope_theta) + "}"),
      kv("attention_bias", "false"),
      kv("attention_dropout", "0.0"),
      kv("mlp_bias", "false"),
      kv("initializer_range", "0.02"),
      kv("tie_word_embeddings", "false"),
      kv("torch_dtype", "\"float32\""),
  };
  std::string json = "{\n";
  for (size_t i = 0; i < lines.size(); ++i) json += lines[i] + (i + 1 < lines.size() ? ",\n" : "\n");
  return json + "}\n";
}

void export_hf_llama(LanguageModel& model, const std::string& dir) {
  const ModelConfig& c = model.config();
  BMT_CHECK(c.arch == "llama", "Hugging Face Llama export needs a llama model (got ", c.arch, ")");
  bmt::StateDict state = bmt::state_dict(model);  // collective
  if (bmt::rank() == 0) {
    std::filesystem::create_directories(dir);
    write_safetensors(dir + "/model.safetensors", to_hf_llama(state, c));
    write_file_atomic(dir + "/config.json", hf_llama_config_json(c));
  }
  bmt::synchronize();
}

void export_hf(LanguageModel& model, const std::string& dir) {
  if (model.config().arch == "llama")
    export_hf_llama(model, dir);
  else
    export_hf_gpt2(model, dir);
}

}  // namespace examples
