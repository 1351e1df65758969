// Fidelity harness (issue 17 item 5): trains examples::Gpt with bmtrain (a ZeRO / checkpointing / offload variant,
// AdamOptimizer or AdamOffloadOptimizer under an OptimManager, as bmt-bench-train does) and the plain-LibTorch
// ReferenceGptTrainer (tests/support/reference_gpt_trainer.h: the same numerics) from the same initial values on
// the same batches, and returns both per-step loss traces. Used by test_fidelity_multirank.cpp (CPU, Gloo) and
// tests/cuda/test_fidelity_cuda.cpp (124M shapes on a GPU).
//
// Batches follow bmt-bench-train: at::manual_seed(seed + 1), then `distinct · world` at::randint batches on the
// device, cycled; rank r at step s trains on batch (s mod distinct)·world + r. At world 1 these are exactly the
// benchmark's batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/runtime/init.h"
#include "bmt/params/module_state.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/parameter.h"
#include "models/language_model.h"
#include "reference_gpt_trainer.h"

namespace fidelity {

struct Variant {
  std::string name = "zero3";
  int zero = 3;
  bool checkpointing = false;
  bool offload = false;  // AdamOffloadOptimizer with the per-Block early start (loss scaling off), as the benchmark
  // The MLP and residual adds in the GEMMs' epilogues (nn::gelu_mlp; CUDA only). Off in the engine variants, so
  // that they and the reference run the same ops and differ only in what the engine does (sharding, summation
  // orders, offload); the fused ops round differently (fewer times) and are checked on their own.
  bool gemm_epilogues = false;
};

inline std::vector<Variant> all_variants() {
  return {{"zero3", 3, false, false}, {"zero2", 2, false, false}, {"zero3+ckpt", 3, true, false},
          {"zero3+offload", 3, false, true}};
}

struct Case {
  examples::ModelConfig model;
  at::ScalarType dtype = at::kFloat;
  int64_t batch = 2;
  int steps = 50;
  int distinct_batches = 4;
  uint64_t seed = 1234;
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;  // bmt-bench-train's AdamW
  bmt::optim::OptimManagerOptions scaling;  // loss scaling off by default (bf16 / fp32), as the benchmark
};

struct Trace {
  std::vector<double> loss;          // this rank's batch loss per step
  std::vector<bool> skipped;         // the step was skipped (inf/NaN)
  std::vector<double> scale_before;  // the loss scale the step's backward ran with
};

inline examples::ModelConfig with_vocab(examples::ModelConfig c, int64_t vocab) {
  c.vocab_size = vocab;
  return c;
}

// The batches of every step for every rank (see the header), on the configured device.
inline std::vector<at::Tensor> make_batches(const Case& c) {
  const int world = bmt::config().tp_zero_size;
  at::manual_seed(c.seed + 1);
  std::vector<at::Tensor> out;
  for (int i = 0; i < c.distinct_batches * world; ++i)
    out.push_back(at::randint(c.model.vocab_size, {c.batch, c.model.max_seq_len + 1},
                              at::TensorOptions().dtype(at::kLong).device(bmt::config().device)));
  return out;
}

inline const at::Tensor& batch_of(const Case& c, const std::vector<at::Tensor>& batches, int step, int rank) {
  const int world = bmt::config().tp_zero_size;
  return batches[static_cast<size_t>((step % c.distinct_batches) * world + rank)];
}

// The initial values every run starts from: a model initialised as bmt-bench-train does (collective).
inline bmt::StateDict initial_state(const Case& c) {
  auto model = examples::make_model(c.model, {3, false}, c.dtype);
  at::manual_seed(c.seed);
  bmt::init_parameters(*model);
  return bmt::state_dict(*model);
}

inline bmt::testing::RefGptShape ref_shape(const examples::ModelConfig& m) {
  bmt::testing::RefGptShape s;
  s.vocab_size = m.vocab_size;
  s.max_seq_len = m.max_seq_len;
  s.num_layers = m.num_layers;
  s.dim = m.dim;
  s.num_heads = m.num_heads;
  s.ffn_dim = m.ffn_dim;
  s.norm_eps = m.norm_eps;
  return s;
}

// The reference's trace for this rank (every rank computes all ranks' batches; cheap at test sizes).
inline Trace run_reference(const Case& c, const bmt::StateDict& initial) {
  bmt::testing::RefTrainOptions o;
  o.param_dtype = c.dtype;
  o.lr = c.lr;
  o.beta1 = c.beta1;
  o.beta2 = c.beta2;
  o.eps = c.eps;
  o.weight_decay = c.weight_decay;
  o.loss_scale = c.scaling.loss_scale;
  o.loss_scale_factor = c.scaling.loss_scale_factor;
  o.loss_scale_steps = c.scaling.loss_scale_steps;
  o.min_loss_scale = c.scaling.min_loss_scale;
  o.max_loss_scale = c.scaling.max_loss_scale;
  bmt::testing::ReferenceGptTrainer ref(ref_shape(c.model), initial, o, bmt::config().device);
  const std::vector<at::Tensor> batches = make_batches(c);
  const int world = bmt::config().tp_zero_size, rank = bmt::config().tp_zero_rank;
  Trace t;
  for (int s = 0; s < c.steps; ++s) {
    std::vector<at::Tensor> per_rank;
    for (int r = 0; r < world; ++r) per_rank.push_back(batch_of(c, batches, s, r));
    t.scale_before.push_back(ref.loss_scale());
    bmt::testing::RefStepResult res = ref.step(per_rank);
    t.loss.push_back(res.losses[static_cast<size_t>(rank)]);
    t.skipped.push_back(res.skipped);
  }
  return t;
}

// bmtrain's trace for this rank (collective).
inline Trace run_ours(const Case& c, const Variant& v, const bmt::StateDict& initial) {
  struct EpiloguesSwitch {
    bool before = bmt::nn::gemm_epilogues_enabled();
    explicit EpiloguesSwitch(bool on) { bmt::nn::set_gemm_epilogues_enabled(on); }
    ~EpiloguesSwitch() { bmt::nn::set_gemm_epilogues_enabled(before); }
  } epilogues(v.gemm_epilogues);
  auto model = examples::make_model(c.model, {v.zero, v.checkpointing}, c.dtype);
  bmt::load_state_dict(*model, initial);
  std::vector<at::Tensor> params = model->parameters();
  bmt::optim::AdamOptions opts(c.lr, {c.beta1, c.beta2}, c.eps, c.weight_decay);
  opts.decoupled_weight_decay(true);  // the reference's AdamW
  std::shared_ptr<bmt::optim::BmtOptimizer> optimizer;
  if (v.offload) optimizer = std::make_shared<bmt::optim::AdamOffloadOptimizer>(params, opts);
  else optimizer = std::make_shared<bmt::optim::AdamOptimizer>(params, opts);
  bmt::optim::OptimManager manager(c.scaling);
  manager.add_optimizer(optimizer);
  std::optional<bmt::optim::OffloadOverlap> overlap;
  if (v.offload && c.scaling.loss_scale == 0) overlap.emplace(manager.overlap_offload_with_backward());
  const std::vector<at::Tensor> batches = make_batches(c);
  const int rank = bmt::config().tp_zero_rank;
  const int64_t T = c.model.max_seq_len;
  Trace t;
  for (int s = 0; s < c.steps; ++s) {
    const at::Tensor& tok = batch_of(c, batches, s, rank);
    t.scale_before.push_back(manager.loss_scale());
    at::Tensor loss = model->loss(tok.narrow(1, 0, T), tok.narrow(1, 1, T));
    manager.backward(loss);
    t.skipped.push_back(!manager.step());
    manager.zero_grad();
    t.loss.push_back(loss.item<double>());
  }
  if (overlap) overlap->remove();
  return t;
}

inline double max_abs_diff(const Trace& a, const Trace& b) {
  double m = 0;
  for (size_t i = 0; i < a.loss.size() && i < b.loss.size(); ++i) m = std::max(m, std::abs(a.loss[i] - b.loss[i]));
  return m;
}

// Per-step table on stdout (rank 0): step, ours, reference, |diff|, skipped flags, loss scales.
inline void print_traces(const std::string& title, const Trace& ours, const Trace& ref) {
  if (bmt::rank() != 0) return;
  // BMT_FIDELITY_TABLE=FILE: append the table there (a rank's stdout is discarded when its test passes).
  const char* table = std::getenv("BMT_FIDELITY_TABLE");
  if (table && std::freopen(table, "a", stdout) == nullptr) return;
  std::printf("fidelity %s: step ours reference |diff| skipped(ours,ref) scale(ours,ref)\n", title.c_str());
  for (size_t i = 0; i < ours.loss.size(); ++i)
    std::printf("  %3zu %.5f %.5f %.2e %d,%d %g,%g\n", i, ours.loss[i], ref.loss[i], std::abs(ours.loss[i] - ref.loss[i]),
                static_cast<int>(ours.skipped[i]), static_cast<int>(ref.skipped[i]), ours.scale_before[i],
                ref.scale_before[i]);
  std::printf("fidelity %s: max |diff| %.3e\n", title.c_str(), max_abs_diff(ours, ref));
  std::fflush(stdout);
}

}  // namespace fidelity
