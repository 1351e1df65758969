#include "bmt/engine/recompute_keep.h"

#include <utility>

#include "bmt/runtime/env_switch_internal.h"

namespace bmt {
namespace {

thread_local RecomputePhase t_phase = RecomputePhase::kNone;
thread_local detail::KeptValues* t_kept = nullptr;
EnvSwitch g_keep_switch("BMT_KEEP_FOR_RECOMPUTE");
EnvSwitch g_tail_switch("BMT_RECOMPUTE_SKIP_TAIL", /*default_on=*/false);

}  // namespace

RecomputePhase recompute_phase() { return t_kept ? t_phase : RecomputePhase::kNone; }

void keep_for_recompute(std::vector<at::Tensor> values) {
  if (t_kept && t_phase == RecomputePhase::kFirstRun) t_kept->values.push_back(std::move(values));
}

std::vector<at::Tensor> take_kept() {
  if (!t_kept || t_phase != RecomputePhase::kRecompute || t_kept->values.empty()) return {};
  std::vector<at::Tensor> v = std::move(t_kept->values.front());
  t_kept->values.pop_front();
  return v;
}

bool recompute_skip_tail_enabled() { return g_tail_switch.enabled(); }
void set_recompute_skip_tail_enabled(bool on) { g_tail_switch.set(on); }
bool skip_block_outputs_now() { return recompute_phase() == RecomputePhase::kRecompute && g_tail_switch.enabled(); }

namespace detail {

RecomputeScope::RecomputeScope(RecomputePhase phase, KeptValues* kept) : prev_phase_(t_phase), prev_kept_(t_kept) {
  t_phase = phase;
  t_kept = kept;
}

RecomputeScope::~RecomputeScope() {
  t_phase = prev_phase_;
  t_kept = prev_kept_;
}

bool keep_for_recompute_enabled() { return g_keep_switch.enabled(); }
void set_keep_for_recompute_enabled(bool on) { g_keep_switch.set(on); }

}  // namespace detail
}  // namespace bmt
