// What bmt::init's factories put inside an InitMethod (a std::function), so that init_parameters can recognise a
// built-in initialiser (std::function::target) and fill shards from its counter-based stream. Not installed.
#pragma once

#include <ATen/ATen.h>

#include "bmt/params/param_meta.h"

namespace bmt::detail {

struct BuiltinInit {
  enum class Kind { kNormal, kUniform, kConstant, kXavierNormal, kXavierUniform };
  Kind kind = Kind::kConstant;
  double a = 0.0, b = 0.0;  // normal: mean, std; uniform: low, high; constant: value; xavier: gain
  // The full-tensor path: torch::nn::init with torch's default generator.
  void operator()(at::Tensor& full) const;
};

inline const BuiltinInit* builtin_of(const InitMethod& init) { return init ? init.target<BuiltinInit>() : nullptr; }

}  // namespace bmt::detail
