// Selective recomputation for checkpointed Blocks. A checkpointed Block runs its forward function twice: once
// without autograd (the activations are dropped), and again in the backward to rebuild the graph. An op may keep
// tensors its first run computed and take them back in the recompute instead of computing them again: memory for
// time, chosen per op (bmt::nn::causal_attention keeps its output and log-sum-exp, about one activation of a layer,
// to spare the attention's forward, a tenth of a checkpointed step at 1.3B). Both runs meet the ops in the same
// order (the forward's control flow may not depend on values, as checkpointing needs anyway).
// BlockOptions::keep_for_recompute (default on) and BMT_KEEP_FOR_RECOMPUTE=0 (off for every Block) switch it.
#pragma once

#include <ATen/ATen.h>

#include <deque>
#include <vector>

namespace bmt {

enum class RecomputePhase {
  kNone,       // not inside a checkpointed Block's forward, or keeping is off
  kFirstRun,   // the first run: keep_for_recompute stores values
  kRecompute,  // the backward's run: take_kept returns them in the order they were stored
};

// The phase of the Block forward running on this thread.
RecomputePhase recompute_phase();
// kFirstRun: stores `values` for this call's recompute (no-op in other phases).
void keep_for_recompute(std::vector<at::Tensor> values);
// kRecompute: the next values kept by the first run, or an empty vector when none are left (the op computes).
std::vector<at::Tensor> take_kept();

// The recompute's tail: in kRecompute a Block's outputs are only the roots of its backward (their values are never
// read), so code that knows its result is one of them may leave it uncomputed (the C++ GPT's gelu_mlp second GEMM;
// the routed torch ops' deferred linears, python/bmtrain/recompute_tail.py). BMT_RECOMPUTE_SKIP_TAIL=1 turns it on;
// off by default until measured on GPUs.
bool recompute_skip_tail_enabled();
void set_recompute_skip_tail_enabled(bool on);
// True while a checkpointed Block recomputes on this thread and the switch is on.
bool skip_block_outputs_now();

namespace detail {

struct KeptValues {
  std::deque<std::vector<at::Tensor>> values;
};

// Makes `phase` and `kept` current on this thread while alive (Block::run_forward / run_backward).
class RecomputeScope {
 public:
  RecomputeScope(RecomputePhase phase, KeptValues* kept);
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  RecomputePhase prev_phase_;
  KeptValues* prev_kept_;
};

// BMT_KEEP_FOR_RECOMPUTE (on unless 0), settable from code (tests, benchmarks).
bool keep_for_recompute_enabled();
void set_keep_for_recompute_enabled(bool on);

}  // namespace detail
}  // namespace bmt
