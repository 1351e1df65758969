#include "export/hf_import.h"

#include <algorithm>

#include "bmt/core/error.h"

namespace examples {

namespace ck = bmt::checkpoint;

namespace {

int64_t int_or(const ck::HfConfig& c, const std::string& key, int64_t fallback) {
  return c.has(key) ? c.get_int(key) : fallback;
}
double double_or(const ck::HfConfig& c, const std::string& key, double fallback) {
  return c.has(key) ? c.get_double(key) : fallback;
}
bool bool_or(const ck::HfConfig& c, const std::string& key, bool fallback) {
  return c.has(key) ? c.get_bool(key) : fallback;
}

[[noreturn]] void unsupported(const std::string& key, const std::string& value, const std::string& supported) {
  BMT_ERROR("Hugging Face import: config.json has ", key, " = ", value, ", which our model does not implement (",
            supported, ")");
}

ModelConfig gpt2_config(const ck::HfConfig& c) {
  ModelConfig m;
  m.arch = "gpt";
  m.vocab_size = c.get_int("vocab_size");
  m.max_seq_len = c.get_int("n_positions");
  m.num_layers = c.get_int("n_layer");
  m.dim = c.get_int("n_embd");
  m.num_heads = c.get_int("n_head");
  m.ffn_dim = int_or(c, "n_inner", 4 * m.dim);
  m.norm_eps = double_or(c, "layer_norm_epsilon", 1e-5);
  const std::string act = c.has("activation_function") ? c.get_string("activation_function") : "gelu_new";
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    unsupported("activation_function", c.dump("activation_function"), "gelu_new or gelu_pytorch_tanh: GELU tanh");
  if (!bool_or(c, "scale_attn_weights", true)) unsupported("scale_attn_weights", "false", "true");
  if (bool_or(c, "scale_attn_by_inverse_layer_idx", false))
    unsupported("scale_attn_by_inverse_layer_idx", "true", "false");
  if (bool_or(c, "add_cross_attention", false)) unsupported("add_cross_attention", "true", "false");
  if (!bool_or(c, "tie_word_embeddings", true))
    unsupported("tie_word_embeddings", "false", "true: our GPT-2 ties lm_head to wte");
  return m;
}

ModelConfig llama_config(const ck::HfConfig& c) {
  ModelConfig m;
  m.arch = "llama";
  m.vocab_size = c.get_int("vocab_size");
  m.max_seq_len = int_or(c, "max_position_embeddings", 2048);
  m.num_layers = c.get_int("num_hidden_layers");
  m.dim = c.get_int("hidden_size");
  m.num_heads = c.get_int("num_attention_heads");
  m.num_kv_heads = int_or(c, "num_key_value_heads", m.num_heads);
  m.ffn_dim = c.get_int("intermediate_size");
  m.norm_eps = double_or(c, "rms_norm_eps", 1e-6);
  const std::string act = c.has("hidden_act") ? c.get_string("hidden_act") : "silu";
  if (act != "silu") unsupported("hidden_act", c.dump("hidden_act"), "silu (SwiGLU)");
  if (bool_or(c, "attention_bias", false)) unsupported("attention_bias", "true", "false: no q/k/v/o biases");
  if (bool_or(c, "mlp_bias", false)) unsupported("mlp_bias", "true", "false: no MLP biases");
  if (c.has("head_dim") && c.get_int("head_dim") * m.num_heads != m.dim)
    unsupported("head_dim", c.dump("head_dim"), "hidden_size / num_attention_heads = " +
                std::to_string(m.dim / std::max<int64_t>(m.num_heads, 1)));
  if (c.has("rope_scaling")) unsupported("rope_scaling", c.dump("rope_scaling"), "null: plain RoPE");
  const ck::HfConfig rope = c.object("rope_parameters");
  if (rope.has("rope_type") && rope.get_string("rope_type") != "default")
    unsupported("rope_parameters.rope_type", rope.dump("rope_type"), "default: plain RoPE");
  m.rope_theta = rope.has("rope_theta") ? rope.get_double("rope_theta") : double_or(c, "rope_theta", 10000.0);
  return m;
}

}  // namespace

ModelConfig hf_model_config(const ck::HfConfig& c) {
  const std::string type = c.has("model_type") ? c.get_string("model_type") : "";
  ModelConfig m;
  if (type == "gpt2") {
    m = gpt2_config(c);
  } else if (type == "llama") {
    m = llama_config(c);
  } else {
    BMT_ERROR("Hugging Face import: model_type \"", type, "\" (architectures ", c.dump("architectures"),
              ") is not supported; supported: gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM)");
  }
  m.validate();
  return m;
}

ModelConfig hf_model_config(const std::string& dir) {
  ck::HfDir d(dir);
  return hf_model_config(d.config());
}

ck::HfNameMap hf_name_map(const ModelConfig& c, ck::HfDir& dir, ck::HfLoadOptions* options) {
  ck::HfNameMap map;
  auto add = [&](const std::string& ours, const std::string& theirs, bool transpose = false) {
    map[ours] = ck::HfSource{theirs, transpose, false};
  };
  auto add_vocab = [&](const std::string& ours, const std::string& theirs) {  // may be padded for tp
    map[ours] = ck::HfSource{theirs, false, true};
  };
  if (c.arch == "gpt") {
    // GPT2LMHeadModel prefixes "transformer.", a bare GPT2Model does not.
    const std::string p = dir.has("transformer.wte.weight") ? "transformer." : "";
    add_vocab("wte.weight", p + "wte.weight");
    add("wpe.weight", p + "wpe.weight");
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string ours = "layers." + std::to_string(i) + ".", hf = p + "h." + std::to_string(i) + ".";
      for (const char* ln : {"ln_1", "ln_2"})
        for (const char* w : {".weight", ".bias"}) add(ours + ln + w, hf + ln + w);
      for (const char* lin : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}) {
        add(ours + lin + ".weight", hf + lin + ".weight", /*transpose=*/true);  // Conv1D (in, out)
        add(ours + lin + ".bias", hf + lin + ".bias");
      }
      // Causal-mask buffers older transformers versions stored.
      options->ignore.insert(hf + "attn.bias");
      options->ignore.insert(hf + "attn.masked_bias");
    }
    add("ln_f.weight", p + "ln_f.weight");
    add("ln_f.bias", p + "ln_f.bias");
    options->ignore.insert("lm_head.weight");  // tied to wte
    return map;
  }
  BMT_CHECK(c.arch == "llama", "Hugging Face import: no name map for architecture ", c.arch);
  add_vocab("tok_embeddings.weight", "model.embed_tokens.weight");
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string ours = "layers." + std::to_string(i) + ".", hf = "model.layers." + std::to_string(i) + ".";
    add(ours + "attention_norm.weight", hf + "input_layernorm.weight");
    add(ours + "attention.wq.weight", hf + "self_attn.q_proj.weight");
    add(ours + "attention.wk.weight", hf + "self_attn.k_proj.weight");
    add(ours + "attention.wv.weight", hf + "self_attn.v_proj.weight");
    add(ours + "attention.wo.weight", hf + "self_attn.o_proj.weight");
    add(ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight");
    add(ours + "feed_forward.w1.weight", hf + "mlp.gate_proj.weight");
    add(ours + "feed_forward.w2.weight", hf + "mlp.down_proj.weight");
    add(ours + "feed_forward.w3.weight", hf + "mlp.up_proj.weight");
    options->ignore.insert(hf + "self_attn.rotary_emb.inv_freq");  // a buffer of older versions
  }
  add("norm.weight", "model.norm.weight");
  // Tied configs store no lm_head: the output projection starts from the embedding.
  add_vocab("output.weight", dir.has("lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight");
  return map;
}

ck::HfLoadStats load_hf(LanguageModel& model, const std::string& dir) {
  ck::HfDir d(dir);
  ck::HfLoadOptions options;
  ck::HfNameMap map = hf_name_map(model.config(), d, &options);
  if (model.pipelined()) {
    // A stage holds only its own layers (and the embedding or head of its end): the tensors of the other stages'
    // parameters are theirs to load, not unexpected here.
    auto params = model.named_parameters(true);
    auto buffers = model.named_buffers(true);
    for (const auto& [ours, src] : map)
      if (!params.contains(ours) && !buffers.contains(ours)) options.ignore.insert(src.name);
  }
  ck::HfLoadStats stats;
  ck::load_hf_safetensors(model, d, map, options, &stats);
  return stats;
}

}  // namespace examples
