// TrainArgs: every option of train_gpt, their defaults, and the command-line parser.
// Values left at -1 / empty are filled from the preset (models/presets.h) by resolve_settings (settings.h);
// values given on the command line are checked here (a negative or zero --steps is an error, not "the default").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace examples {

struct TrainArgs {
  std::string preset = "tiny";
  std::string model = "gpt";        // gpt | llama
  int64_t kv_heads = 0;             // llama grouped-query attention (0: = heads)
  std::string data;                 // empty: embedded synthetic arithmetic
  std::string data_format = "auto";  // auto | synthetic | text | bin | llm.c | nanoGPT
  int64_t steps = -1, batch = -1, seq = -1, warmup = -1;  // batch: sequences per rank per step
  int64_t stop_at = -1;             // end this run after this step (the schedule still spans --steps)
  double lr = -1;                   // peak learning rate
  double weight_decay = 0.1, grad_clip = 1.0;
  std::string dtype = "auto";        // parameter dtype: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
  int zero = 3;
  int tp = 1;                        // tensor-parallel size (heads, ff and vocabulary split over tp ranks)
  int pp = 1;                        // pipeline stages (layers split over stages; gpt only)
  int micro_batches = 0;             // pipeline micro-batches per step (0: 2 x pp)
  std::string pp_schedule = "1f1b";  // 1f1b | gpipe
  bool checkpointing = false;
  bool fp8 = false;                  // --fp8: FP8 GEMMs in the transformer layers (ParallelOptions::fp8)
  std::vector<int64_t> fp8_bf16_layers;  // --fp8-bf16-layers 0,-1: layers kept in the parameter dtype
  std::string fp8_linears = "all";      // --fp8-linears all|mlp|attn: which linears of a layer
  bool fp8_head = false;                 // --fp8-head: the LM head in FP8 too (ParallelOptions::fp8_head)
  bool fp8_head_backward = false;        // --fp8-head-backward: its backward GEMMs only (ParallelOptions::fp8_head_backward)
  std::string fp8_recipe;                // --fp8-recipe current|delayed (empty: BMT_FP8_RECIPE's, nn::fp8_recipe)
  bool cuda_graphs = false;          // --cuda-graphs: forward + backward replayed as one CUDA graph (bmt::CudaGraphStep)
  bool no_cuda_graphs = false;       // --no-cuda-graphs: eager even where graphs are the default
  int64_t eval_every = -1, eval_batches = 4, task_rows = 256;
  int64_t save_every = 0;
  std::string save_dir = "checkpoints";
  bool save_dir_given = false;      // --save-dir on the command line (then a checkpoint at the end at least)
  bool overwrite_checkpoints = false;  // a fresh run may delete another run's checkpoints in save_dir
  int64_t keep_last = 0;            // keep the newest K step folders (0: all)
  bool async_save = false;          // write checkpoints in the background (committed at the next save / the end)
  bool resume = false;
  int64_t max_skipped_steps = 20;   // stop with an error after this many inf/NaN steps in a row
  double divergence_factor = 3;     // a loss above this x the run's lowest loss is suspect (0: guard off)
  int64_t divergence_steps = 10;    // ... for this many steps in a row: stop without saving (divergence_guard.h)
  std::string metrics_path;
  int64_t inspect_every = 0;        // > 0: inspect_model statistics into the metrics file every N steps
  std::string progress = "auto";    // auto (bar on a TTY, else lines) | bar | lines | off
  int64_t log_every = -1;           // lines mode: print every N steps (-1: ~30 lines per run)
  int64_t samples = 3, sample_tokens = 64, top_k = 0;  // top_k 0: greedy
  std::string export_hf;            // directory for a Hugging Face GPT-2 / Llama export at the end
  std::string init_from;            // Hugging Face directory to fine-tune (export/hf_import.h)
  uint64_t seed = 1234;
  bool help = false;
  // Whether this run writes checkpoints: every save_every steps, and at the end once --save-dir or --save-every
  // is given.
  bool saves() const { return save_every > 0 || save_dir_given; }
};

// Throws bmt::core::Error naming the bad option (unknown, missing value, not a number).
TrainArgs parse_train_args(int argc, const char* const* argv);
std::string train_usage();

}  // namespace examples
