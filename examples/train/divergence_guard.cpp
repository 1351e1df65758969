#include "train/divergence_guard.h"

#include <cmath>

namespace examples {

DivergenceGuard::Verdict DivergenceGuard::observe(double loss) {
  if (factor_ <= 0 || !std::isfinite(loss)) return Verdict::kOk;
  // The first loss only sets the reference; a suspect loss never lowers it (it is above it).
  const bool suspect = std::isfinite(best_) && loss > factor_ * best_;
  if (!suspect) {
    best_ = std::fmin(best_, loss);
    in_a_row_ = 0;
    return Verdict::kOk;
  }
  return ++in_a_row_ >= steps_ ? Verdict::kDiverged : Verdict::kSuspect;
}

}  // namespace examples
