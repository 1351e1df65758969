#include "models/attention.h"

#include "bmt/core/error.h"

namespace examples {

at::Tensor split_heads(const at::Tensor& x, int64_t num_heads) {
  const int64_t B = x.size(0), T = x.size(1), width = x.size(2);
  return x.view({B, T, num_heads, width / num_heads}).transpose(1, 2);
}

at::Tensor merge_heads(const at::Tensor& x) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3);
  return x.transpose(1, 2).reshape({B, T, H * hd});
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  BMT_CHECK(kv_heads > 0 && heads % kv_heads == 0, "causal_attention: ", heads, " query heads are not a multiple of ",
            kv_heads, " kv heads");
  at::Tensor key = k, value = v;
  if (kv_heads != heads) {
    key = k.repeat_interleave(heads / kv_heads, 1);
    value = v.repeat_interleave(heads / kv_heads, 1);
  }
  return at::scaled_dot_product_attention(q, key, value, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
}

}  // namespace examples
