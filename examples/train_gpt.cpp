// train_gpt: trains a GPT-2 or Llama model with bmtrain's ZeRO engine over every rank of the job.
//   bmtrun --nproc 2 train_gpt                 # tiny preset on the embedded arithmetic task (~3 min, 2 CPU cores)
//   bmtrun --nproc 8 train_gpt --preset gpt2-124m --data fineweb_train_000001.bin --metrics m.jsonl
//   bmtrun --nproc 4 train_gpt --tp 2           # data parallel 2 x tensor parallel 2
// See examples/train/train_args.cpp for every option (or --help). Backend: Gloo on CPU, NCCL on GPUs.
#include <cstdio>
#include <exception>

#include "bmt/core/error.h"
#include "bmt/init.h"
#include "train/trainer.h"

int main(int argc, char** argv) {
  examples::TrainArgs args;
  try {
    args = examples::parse_train_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: %s\n", e.what());
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
    bmt::init_distributed(init);
    examples::run_training(args);
    bmt::finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
