#include "models/attention.h"

namespace examples {

at::Tensor split_heads(const at::Tensor& x, int64_t num_heads) {
  const int64_t B = x.size(0), T = x.size(1), width = x.size(2);
  return x.view({B, T, num_heads, width / num_heads}).transpose(1, 2);
}

at::Tensor merge_heads(const at::Tensor& x) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3);
  return x.transpose(1, 2).reshape({B, T, H * hd});
}

}  // namespace examples
