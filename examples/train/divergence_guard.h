// DivergenceGuard: stops a run whose loss stays finite but has blown up (e.g. --lr 1e6: loss 6.8e9), which the
// inf/NaN skip counter (--max-skipped-steps) never sees. A step is suspect when its loss is above `factor` times
// the lowest loss seen so far in this run; `steps` suspect steps in a row mean the run diverged. Checkpoints wait
// while the loss is suspect (trainer.cpp), so when the guard fires nothing saved after the blow-up exists and
// `latest` still names the last good checkpoint.
//
// Defaults (factor 3, 10 steps) never fire on a healthy language-model run: its loss starts near ln(vocab) and
// falls (tiny: 2.6 -> 1.1; gpt2-124m on FineWeb: 10.9 -> 3.3), a spike of a healthy run is a fraction of its level
// and lasts a few steps, while returning to 3x the best loss means losing all training and more. factor <= 0 turns
// the guard off.
#pragma once

#include <cstdint>
#include <limits>

namespace examples {

class DivergenceGuard {
 public:
  DivergenceGuard(double factor, int64_t steps) : factor_(factor), steps_(steps) {}
  enum class Verdict { kOk, kSuspect, kDiverged };
  // One step's loss (the same on every rank). Non-finite losses are the skip counter's: ignored here.
  Verdict observe(double loss);
  double best_loss() const { return best_; }
  int64_t suspect_in_a_row() const { return in_a_row_; }
  double factor() const { return factor_; }
  int64_t steps() const { return steps_; }

 private:
  double factor_;
  int64_t steps_;
  double best_ = std::numeric_limits<double>::infinity();
  int64_t in_a_row_ = 0;
};

}  // namespace examples
