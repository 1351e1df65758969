// Export of our GPT (models/gpt.h) to the Hugging Face transformers GPT-2 layout (GPT2LMHeadModel):
//   dir/model.safetensors   fp32 tensors under transformer.wte/wpe/h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,
//                           mlp.c_fc,mlp.c_proj}/ln_f; Conv1D weights transposed to (in, out); lm_head.weight is
//                           tied to wte and not stored (like the official checkpoints)
//   dir/config.json         GPT2Config: n_embd, n_layer, n_head, n_inner, n_positions, vocab_size,
//                           activation_function gelu_new (= GELU tanh), layer_norm_epsilon, dropout 0
#pragma once

#include <string>

#include "bmt/params/module_state.h"
#include "export/safetensors.h"
#include "models/language_model.h"

namespace examples {

// Our consolidated state dict (bmt::state_dict of a Gpt) -> HF names and layouts. Throws on missing keys.
NamedTensors to_hf_gpt2(const bmt::StateDict& state, const ModelConfig& config);
std::string hf_gpt2_config_json(const ModelConfig& config);

// Collective (gathers the parameters); rank 0 writes the files. Throws for a non-GPT model.
void export_hf_gpt2(LanguageModel& model, const std::string& dir);

}  // namespace examples
