// Helpers of the multi-rank checkpoint tests: a directory shared by the test process and its rank processes, and
// a deterministic trainer (tiny model from tests/engine, AdamOptimizer + Cosine schedule under an OptimManager,
// global batch split over the ranks) whose losses do not depend on the world size beyond fp32 rounding.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/runtime/distributed.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/module_state.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace ckpt_test {

// The same path in the test process and in the rank processes it forks (keyed by the test process id).
inline std::string shared_dir(const std::string& tag) {
  const int owner = bmt::testing::in_rank_process() ? getppid() : getpid();
  return "/tmp/bmt_ckpt_mr_" + std::to_string(owner) + "_" + tag;
}

// Creates the directory in the test process; removes it at scope exit (test process only).
struct SharedDir {
  explicit SharedDir(const std::string& tag) : path(shared_dir(tag)) {
    if (!bmt::testing::in_rank_process()) {
      bmt::checkpoint::remove_tree(path);
      bmt::checkpoint::make_directory(path);
    }
  }
  ~SharedDir() {
    if (!bmt::testing::in_rank_process() && !::testing::Test::HasFailure()) bmt::checkpoint::remove_tree(path);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

constexpr uint64_t kSeed = 4321;
constexpr int64_t kGlobalBatch = 12, kSeq = 4;  // 12 divides over 1, 2, 3, 4 ranks

inline at::Tensor batch_tokens(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5000 + step);
  return at::randint(0, 16, {kGlobalBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

// How a Trainer trains: the plain or the offloaded Adam (optionally with its asynchronous step), loss scaling.
struct TrainerOptions {
  bool offload = false;     // AdamOffloadOptimizer instead of AdamOptimizer (the same CPU kernel: same results)
  bool async_step = false;  // AdamOffloadOptimizer::set_async_step(true): Block updates still run after step()
  double loss_scale = 0;    // OptimManager loss scaling (0: off)
  int64_t loss_scale_steps = 2;  // grow the scale every 2 good steps, so its state changes during a short run
};

struct Trainer {
  tiny::Dims dims;
  std::unique_ptr<tiny::Model> model;
  std::shared_ptr<bmt::optim::AdamBase> adam;
  std::shared_ptr<bmt::optim::lr_scheduler::Cosine> sched;
  std::unique_ptr<bmt::optim::OptimManager> manager;

  Trainer(int zero_level, bool use_list, tiny::Dims d = {}, TrainerOptions o = {}) : dims(d) {
    bmt::BlockOptions opts;
    opts.zero_level = zero_level;
    model = std::make_unique<tiny::Model>(dims, opts, use_list);
    at::manual_seed(kSeed);
    bmt::init_parameters(*model);
    const bmt::optim::AdamOptions adam_opts(2e-2);
    if (o.offload) {
      auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model->parameters(), adam_opts);
      off->set_async_step(o.async_step);
      adam = off;
    } else {
      adam = std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), adam_opts);
    }
    sched = std::make_shared<bmt::optim::lr_scheduler::Cosine>(adam, 2e-2, 2, 12);
    bmt::optim::OptimManagerOptions mo;
    mo.loss_scale = o.loss_scale;
    mo.loss_scale_steps = o.loss_scale_steps;
    manager = std::make_unique<bmt::optim::OptimManager>(mo);
    manager->add_optimizer(adam, sched);
  }

  bmt::checkpoint::TrainingState state(int64_t step) {
    bmt::checkpoint::TrainingState s;
    s.model = model.get();
    s.add("optim", *manager);
    s.step = step;
    return s;
  }

  // One update on global batch `step`; returns the global mean loss. Without zero_grad_after, the gradients are
  // left for the caller to zero (an asynchronous offloaded step may then still be updating the Blocks: on CPU
  // parameters zero_grad waits for it).
  double step(int step, bool zero_grad_after = true) {
    const auto& cfg = bmt::config();
    const int64_t per_rank = kGlobalBatch / cfg.world_size;
    at::Tensor tok = batch_tokens(step).narrow(0, cfg.rank * per_rank, per_rank);
    at::Tensor logits = model->forward(tok.narrow(1, 0, kSeq));
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, dims.vocab}), tok.narrow(1, 1, kSeq).reshape({-1}));
    manager->backward(loss);
    manager->step();
    if (zero_grad_after) manager->zero_grad();
    return bmt::sum_loss(loss.detach()).item<double>();
  }
};

inline void write_doubles(const std::string& path, const std::vector<double>& v) {
  std::ofstream out(path);
  out.precision(17);
  for (double x : v) out << x << "\n";
}

inline std::vector<double> read_doubles(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> v;
  double x;
  while (in >> x) v.push_back(x);
  return v;
}

}  // namespace ckpt_test
