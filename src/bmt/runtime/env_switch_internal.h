// A process-wide on/off switch whose default comes from an environment variable (VAR=0 off, another value on, unset
// the switch's default), read on first
// use and settable from code afterwards (tests, benchmarks): the kernel switches of nn/fused_reductions and
// nn/fused_linear, and the engine's (engine/block_gradients, engine/recompute_keep). EnvChoice: the same for a
// choice among named values (nn/fused_linear's GELU backward, nn/fp8_linear's formats and scaling).
#pragma once

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bmt/core/error.h"

namespace bmt {

class EnvSwitch {
 public:
  // default_on: the setting when the variable is unset or empty (otherwise "0" is off, anything else on).
  explicit constexpr EnvSwitch(const char* variable, bool default_on = true)
      : variable_(variable), default_on_(default_on) {}
  bool enabled() { return enabled(default_on_); }
  // The same, with the default given now (a switch whose default follows another setting: nn::fp8_recipe's).
  bool enabled(bool default_on) {
    int v = state_.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* e = std::getenv(variable_);
      v = (!e || !*e) ? kUnset : (std::strcmp(e, "0") == 0 ? 0 : 1);
      state_.store(v, std::memory_order_relaxed);
    }
    return v == kUnset ? default_on : v == 1;
  }
  void set(bool on) { state_.store(on ? 1 : 0, std::memory_order_relaxed); }

 private:
  static constexpr int kUnset = 2;  // the variable unset or empty: the default
  const char* variable_;
  bool default_on_;
  std::atomic<int> state_{-1};  // -1: not yet read from the environment; 0 off, 1 on, kUnset
};

// A choice among N named values of the enum E: unset or empty means the first option; an unknown name is an error
// naming the variable and the choices.
template <typename E, size_t N>
class EnvChoice {
 public:
  struct Option {
    const char* name;
    E value;
  };
  constexpr EnvChoice(const char* variable, std::array<Option, N> options) : variable_(variable), options_(options) {}
  E get() {
    int v = state_.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* e = std::getenv(variable_);
      v = (!e || !*e) ? static_cast<int>(options_[0].value) : parse(e);
      state_.store(v, std::memory_order_relaxed);
    }
    return static_cast<E>(v);
  }
  void set(E value) { state_.store(static_cast<int>(value), std::memory_order_relaxed); }

 private:
  int parse(const char* text) const {
    std::string expected;
    for (size_t i = 0; i < N; ++i) {
      if (std::strcmp(text, options_[i].name) == 0) return static_cast<int>(options_[i].value);
      expected += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(options_[i].name);
    }
    BMT_ERROR(variable_, "=", text, ": expected ", expected);
  }

  const char* variable_;
  std::array<Option, N> options_;
  std::atomic<int> state_{-1};  // -1: not yet read from the environment
};

}  // namespace bmt
