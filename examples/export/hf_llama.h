// Export of our Llama (models/llama.h) to the Hugging Face transformers layout (LlamaForCausalLM), the inverse of
// export/hf_import.h's Llama map:
//   dir/model.safetensors   fp32 model.embed_tokens, model.layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj,
//                           post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head (untied)
//   dir/config.json         LlamaConfig: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
//                           num_key_value_heads, rms_norm_eps, rope_theta (also as rope_parameters, transformers 5),
//                           max_position_embeddings, vocab_size, hidden_act silu, no biases, untied
// q/k need no permutation: models/rope.h uses transformers' rotate_half convention.
#pragma once

#include <string>

#include "bmt/params/module_state.h"
#include "export/safetensors.h"
#include "models/language_model.h"

namespace examples {

NamedTensors to_hf_llama(const bmt::StateDict& state, const ModelConfig& config);
std::string hf_llama_config_json(const ModelConfig& config);

// Collective (gathers the parameters); rank 0 writes the files. Throws for a non-Llama model.
void export_hf_llama(LanguageModel& model, const std::string& dir);

// export_hf_gpt2 or export_hf_llama by the model's architecture.
void export_hf(LanguageModel& model, const std::string& dir);

}  // namespace examples
