// train_gpt: trains a GPT-2 or Llama model with bmtrain's ZeRO engine over every rank of the job.
//   bmtrun --nproc 2 train_gpt                 # tiny preset on the embedded arithmetic task (~3 min, 2 CPU cores)
//   bmtrun --nproc 8 train_gpt --preset gpt2-124m --data fineweb_train_000001.bin --metrics m.jsonl
//   bmtrun --nproc 4 train_gpt --tp 2           # data parallel 2 x tensor parallel 2
// See examples/train/train_args.cpp for every option (or --help). Backend: Gloo on CPU, NCCL on GPUs.
#include <c10/util/Exception.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "train/trainer.h"

namespace {

// One line per rank: torch's errors without their C++ backtrace (BMT_DEBUG=1 keeps it), line breaks of agreed
// multi-rank errors folded.
std::string one_line_error(const std::exception& e) {
  const char* debug = std::getenv("BMT_DEBUG");
  const bool full = debug && std::string(debug) == "1";
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string msg = c10_error && !full ? c10_error->what_without_backtrace() : e.what();
  if (full) return msg;
  std::string out;
  for (char c : msg) {
    if (c == '\n') c = ' ';
    if (!(c == ' ' && !out.empty() && out.back() == ' ')) out += c;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) must fail the write with EFBIG, reported like a full disk, not kill the rank.
  std::signal(SIGXFSZ, SIG_IGN);
  examples::TrainArgs args;
  try {
    args = examples::parse_train_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", one_line_error(e).c_str());
    return 2;
  }
  if (args.help) {
    std::printf("%s", examples::train_usage().c_str());
    return 0;
  }
  try {
    bmt::InitOptions init;
    init.seed = args.seed;
    init.zero_level = args.zero;
    init.tp_size = args.tp;  // sequence_parallel stays true: the models' layout (models/gpt.h)
    init.pipe_size = args.pp;
    init.num_micro_batches = args.micro_batches > 0 ? args.micro_batches : 2 * args.pp;
    bmt::init_distributed(init);
    examples::run_training(args);
    bmt::finalize();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %s\n", one_line_error(e).c_str());
    return 1;
  }
  return 0;
}
