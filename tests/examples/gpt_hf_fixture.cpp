// gpt_hf_fixture OUT_DIR: builds a tiny GPT with random values in every parameter, exports it in the Hugging
// Face GPT-2 layout to OUT_DIR, and writes our logits for fixed token ids:
//   OUT_DIR/ids.txt      one row of space-separated token ids per line
//   OUT_DIR/logits.bin   float32 (rows, T, vocab), row-major, little-endian
// test_hf_export.py loads the export with transformers and compares.
#include <cstdio>
#include <fstream>

#include "bmt/runtime/init.h"
#include "bmt/params/module_state.h"
#include "export/hf_gpt2.h"
#include "models/gpt.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gpt_hf_fixture OUT_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  bmt::InitOptions init;
  init.quiet = true;
  bmt::init_distributed(init);
  examples::ModelConfig c;
  c.vocab_size = 61;
  c.max_seq_len = 16;
  c.num_layers = 2;
  c.dim = 32;
  c.num_heads = 4;
  c.ffn_dim = 48;
  examples::Gpt model(c, {}, at::kFloat);
  bmt::init_parameters(model);
  at::manual_seed(21);
  bmt::StateDict random;
  for (auto& [key, t] : bmt::state_dict(model)) random[key] = at::randn_like(t) * 0.2;
  bmt::load_state_dict(model, random);

  examples::export_hf_gpt2(model, dir);
  at::Tensor ids = at::randint(0, c.vocab_size, {3, c.max_seq_len}, at::TensorOptions().dtype(at::kLong));
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = model.forward(ids).contiguous();
  }
  std::ofstream(dir + "/logits.bin", std::ios::binary)
      .write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.numel() * 4));
  std::ofstream txt(dir + "/ids.txt");
  for (int64_t r = 0; r < ids.size(0); ++r) {
    for (int64_t t = 0; t < ids.size(1); ++t) txt << (t ? " " : "") << ids[r][t].item<int64_t>();
    txt << "\n";
  }
  bmt::finalize();
  return 0;
}
