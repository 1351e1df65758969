// Import of a Hugging Face transformers GPT-2 or Llama directory (save_pretrained: config.json + *.safetensors,
// sharded with model.safetensors.index.json or not) into our models (models/gpt.h, models/llama.h), at any dp / tp
// size: the directory is read by bmt::checkpoint::HfDir (memory-mapped; each rank copies only its shards' elements).
//
// GPT-2 (model_type "gpt2", GPT2LMHeadModel or GPT2Model; the "transformer." prefix optional):
//   wte / wpe / ln_f / h.<i>.{ln_1, ln_2}          -> wte, wpe, ln_f, layers.<i>.{ln_1, ln_2}     (as is)
//   h.<i>.{attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj}.weight  Conv1D (in, out) -> our (out, in): transposed
//   c_attn's fused (3d) output is Q|K|V, the blocks our c_attn has (tp splits each block: tp_split_groups 3)
//   lm_head.weight: tied to wte (ignored when stored). config: n_layer, n_embd, n_head, n_inner (null: 4 n_embd),
//   n_positions, vocab_size, layer_norm_epsilon; activation gelu_new / gelu_pytorch_tanh (our GELU tanh).
// Llama (model_type "llama", LlamaForCausalLM):
//   model.embed_tokens -> tok_embeddings; model.layers.<i>.input_layernorm -> layers.<i>.attention_norm;
//   self_attn.{q,k,v,o}_proj -> attention.{wq,wk,wv,wo}; post_attention_layernorm -> ffn_norm;
//   mlp.{gate,down,up}_proj -> feed_forward.{w1,w2,w3}; model.norm -> norm; lm_head -> output (tied configs:
//   output starts as a copy of embed_tokens and is trained untied).
//   RoPE: transformers stores q/k permuted for its rotate_half convention (pair i with i + hd/2) — the convention
//   of models/rope.h — so the weights load unpermuted (Meta's original checkpoints, interleaved pairs, would
//   need the permutation). config: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
//   num_key_value_heads, rms_norm_eps, rope_theta (or rope_parameters.rope_theta), max_position_embeddings,
//   vocab_size; hidden_act silu; no attention / mlp biases; default RoPE only (no rope_scaling).
// The vocabulary may be padded to a multiple of tp (the caller sets vocab_size): the extra rows of the embedding
// and head load as zeros (and are exported as rows of a larger vocabulary).
// Anything else (another model_type, an activation, rope scaling, biases, a head_dim other than hidden / heads)
// throws naming the key, its value and what is supported.
#pragma once

#include <string>

#include "bmt/checkpoint/hf_dir.h"
#include "models/language_model.h"

namespace examples {

// The architecture and sizes of a Hugging Face config.json (checks above).
ModelConfig hf_model_config(const bmt::checkpoint::HfConfig& config);
ModelConfig hf_model_config(const std::string& dir);

// Our state-dict keys -> the directory's tensors (names above), and the HF tensors that may stay unused.
bmt::checkpoint::HfNameMap hf_name_map(const ModelConfig& config, bmt::checkpoint::HfDir& dir,
                                       bmt::checkpoint::HfLoadOptions* options);

// Loads the weights of `dir` into `model` (built from hf_model_config(dir)); strict. Every rank of the job calls it.
bmt::checkpoint::HfLoadStats load_hf(LanguageModel& model, const std::string& dir);

}  // namespace examples
