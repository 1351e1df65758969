// Helpers shared by the optimizer tests: parameter sets of awkward sizes, clones, relative errors.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace bmt::optim::testing {

// Sizes around vector widths (8, 16) and the CPU chunk size (32768), plus an empty shard.
inline const std::vector<std::vector<int64_t>> kShapes = {{1}, {7}, {3, 11}, {0}, {1000}, {70001}};

inline std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dt,
                                           uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> out;
  for (const auto& s : shapes) out.push_back(at::randn(s, gen).to(dt).requires_grad_(true));
  return out;
}

inline std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps, at::ScalarType dt) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(dt).clone().requires_grad_(true));
  return out;
}

// max_i |a_i - b_i| / max(|b_i|, floor): relative error with a floor for elements near zero.
inline double max_rel_err(const at::Tensor& a, const at::Tensor& b, double floor = 1e-2) {
  if (a.numel() == 0) return 0.0;
  at::Tensor af = a.detach().to(at::kDouble), bf = b.detach().to(at::kDouble);
  return ((af - bf).abs() / bf.abs().clamp_min(floor)).max().item<double>();
}

}  // namespace bmt::optim::testing
