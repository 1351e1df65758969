#include "train/train_args.h"

#include <cmath>
#include <functional>
#include <map>

#include "bmt/core/error.h"
#include "bmt/nn/fp8_delayed_scale.h"

namespace examples {

std::string train_usage() {
  return R"(usage: bmtrun --nproc N train_gpt [options]
  --preset P          tiny | gpt2-124m | gpt-1.3b | gpt-6.7b | llama-7b (default tiny)
  --model M           gpt | llama (default gpt); --kv-heads K for grouped-query llama
  --data PATH         text file (byte-level) or uint16 .bin tokens (llm.c or nanoGPT layout);
                      default: embedded synthetic 2-digit addition with task accuracy
  --data-format F     auto | synthetic | text | bin | llm.c | nanoGPT
  --steps S --batch B --seq T --lr LR --warmup W   (B: sequences per data-parallel rank per step; default
                      from the preset: tiny 64 over all, gpt2-124m 16, gpt-1.3b 8, gpt-6.7b and llama-7b 2)
  --stop-at S         end this run after step S (schedule still spans --steps; resume later with --resume)
  --weight-decay WD --grad-clip C                  (default 0.1, 1.0)
  --zero 2|3          ZeRO level of every transformer block (default 3)
  --tp N              tensor parallelism (default 1): attention heads (and llama kv heads), ff features and
                      the vocabulary are split over groups of N consecutive ranks (sequence-parallel layout);
                      data parallelism over the world / N groups (every rank of a group gets the same batch;
                      B counts per group). N must divide heads, kv heads and ff (the vocabulary is padded)
  --pp N              pipeline parallelism (gpt, llama; default 1): the layers split over N stages of consecutive
                      ranks (world = pp x dp x tp), 1F1B over --micro-batches M micro-batches (default 2N;
                      B must be a multiple of M); --pp-schedule 1f1b|gpipe
  --dtype D           parameter dtype: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
  --checkpointing     recompute each block's forward in backward
  --fp8               FP8 GEMMs in the transformer layers' linears (gpt, llama, any tp; E4M3 forward, gradients E5M2 or
                      BMT_FP8_GRAD=e4m3; per-tensor dynamic scales); embeddings and the LM head stay --dtype
  --fp8-bf16-layers L layers whose linears stay --dtype under --fp8: comma-separated indices, negative from the
                      end (e.g. 0,-1: the first and the last); default none
  --fp8-linears G     which linears of an FP8 layer run in FP8: all (default), mlp (attention's q/k/v and output
                      stay --dtype) or attn (the MLP stays --dtype)
  --fp8-recipe R      with --fp8: current (each cast scaled by its tensor's own amax) | delayed (scales from the
                      last 16 amaxes, no amax passes: TransformerEngine's recipe); default BMT_FP8_RECIPE, else current
  --fp8-head          with --fp8: the LM head's GEMMs in FP8 too (gpt: wte's tied projection, llama: output);
                      default off (the head stays --dtype; in FP8 it cost ~2-3% held-out loss at 124M)
  --fp8-head-backward with --fp8, instead of --fp8-head: only the LM head's two backward GEMMs in FP8, the logits
                      (and so the loss) computed in --dtype
  --cuda-graphs       capture the forward + backward (ZeRO gathers and reductions included) as a CUDA graph
                      after 2 eager steps and replay it (bmt::CudaGraphStep; the optimizer step stays eager);
                      not with --pp; eager on CPUs (a notice). Default on for one GPU (world 1, no --pp);
                      --no-cuda-graphs turns it off (the graph's pool keeps one step's activations reserved)
  --eval-every K      held-out loss (and task accuracy) every K steps; --eval-batches N
  --save-every K --save-dir D    checkpoints every K steps and at the end: D/step_<n> (bmtrain's sharded,
                      checksummed format: model, optimizer, LR schedule, RNG; `bmt-ckpt verify D/step_<n>`)
                      and D/latest; --save-dir alone: one checkpoint at the end (default D: checkpoints);
                      --resume continues from D/latest, also at another world or tp size (optimizer state
                      resharded, not restarted). A fresh run refuses a D that already holds checkpoints
                      (another run's); --overwrite-checkpoints deletes them instead
  --async-save        write each checkpoint in the background (the state is copied first, to GPU memory when
                      it has room, else to pinned host memory, so training goes on); `latest` moves onto it
                      when the next save starts or the run ends
  --keep-last K       keep the newest K checkpoints of this run (a run id in each checkpoint's metadata, kept
                      across --resume), delete its older ones after each new one (default 0: all); other
                      runs' checkpoints are never deleted
  --max-skipped-steps N  stop with an error after N steps in a row skipped for inf/NaN (default 20); a
                      checkpoint due on a skipped step waits for the next good one
  --divergence-factor K --divergence-steps N   divergence guard for a loss that stays finite: a loss above K x
                      the lowest loss of this run is suspect (a checkpoint due then waits), N suspect steps in
                      a row stop the run with an error, without saving (default 3 and 10; K 0: off)
  --metrics PATH.jsonl           one JSON object per step (rank 0)
  --inspect-every N   every N steps, after the backward: mean/std/min/max of every parameter and of its
                      gradient (bmt::inspect::inspect_model, over all shards) in that step's metrics line,
                      as "inspect.<param>.<stat>" (default 0: off)
  --progress auto|bar|lines|off  --log-every N
  --samples N --sample-tokens N --top-k K   generated samples at the end (top-k 0: greedy)
  --init-from DIR     fine-tune a Hugging Face GPT-2 or Llama directory (save_pretrained: config.json +
                      *.safetensors, sharded or not): the architecture and sizes come from its config.json
                      (--model, --kv-heads not allowed; the preset gives only training defaults, --seq
                      at most its positions), each rank reads only its shards; the data's ids must fit its
                      vocabulary
  --export-hf DIR     write model.safetensors + config.json (Hugging Face GPT-2 or Llama layout) at the end
  --seed S
)";
}

TrainArgs parse_train_args(int argc, const char* const* argv) {
  TrainArgs a;
  auto to_i64 = [](const std::string& name, const std::string& v) {
    try {
      size_t used = 0;
      int64_t x = std::stoll(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    BMT_ERROR("option ", name, ": expected an integer, got '", v, "'");
  };
  auto to_f64 = [](const std::string& name, const std::string& v) {
    try {
      size_t used = 0;
      double x = std::stod(v, &used);
      if (used == v.size()) return x;
    } catch (const std::exception&) {
    }
    BMT_ERROR("option ", name, ": expected a number, got '", v, "'");
  };
  using Setter = std::function<void(const std::string&, const std::string&)>;
  auto str = [](std::string& dst) -> Setter { return [&dst](const std::string&, const std::string& v) { dst = v; }; };
  auto i64 = [&](int64_t& dst) -> Setter { return [&dst, to_i64](const std::string& n, const std::string& v) { dst = to_i64(n, v); }; };
  auto f64 = [&](double& dst) -> Setter { return [&dst, to_f64](const std::string& n, const std::string& v) { dst = to_f64(n, v); }; };
  const std::map<std::string, Setter> valued = {
      {"--preset", str(a.preset)}, {"--model", str(a.model)}, {"--kv-heads", i64(a.kv_heads)},
      {"--data", str(a.data)}, {"--data-format", str(a.data_format)}, {"--steps", i64(a.steps)},
      {"--batch", i64(a.batch)}, {"--seq", i64(a.seq)}, {"--warmup", i64(a.warmup)}, {"--stop-at", i64(a.stop_at)}, {"--lr", f64(a.lr)},
      {"--weight-decay", f64(a.weight_decay)}, {"--grad-clip", f64(a.grad_clip)},
      {"--zero", [&](const std::string& n, const std::string& v) { a.zero = static_cast<int>(to_i64(n, v)); }},
      {"--tp", [&](const std::string& n, const std::string& v) { a.tp = static_cast<int>(to_i64(n, v)); }},
      {"--pp", [&](const std::string& n, const std::string& v) { a.pp = static_cast<int>(to_i64(n, v)); }},
      {"--micro-batches",
       [&](const std::string& n, const std::string& v) { a.micro_batches = static_cast<int>(to_i64(n, v)); }},
      {"--pp-schedule", str(a.pp_schedule)},
      {"--eval-every", i64(a.eval_every)}, {"--eval-batches", i64(a.eval_batches)},
      {"--task-rows", i64(a.task_rows)}, {"--save-every", i64(a.save_every)}, {"--save-dir", str(a.save_dir)},
      {"--keep-last", i64(a.keep_last)}, {"--max-skipped-steps", i64(a.max_skipped_steps)},
      {"--divergence-factor", f64(a.divergence_factor)}, {"--divergence-steps", i64(a.divergence_steps)},
      {"--metrics", str(a.metrics_path)}, {"--progress", str(a.progress)}, {"--log-every", i64(a.log_every)},
      {"--inspect-every", i64(a.inspect_every)},
      {"--samples", i64(a.samples)}, {"--sample-tokens", i64(a.sample_tokens)}, {"--top-k", i64(a.top_k)},
      {"--export-hf", str(a.export_hf)}, {"--init-from", str(a.init_from)}, {"--dtype", str(a.dtype)},
      {"--fp8-linears", str(a.fp8_linears)}, {"--fp8-recipe", str(a.fp8_recipe)},
      {"--seed", [&](const std::string& n, const std::string& v) { a.seed = static_cast<uint64_t>(to_i64(n, v)); }},
      {"--fp8-bf16-layers",
       [&](const std::string& n, const std::string& v) {
         a.fp8_bf16_layers.clear();
         for (size_t start = 0; start <= v.size();) {
           const size_t comma = std::min(v.find(',', start), v.size());
           a.fp8_bf16_layers.push_back(to_i64(n, v.substr(start, comma - start)));
           start = comma + 1;
         }
       }},
  };
  std::map<std::string, std::string> given;  // option -> value as typed, for the range checks below
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    bool inline_value = false;
    if (size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    if (arg == "-h" || arg == "--help") {
      a.help = true;
    } else if (arg == "--checkpointing") {
      a.checkpointing = true;
    } else if (arg == "--fp8") {
      a.fp8 = true;
    } else if (arg == "--fp8-head") {
      a.fp8_head = true;
    } else if (arg == "--fp8-head-backward") {
      a.fp8_head_backward = true;
    } else if (arg == "--cuda-graphs") {
      a.cuda_graphs = true;
    } else if (arg == "--no-cuda-graphs") {
      a.no_cuda_graphs = true;
    } else if (arg == "--resume") {
      a.resume = true;
    } else if (arg == "--async-save") {
      a.async_save = true;
    } else if (arg == "--overwrite-checkpoints") {
      a.overwrite_checkpoints = true;
    } else if (auto it = valued.find(arg); it != valued.end()) {
      if (!inline_value) {
        BMT_CHECK(i + 1 < argc, "option ", arg, " needs a value");
        value = argv[++i];
      }
      it->second(arg, value);
      given[arg] = value;
    } else {
      BMT_ERROR("unknown option '", arg, "' (see --help)");
    }
  }
  a.save_dir_given = given.count("--save-dir") > 0;
  BMT_CHECK(!a.save_dir.empty(), "option --save-dir needs a folder name, got ''");
  // Given values must be usable: -1 means "the preset's default" only when the option is absent.
  auto positive = [&](const char* opt, double v) {
    BMT_CHECK(!given.count(opt) || (v > 0 && std::isfinite(v)), "option ", opt, " must be positive, got '",
              given[opt], "'");
  };
  auto non_negative = [&](const char* opt, int64_t v) {
    BMT_CHECK(!given.count(opt) || v >= 0, "option ", opt, " must be >= 0, got '", given[opt], "'");
  };
  positive("--steps", static_cast<double>(a.steps));
  positive("--batch", static_cast<double>(a.batch));
  positive("--seq", static_cast<double>(a.seq));
  positive("--lr", a.lr);
  positive("--eval-every", static_cast<double>(a.eval_every));
  positive("--eval-batches", static_cast<double>(a.eval_batches));
  positive("--max-skipped-steps", static_cast<double>(a.max_skipped_steps));
  positive("--divergence-steps", static_cast<double>(a.divergence_steps));
  BMT_CHECK(std::isfinite(a.divergence_factor) && (a.divergence_factor == 0 || a.divergence_factor > 1),
            "option --divergence-factor must be 0 (off) or above 1, got '", given["--divergence-factor"], "'");
  non_negative("--warmup", a.warmup);
  non_negative("--stop-at", a.stop_at);
  non_negative("--keep-last", a.keep_last);
  non_negative("--save-every", a.save_every);
  non_negative("--inspect-every", a.inspect_every);
  non_negative("--task-rows", a.task_rows);
  non_negative("--samples", a.samples);
  non_negative("--sample-tokens", a.sample_tokens);
  BMT_CHECK(a.weight_decay >= 0 && a.grad_clip >= 0, "--weight-decay and --grad-clip must be >= 0");
  BMT_CHECK(a.zero == 2 || a.zero == 3, "--zero must be 2 or 3, got ", a.zero);
  BMT_CHECK(a.tp >= 1, "--tp must be >= 1, got ", a.tp);
  BMT_CHECK(a.pp >= 1, "--pp must be >= 1, got ", a.pp);
  BMT_CHECK(!(a.cuda_graphs && a.no_cuda_graphs), "--cuda-graphs and --no-cuda-graphs contradict each other; "
            "give one of them");
  BMT_CHECK(!(a.cuda_graphs && a.pp > 1), "--cuda-graphs cannot be combined with --pp (the pipeline schedule's host "
            "work runs between the micro-batches, which a replayed graph would skip); drop one of them");
  BMT_CHECK(a.micro_batches >= 0, "--micro-batches must be >= 1, got ", a.micro_batches);
  BMT_CHECK(a.pp_schedule == "1f1b" || a.pp_schedule == "gpipe", "--pp-schedule must be 1f1b or gpipe, got '",
            a.pp_schedule, "'");
  BMT_CHECK(a.dtype == "auto" || a.dtype == "fp32" || a.dtype == "bf16", "--dtype must be auto, fp32 or bf16, got '",
            a.dtype, "'");
  BMT_CHECK(a.fp8 || a.fp8_bf16_layers.empty(), "--fp8-bf16-layers chooses layers kept out of FP8; it needs --fp8");
  BMT_CHECK(a.fp8_linears == "all" || a.fp8_linears == "mlp" || a.fp8_linears == "attn",
            "--fp8-linears must be all, mlp or attn, got '", a.fp8_linears, "'");
  BMT_CHECK(a.fp8 || a.fp8_linears == "all", "--fp8-linears chooses the linears in FP8; it needs --fp8");
  BMT_CHECK(a.fp8 || !a.fp8_head, "--fp8-head puts the LM head in FP8 beside the layers; it needs --fp8");
  BMT_CHECK(a.fp8 || !a.fp8_head_backward, "--fp8-head-backward puts the LM head's backward GEMMs in FP8; it needs --fp8");
  BMT_CHECK(!(a.fp8_head && a.fp8_head_backward), "--fp8-head and --fp8-head-backward are two choices for the LM head; "
            "give one");
  BMT_CHECK(a.fp8 || a.fp8_recipe.empty(), "--fp8-recipe chooses how FP8 scales are found; it needs --fp8");
  if (!a.fp8_recipe.empty()) bmt::nn::fp8_recipe_from_name(a.fp8_recipe, "--fp8-recipe");
  BMT_CHECK(a.model == "gpt" || a.model == "llama", "--model must be gpt or llama, got '", a.model, "'");
  BMT_CHECK(a.progress == "auto" || a.progress == "bar" || a.progress == "lines" || a.progress == "off",
            "--progress must be auto, bar, lines or off, got '", a.progress, "'");
  for (const char* opt : {"--model", "--kv-heads"})
    BMT_CHECK(a.init_from.empty() || !given.count(opt), "option ", opt, " cannot be combined with --init-from: the "
              "architecture comes from ", a.init_from, "/config.json");
  BMT_CHECK(a.top_k >= 0, "--top-k must be >= 0, got ", a.top_k);
  return a;
}

}  // namespace examples
