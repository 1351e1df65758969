// hf_import_tool HF_DIR IDS_TXT OUT_DIR [--tp N] [--export DIR]   (under bmtrun --nproc W)
// Builds our model from HF_DIR's config.json (export/hf_import.h), loads its weights at world W and tp N
// (data parallel W / N, ZeRO-3), and writes, for test_hf_import.py:
//   OUT_DIR/logits.bin        (rank 0) float32 (rows, T, vocab) of the ids in IDS_TXT (one row per line)
//   OUT_DIR/stats-<rank>.txt  "bytes_copied bytes_needed files_mapped" of this rank's import
// A vocabulary tp does not divide is padded with zero rows; the logits keep the HF vocabulary's columns. Runs on
// the device bmt::init_distributed picks (a GPU with NCCL where one is visible).
// --export DIR writes our Hugging Face export of the loaded model (export/hf_llama.h: either architecture).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bmt/runtime/init.h"
#include "bmt/params/parameter.h"
#include "export/hf_import.h"
#include "export/hf_llama.h"

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  int tp = 1;
  std::string export_dir;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tp") && i + 1 < argc) {
      tp = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--export") && i + 1 < argc) {
      export_dir = argv[++i];
    } else {
      pos.push_back(argv[i]);
    }
  }
  if (pos.size() != 3) {
    std::fprintf(stderr, "usage: hf_import_tool HF_DIR IDS_TXT OUT_DIR [--tp N] [--export DIR]\n");
    return 2;
  }
  bmt::InitOptions init;
  init.quiet = true;
  init.tp_size = tp;
  bmt::init_distributed(init);
  examples::ModelConfig c = examples::hf_model_config(pos[0]);
  const int64_t vocab = c.vocab_size;
  c.vocab_size = (vocab + tp - 1) / tp * tp;  // padded with zero rows for tp, as train_gpt does
  auto model = examples::make_model(c, {}, at::kFloat);
  bmt::init_parameters(*model);
  const bmt::checkpoint::HfLoadStats stats = examples::load_hf(*model, pos[0]);
  std::ofstream(pos[2] + "/stats-" + std::to_string(bmt::config().rank) + ".txt")
      << stats.bytes_copied << " " << stats.bytes_needed << " " << stats.files_mapped << "\n";

  std::vector<std::vector<int64_t>> rows;
  std::ifstream in(pos[1]);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ss(line);
    rows.emplace_back();
    for (int64_t id; ss >> id;) rows.back().push_back(id);
  }
  at::Tensor ids = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())}, at::kLong);
  for (size_t r = 0; r < rows.size(); ++r)
    for (size_t t = 0; t < rows[r].size(); ++t) ids[static_cast<int64_t>(r)][static_cast<int64_t>(t)] = rows[r][t];
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = model->full_vocab_logits(model->forward(ids.to(bmt::config().device)))
                 .narrow(-1, 0, vocab)
                 .to(at::kCPU)
                 .contiguous();
  }
  if (bmt::config().rank == 0)
    std::ofstream(pos[2] + "/logits.bin", std::ios::binary)
        .write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.numel() * 4));
  if (!export_dir.empty()) examples::export_hf(*model, export_dir);
  bmt::finalize();
  return 0;
}
