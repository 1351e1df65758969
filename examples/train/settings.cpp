#include "train/settings.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#ifdef BMT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "export/hf_import.h"
#include "models/presets.h"
#include "train/progress.h"

namespace examples {

int64_t seq_dependent_nbytes(const ModelConfig& mc, int64_t batch, int64_t seq, int tp, bool checkpointing,
                             int64_t element_nbytes) {
  // In double: an absurd --seq must give a huge number, not an overflow.
  const double tokens = static_cast<double>(batch) * static_cast<double>(seq), elt = static_cast<double>(element_nbytes);
  // Per layer and token: the layer input, q/k/v/attention output (4 dim), two norms (2 dim), the ff activations
  // (2 ffn / tp); checkpointing keeps only the layer inputs plus one layer's worth.
  const double layer = (7.0 * mc.dim + 2.0 * mc.ffn_dim / tp) * elt;
  const double layers = checkpointing ? mc.num_layers * mc.dim * elt + layer : mc.num_layers * layer;
  const double logits = 2.0 * (mc.vocab_size / tp) * 4;  // fp32 logits and their gradient
  const double positions = mc.arch == "gpt" ? static_cast<double>(seq) * mc.dim * 4 * 4 : 0;  // weight, grad, Adam
  const double total = tokens * (layers + logits) + positions;
  return total >= 9e18 ? int64_t{9'000'000'000'000'000'000} : static_cast<int64_t>(total);
}

int64_t rank_memory_nbytes() {
  const auto& cfg = bmt::config();
#ifdef BMT_WITH_CUDA
  if (cfg.device.is_cuda()) {
    size_t free_nbytes = 0, total_nbytes = 0;
    if (cudaMemGetInfo(&free_nbytes, &total_nbytes) == cudaSuccess) return static_cast<int64_t>(total_nbytes);
  }
#endif
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") return kib * 1024 / std::max(1, cfg.local_size);
    meminfo.ignore(1 << 10, '\n');
  }
  return 0;  // unknown: no check
}

TrainSettings resolve_settings(const TrainArgs& args, const Dataset& data) {
  const auto& cfg = bmt::config();
  BMT_CHECK(args.tp == cfg.tp_size, "train: --tp ", args.tp, " but bmtrain was initialised with tp_size ", cfg.tp_size);
  TrainSettings s;
  s.dp = cfg.tp_zero_size;  // every rank of a tp group gets the same batch
  s.dp_rank = cfg.tp_zero_rank;
  const Preset& preset = find_preset(args.preset);
  ModelConfig& mc = s.model;
  mc = preset.model;
  mc.arch = args.model;
  mc.vocab_size = data.vocab_size();
  if (!args.init_from.empty()) {
    // The architecture and sizes of the Hugging Face model; its vocabulary cannot be padded (loaded rows).
    mc = hf_model_config(args.init_from);
    BMT_CHECK(data.vocab_size() <= mc.vocab_size, "--init-from ", args.init_from, ": the data has ",
              data.vocab_size(), " token ids but the model's vocabulary is ", mc.vocab_size,
              "; use data tokenised for that model");
    if (mc.vocab_size % cfg.tp_size != 0) {  // zero rows past the loaded ones (export/hf_import.h)
      const int64_t padded = (mc.vocab_size + cfg.tp_size - 1) / cfg.tp_size * cfg.tp_size;
      if (cfg.rank == 0)
        std::printf("vocabulary of %s padded from %ld to %ld ids for --tp %d (zero rows)\n", args.init_from.c_str(),
                    static_cast<long>(mc.vocab_size), static_cast<long>(padded), cfg.tp_size);
      mc.vocab_size = padded;
    }
    BMT_CHECK(args.seq <= mc.max_seq_len, "--seq ", args.seq, " exceeds the ", mc.max_seq_len,
              " positions of ", args.init_from);
    s.seq = args.seq > 0 ? args.seq : std::min(preset.model.max_seq_len, mc.max_seq_len);
  } else if (mc.vocab_size % cfg.tp_size != 0) {  // vocabulary-parallel layers need a multiple of tp (never sampled)
    mc.vocab_size = (mc.vocab_size + cfg.tp_size - 1) / cfg.tp_size * cfg.tp_size;
    if (cfg.rank == 0)
      std::printf("vocabulary padded from %ld to %ld ids for --tp %d\n", static_cast<long>(data.vocab_size()),
                  static_cast<long>(mc.vocab_size), cfg.tp_size);
  }
  if (args.init_from.empty()) {
    mc.num_kv_heads = args.kv_heads;
    if (args.seq > 0) mc.max_seq_len = args.seq;
    s.seq = mc.max_seq_len;
  }
  s.steps = args.steps > 0 ? args.steps : preset.train.steps;
  s.stop = args.stop_at >= 0 ? std::min(args.stop_at, s.steps) : s.steps;
  s.batch = args.batch > 0                  ? args.batch
            : preset.train.global_batch > 0 ? std::max<int64_t>(1, preset.train.global_batch / s.dp)
                                            : preset.train.batch_per_rank;
  s.lr = args.lr > 0 ? args.lr : preset.train.lr;
  s.warmup = std::min(s.steps, args.warmup >= 0 ? args.warmup : preset.train.warmup_steps);
  s.eval_every = args.eval_every > 0 ? args.eval_every : preset.train.eval_every_steps;
  s.task_rows = (args.task_rows + s.dp - 1) / s.dp * s.dp;
  s.dtype = args.dtype == "fp32" ? at::kFloat : args.dtype == "bf16" ? at::kBFloat16 : default_param_dtype();

  // The held-out task (evaluated without a pipeline) feeds whole rows: the model's positions must hold them.
  if (s.task_rows > 0 && args.pp == 1) {
    if (const std::optional<TaskBatch> task = data.task_batch(1)) {
      const int64_t need_seq = task->tokens.size(1) - 1;
      BMT_CHECK(s.seq >= need_seq, "--seq ", s.seq, " is shorter than the ", need_seq, " tokens one row of the "
                "held-out task needs (", data.describe(), "); use --seq ", need_seq, " or more, or --task-rows 0 to "
                "skip the task accuracy");
    }
  }
  const int64_t need = seq_dependent_nbytes(mc, s.batch, s.seq, cfg.tp_size, args.checkpointing,
                                            at::elementSize(s.dtype));
  const int64_t have = rank_memory_nbytes();
  BMT_CHECK(have <= 0 || need <= have, "--seq ", s.seq, " with --batch ", s.batch, " needs at least ",
            format_bytes(need), " per rank for activations and logits (", mc.describe(), "), but this rank has ",
            format_bytes(have), " (", cfg.device.is_cuda() ? "GPU memory" : "available host memory / ranks on this node",
            "); lower --seq or --batch", args.checkpointing ? "" : ", or add --checkpointing");
  return s;
}

}  // namespace examples
