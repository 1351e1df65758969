// A small pipelined language model for the pipeline tests (embedding on stage 0, MLP layers in a
// PipelineTransformerBlockList, final norm + untied head on the last stage) and its plain-LibTorch reference
// over unsharded tensors. Parameter names are the same at every pipe size.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <map>
#include <string>

#include "bmt/runtime/init.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/pipeline/pipeline.h"
#include "tiny_model.h"

namespace pipe_test {

struct Dims {
  int64_t vocab = 16, dim = 8, ff = 16, layers = 4;
};

// The MLP layer of tiny_model.h, tensor-parallel (Megatron layout: replicated activations, so init with
// sequence_parallel = false): fc1 column-parallel, fc2 row-parallel with an all-reduced output.
struct TpMlpLayerImpl : torch::nn::Module {
  explicit TpMlpLayerImpl(const Dims& d)
      : ln(register_module("ln", bmt::nn::LayerNorm(d.dim, 1e-5))),
        fc1(register_module("fc1", bmt::nn::ColumnParallelLinear(d.dim, d.ff, true, at::kFloat, false, false))),
        fc2(register_module("fc2", bmt::nn::RowParallelLinear(d.ff, d.dim, true, at::kFloat, false, true))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2->forward(at::gelu(fc1->forward(ln->forward(x)), "tanh")); }
  bmt::nn::LayerNorm ln;
  bmt::nn::ColumnParallelLinear fc1;
  bmt::nn::RowParallelLinear fc2;
};
TORCH_MODULE(TpMlpLayer);

struct Net : torch::nn::Module {
  Net(const Dims& d, bmt::BlockOptions block, bmt::PipelineOptions pipe, bool tp = false) : d(d) {
    const bmt::Topology& topo = bmt::config().topology;
    if (topo.is_first_stage()) embed = register_module("embed", bmt::nn::Embedding(d.vocab, d.dim));
    tiny::Dims td;
    td.vocab = d.vocab;
    td.dim = d.dim;
    td.ff = d.ff;
    layers = register_module("layers", std::make_shared<bmt::PipelineTransformerBlockList>(
                                           d.layers,
                                           [&](int64_t) -> std::shared_ptr<bmt::Block> {
                                             if (tp) return bmt::make_block(TpMlpLayer(d).ptr(), block);
                                             return bmt::make_block(tiny::MlpLayer(td).ptr(), block);
                                           },
                                           pipe));
    if (topo.is_last_stage()) {
      ln_f = register_module("ln_f", bmt::nn::LayerNorm(d.dim, 1e-5));
      head = register_module("head", bmt::nn::Linear(d.dim, d.vocab, false));
    }
  }
  // One pipelined step over `tok` (rows, seq + 1): micro-batch m is rows [m*rows/M, (m+1)*rows/M).
  bmt::PipelineTransformerBlockList::Step step(const at::Tensor& tok) {
    const int64_t M = layers->num_micro_batches(), rows = tok.size(0) / M, seq = tok.size(1) - 1;
    bmt::PipelineTransformerBlockList::Step s;
    s.first = [this, tok, rows, seq](int m) {
      return std::vector<at::Tensor>{embed->forward(tok.narrow(0, m * rows, rows).narrow(1, 0, seq))};
    };
    s.last = [this, tok, rows, seq](int m, const std::vector<at::Tensor>& h) {
      at::Tensor logits = head->forward(ln_f->forward(h[0]));
      at::Tensor target = tok.narrow(0, m * rows, rows).narrow(1, 1, seq);
      return at::cross_entropy_loss(logits.reshape({-1, d.vocab}), target.reshape({-1}));
    };
    return s;
  }
  Dims d;
  bmt::nn::Embedding embed{nullptr};
  std::shared_ptr<bmt::PipelineTransformerBlockList> layers;
  bmt::nn::LayerNorm ln_f{nullptr};
  bmt::nn::Linear head{nullptr};
};

// Reference parameters (every name, full tensors), the same on every process.
inline std::map<std::string, at::Tensor> reference_params(const Dims& d, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::map<std::string, at::Tensor> p;
  auto rnd = [&](const std::string& n, std::vector<int64_t> shape, double mean, double std) {
    p[n] = at::normal(mean, std, shape, g);
  };
  rnd("embed.weight", {d.vocab, d.dim}, 0, 0.5);
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    rnd(L + "ln.weight", {d.dim}, 1, 0.1);
    rnd(L + "ln.bias", {d.dim}, 0, 0.1);
    rnd(L + "fc1.weight", {d.ff, d.dim}, 0, 0.3);
    rnd(L + "fc1.bias", {d.ff}, 0, 0.1);
    rnd(L + "fc2.weight", {d.dim, d.ff}, 0, 0.3);
    rnd(L + "fc2.bias", {d.dim}, 0, 0.1);
  }
  rnd("ln_f.weight", {d.dim}, 1, 0.1);
  rnd("ln_f.bias", {d.dim}, 0, 0.1);
  rnd("head.weight", {d.vocab, d.dim}, 0, 0.3);
  return p;
}

inline at::Tensor reference_loss(const Dims& d, std::map<std::string, at::Tensor>& P, const at::Tensor& tok) {
  const int64_t seq = tok.size(1) - 1;
  at::Tensor h = at::embedding(P["embed.weight"], tok.narrow(1, 0, seq));
  for (int64_t i = 0; i < d.layers; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    at::Tensor x = at::layer_norm(h, {d.dim}, P[L + "ln.weight"], P[L + "ln.bias"], 1e-5);
    x = at::linear(at::gelu(at::linear(x, P[L + "fc1.weight"], P[L + "fc1.bias"]), "tanh"), P[L + "fc2.weight"],
                   P[L + "fc2.bias"]);
    h = h + x;
  }
  h = at::layer_norm(h, {d.dim}, P["ln_f.weight"], P["ln_f.bias"], 1e-5);
  at::Tensor logits = at::linear(h, P["head.weight"]);
  return at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, seq).reshape({-1}));
}

}  // namespace pipe_test
