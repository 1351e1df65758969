// Shape helpers the nn ops share.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace bmt::nn {

// `sizes` with its last dimension replaced by `last`: a linear's output shape for input `sizes`.
inline std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s.back() = last;
  return s;
}

}  // namespace bmt::nn
