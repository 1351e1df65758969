// A process-wide on/off switch whose default comes from an environment variable (VAR=0 off, another value on, unset
// the switch's default), read on first
// use and settable from code afterwards (tests, benchmarks): the kernel switches of nn/fused_reductions and
// nn/fused_linear, and the engine's (engine/block_gradients, engine/recompute_keep).
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace bmt {

class EnvSwitch {
 public:
  // default_on: the setting when the variable is unset or empty (otherwise "0" is off, anything else on).
  explicit constexpr EnvSwitch(const char* variable, bool default_on = true)
      : variable_(variable), default_on_(default_on) {}
  bool enabled() {
    int v = state_.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* e = std::getenv(variable_);
      v = (!e || !*e) ? (default_on_ ? 1 : 0) : (std::strcmp(e, "0") == 0 ? 0 : 1);
      state_.store(v, std::memory_order_relaxed);
    }
    return v == 1;
  }
  void set(bool on) { state_.store(on ? 1 : 0, std::memory_order_relaxed); }

 private:
  const char* variable_;
  bool default_on_;
  std::atomic<int> state_{-1};  // -1: not yet read from the environment
};

}  // namespace bmt
