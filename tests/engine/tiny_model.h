// A tiny GPT-like model built the way a user would (bmt::nn layers, Blocks, optionally a TransformerBlockList)
// and an independent plain-LibTorch functional reference of the same math over unsharded tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/nn/layers.h"

namespace tiny {

struct Dims {
  int64_t vocab = 16, dim = 8, ff = 16, layers = 3;
  at::ScalarType dtype = at::kFloat;  // of every parameter (bf16: fp32 main gradients, BlockOptions::reduce_dtype)
};

struct MlpLayerImpl : torch::nn::Module {
  MlpLayerImpl(const Dims& d)
      : ln(register_module("ln", bmt::nn::LayerNorm(d.dim, 1e-5, d.dtype))),
        fc1(register_module("fc1", bmt::nn::Linear(d.dim, d.ff, true, d.dtype))),
        fc2(register_module("fc2", bmt::nn::Linear(d.ff, d.dim, true, d.dtype))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2->forward(at::gelu(fc1->forward(ln->forward(x)), "tanh")); }
  bmt::nn::LayerNorm ln;
  bmt::nn::Linear fc1, fc2;
};
TORCH_MODULE(MlpLayer);

struct Container : torch::nn::Module {};

struct Model : torch::nn::Module {
  Model(const Dims& d, bmt::BlockOptions opts, bool use_list, int prefetch_depth = 1) {
    embed = register_module("embed", bmt::nn::Embedding(d.vocab, d.dim, d.dtype));
    std::vector<std::shared_ptr<bmt::Block>> blocks;
    std::vector<MlpLayer> inner;
    for (int64_t i = 0; i < d.layers; ++i) {
      inner.emplace_back(d);
      blocks.push_back(bmt::make_block(inner.back().ptr(), opts));
    }
    if (use_list) {
      list = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks, prefetch_depth));
    } else {
      auto c = std::make_shared<Container>();
      for (size_t i = 0; i < inner.size(); ++i) c->register_module(std::to_string(i), inner[i].ptr());
      register_module("layers", c);
      plain_blocks = blocks;
    }
    ln_f = register_module("ln_f", bmt::nn::LayerNorm(d.dim, 1e-5, d.dtype));
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor E = bmt::gathered(embed->weight);  // gathered once, used twice (tied)
    at::Tensor h = at::embedding(E, ids);
    if (list) h = list->forward(h);
    else
      for (auto& b : plain_blocks) h = b->forward(h);
    return embed->projection(ln_f->forward(h), E);
  }
  bmt::nn::Embedding embed{nullptr};
  std::shared_ptr<bmt::TransformerBlockList> list;
  std::vector<std::shared_ptr<bmt::Block>> plain_blocks;
  bmt::nn::LayerNorm ln_f{nullptr};
};

// Reference parameters in the model's named_parameters order, initialised like init_parameters does.
inline std::vector<std::pair<std::string, at::Tensor>> reference_params(const Dims& d, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> p;
  auto normal = [&](const std::string& n, std::vector<int64_t> shape) {
    at::Tensor t = at::empty(shape);
    torch::nn::init::normal_(t, 0.0, 0.02);
    p.emplace_back(n, t);
  };
  auto fill = [&](const std::string& n, std::vector<int64_t> shape, double v) { p.emplace_back(n, at::full(shape, v)); };
  normal("embed.weight", {d.vocab, d.dim});
  for (int64_t i = 0; i < d.layers; ++i) {
    std::string L = "layers." + std::to_string(i) + ".";
    fill(L + "ln.weight", {d.dim}, 1.0);
    fill(L + "ln.bias", {d.dim}, 0.0);
    normal(L + "fc1.weight", {d.ff, d.dim});
    fill(L + "fc1.bias", {d.ff}, 0.0);
    normal(L + "fc2.weight", {d.dim, d.ff});
    fill(L + "fc2.bias", {d.dim}, 0.0);
  }
  fill("ln_f.weight", {d.dim}, 1.0);
  fill("ln_f.bias", {d.dim}, 0.0);
  for (auto& kv : p) kv.second.requires_grad_(true);
  return p;
}

inline at::Tensor reference_logits(const Dims& d, std::map<std::string, at::Tensor>& P, const at::Tensor& ids) {
  at::Tensor h = at::embedding(P["embed.weight"], ids);
  for (int64_t i = 0; i < d.layers; ++i) {
    std::string L = "layers." + std::to_string(i) + ".";
    at::Tensor x = at::layer_norm(h, {d.dim}, P[L + "ln.weight"], P[L + "ln.bias"], 1e-5);
    x = at::linear(at::gelu(at::linear(x, P[L + "fc1.weight"], P[L + "fc1.bias"]), "tanh"), P[L + "fc2.weight"],
                   P[L + "fc2.bias"]);
    h = h + x;
  }
  h = at::layer_norm(h, {d.dim}, P["ln_f.weight"], P["ln_f.bias"], 1e-5);
  return at::linear(h, P["embed.weight"]);
}

}  // namespace tiny
