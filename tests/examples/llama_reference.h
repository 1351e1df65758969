// An independent plain-LibTorch Llama (no bmt, nothing from examples/models) over a map of full weights keyed like
// examples::Llama's state_dict: RMSNorm, rotary positions (rotate-half convention, angles in fp64), explicit causal
// softmax attention with grouped-query heads mapped by index (query head h reads kv head h / (H / H_kv)), SwiGLU.
// Everything in fp32.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace llama_ref {

struct Shape {
  int64_t layers, dim, heads, kv_heads;
  double norm_eps, rope_theta;
  int64_t head_dim() const { return dim / heads; }
};

inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / at::sqrt(x.pow(2).mean({-1}, true) + eps) * w;
}

// x (B, T, heads, hd): pair (i, i + hd/2) rotated by t * theta^(-2i/hd) at position t.
inline at::Tensor rope(const at::Tensor& x, double theta) {
  const int64_t T = x.size(1), hd = x.size(3), half = hd / 2;
  at::Tensor angle = at::empty({T, half}, at::kDouble);
  auto a = angle.accessor<double, 2>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i)
      a[t][i] = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
  at::Tensor c = at::cos(angle).to(at::kFloat).view({1, T, 1, half});
  at::Tensor s = at::sin(angle).to(at::kFloat).view({1, T, 1, half});
  at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

// Causal attention, q (B, T, H, hd), k and v (B, T, Hkv, hd) -> (B, T, H * hd).
inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), group = H / k.size(2);
  at::Tensor future = at::ones({T, T}, at::kBool).triu(1);  // key position > query position
  std::vector<at::Tensor> heads;
  for (int64_t h = 0; h < H; ++h) {
    at::Tensor qh = q.select(2, h), kh = k.select(2, h / group), vh = v.select(2, h / group);  // (B, T, hd)
    at::Tensor scores = at::matmul(qh, kh.transpose(1, 2)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    heads.push_back(at::matmul(at::softmax(scores, -1), vh));
  }
  return at::stack(heads, 2).reshape({B, T, H * hd});
}

inline at::Tensor logits(const Shape& s, std::map<std::string, at::Tensor>& P, const at::Tensor& ids) {
  const int64_t B = ids.size(0), T = ids.size(1), hd = s.head_dim();
  at::Tensor h = P["tok_embeddings.weight"].index_select(0, ids.reshape({-1})).view({B, T, s.dim});
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    at::Tensor x = rms_norm(h, P[L + "attention_norm.weight"], s.norm_eps);
    at::Tensor q = rope(at::matmul(x, P[L + "attention.wq.weight"].t()).view({B, T, s.heads, hd}), s.rope_theta);
    at::Tensor k = rope(at::matmul(x, P[L + "attention.wk.weight"].t()).view({B, T, s.kv_heads, hd}), s.rope_theta);
    at::Tensor v = at::matmul(x, P[L + "attention.wv.weight"].t()).view({B, T, s.kv_heads, hd});
    h = h + at::matmul(attention(q, k, v), P[L + "attention.wo.weight"].t());
    x = rms_norm(h, P[L + "ffn_norm.weight"], s.norm_eps);
    at::Tensor gate = at::matmul(x, P[L + "feed_forward.w1.weight"].t());
    at::Tensor up = at::matmul(x, P[L + "feed_forward.w3.weight"].t());
    h = h + at::matmul(gate * at::sigmoid(gate) * up, P[L + "feed_forward.w2.weight"].t());
  }
  return at::matmul(rms_norm(h, P["norm.weight"], s.norm_eps), P["output.weight"].t());
}

// Mean token cross-entropy, written out: logsumexp minus the target's logit.
inline at::Tensor mean_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  at::Tensor flat = logits.reshape({-1, logits.size(-1)});
  at::Tensor picked = flat.gather(1, targets.reshape({-1, 1})).squeeze(1);
  return (at::logsumexp(flat, {1}) - picked).mean();
}

}  // namespace llama_ref
