// Each tensor-parallel layer at tp 2 and 4 (and dp 2 x tp 2, where every tp piece is also ZeRO-sharded), every
// option combination: outputs, input gradients and parameter gradients equal the dense layer's computed with
// plain LibTorch autograd from the same full weights. Objective: for outputs replicated over tp, one loss
// sum(Y * G) (identical on every rank); for outputs split over tp, the sum over ranks of each rank's
// sum(Y_r * G_r) — either way d(objective)/dY = G, so the dense gradients are the reference. Data is the same on
// every data-parallel rank, so ZeRO's sum over dp ranks makes parameter gradients dp times the dense ones.
#include <gtest/gtest.h>

#include "bmt/engine/block.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/nn/tp_layer_ops.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/optim/grad_utils.h"
#include "run_ranks.h"
#include "tp_test_util.h"

namespace {

using bmt::testing::expect_close;
using bmt::testing::logical_grad;
using bmt::testing::run_ranks;

using bmt::testing::tp_init;

at::Tensor rows_chunk(const at::Tensor& x) {
  const auto& c = bmt::config();
  return x.chunk(c.tp_size, 0)[c.tp_rank].contiguous();
}
at::Tensor cols_chunk(const at::Tensor& x) {
  const auto& c = bmt::config();
  return x.chunk(c.tp_size, -1)[c.tp_rank].contiguous();
}

struct Dense {
  at::Tensor x, w, b, y;
};

// y = x W^T + b with autograd, objective sum(y * g).
Dense dense_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& g) {
  Dense d{x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_(), {}};
  d.y = at::linear(d.x, d.w, d.b);
  (d.y * g).sum().backward();
  return d;
}

void column_case(bool gather_input, bool gather_output) {
  const auto& c = bmt::config();
  const int dp = c.tp_zero_size;
  const int64_t rows = 8, in = 6, out = 12;
  at::manual_seed(7);
  at::Tensor x = at::randn({rows, in}), w = at::randn({out, in}), b = at::randn({out}), g = at::randn({rows, out});
  Dense d = dense_linear(x, w, b, g);
  bmt::nn::ColumnParallelLinear layer(in, out, true, at::kFloat, gather_output, gather_input);
  bmt::scatter_logical(layer->weight, w);
  bmt::scatter_logical(layer->bias, b);
  at::Tensor xin = (gather_input ? rows_chunk(x) : x).requires_grad_();
  at::Tensor y = layer->forward(xin);
  const std::string what = std::string("column gather_input=") + (gather_input ? "1" : "0") +
                           " gather_output=" + (gather_output ? "1" : "0");
  at::Tensor y_want = gather_output ? d.y : cols_chunk(d.y);
  expect_close(y, y_want, what + " output");
  (y * (gather_output ? g : cols_chunk(g))).sum().backward();
  expect_close(xin.grad(), gather_input ? rows_chunk(d.x.grad()) : d.x.grad(), what + " input grad");
  expect_close(logical_grad(layer->weight), dp * d.w.grad(), what + " weight grad");
  expect_close(logical_grad(layer->bias), dp * d.b.grad(), what + " bias grad");
}

// A fused projection (3 blocks of 4 features, as Q/K/V): this rank holds its slice of every block, and the
// logical (state_dict) layout stays the dense one.
void grouped_column_case() {
  const auto& c = bmt::config();
  const int dp = c.tp_zero_size;
  const int64_t rows = 8, in = 6, out = 12, groups = 3;
  at::manual_seed(17);
  at::Tensor x = at::randn({rows, in}), w = at::randn({out, in}), b = at::randn({out}), g = at::randn({rows, out});
  Dense d = dense_linear(x, w, b, g);
  bmt::nn::ColumnParallelLinear layer(in, out, true, at::kFloat, false, false, bmt::init::normal(0, 1), groups);
  bmt::scatter_logical(layer->weight, w);
  bmt::scatter_logical(layer->bias, b);
  auto mine = [&](const at::Tensor& t) {
    std::vector<at::Tensor> parts;
    for (const at::Tensor& block : t.chunk(groups, -1)) parts.push_back(cols_chunk(block));
    return at::cat(parts, -1);
  };
  at::Tensor xin = x.clone().requires_grad_();
  at::Tensor y = layer->forward(xin);
  expect_close(y, mine(d.y), "grouped column output");
  (y * mine(g)).sum().backward();
  expect_close(xin.grad(), d.x.grad(), "grouped column input grad");
  expect_close(logical_grad(layer->weight), dp * d.w.grad(), "grouped column weight grad");
  expect_close(logical_grad(layer->bias), dp * d.b.grad(), "grouped column bias grad");
  expect_close(bmt::gather_logical(layer->weight), w, "grouped column logical weight");
}

void row_case(bool split_input, bool all_reduce_output) {
  const auto& c = bmt::config();
  const int dp = c.tp_zero_size;
  const int64_t rows = 8, in = 12, out = 5;
  at::manual_seed(11);
  at::Tensor x = at::randn({rows, in}), w = at::randn({out, in}), b = at::randn({out}), g = at::randn({rows, out});
  Dense d = dense_linear(x, w, b, g);
  bmt::nn::RowParallelLinear layer(in, out, true, at::kFloat, split_input, all_reduce_output);
  bmt::scatter_logical(layer->weight, w);
  bmt::scatter_logical(layer->bias, b);
  // split_input (BMTrain's): all features, rows split over tp; else this rank's features of every row.
  at::Tensor xin = (split_input ? rows_chunk(x) : cols_chunk(x)).requires_grad_();
  at::Tensor y = layer->forward(xin);
  const std::string what = std::string("row split_input=") + (split_input ? "1" : "0") +
                           " all_reduce_output=" + (all_reduce_output ? "1" : "0");
  expect_close(y, all_reduce_output ? d.y : rows_chunk(d.y), what + " output");
  (y * (all_reduce_output ? g : rows_chunk(g))).sum().backward();
  expect_close(xin.grad(), split_input ? rows_chunk(d.x.grad()) : cols_chunk(d.x.grad()), what + " input grad");
  expect_close(logical_grad(layer->weight), dp * d.w.grad(), what + " weight grad");
  expect_close(logical_grad(layer->bias), dp * d.b.grad(), what + " bias grad");
}

// BMTrain's VPEmbedding: each tp rank looks up its OWN ids. Sequence parallel: rank r's ids are the r-th chunk of
// the tokens (different per rank) and the table gradient sums every rank's tokens; otherwise every rank has all ids.
void embedding_case(bool sequence_parallel) {
  const auto& c = bmt::config();
  const int dp = c.tp_zero_size;
  const int64_t vocab = 16, dim = 5, rows = 8;
  at::manual_seed(13);
  at::Tensor table = at::randn({vocab, dim});
  at::Tensor ids = at::randint(vocab, {rows}, at::kLong);
  ids[0] = vocab - 1;  // both ends of the vocabulary, in different ranks' chunks
  ids[rows - 1] = 0;
  at::Tensor g = at::randn({rows, dim}), h = at::randn({rows, dim}), gl = at::randn({rows, vocab});
  // Dense: e = table[ids]; logits = h table^T; objective sum(e * g) + sum(logits * gl).
  at::Tensor td = table.clone().requires_grad_(), hd = h.clone().requires_grad_();
  at::Tensor e = at::embedding(td, ids), logits = at::linear(hd, td);
  ((e * g).sum() + (logits * gl).sum()).backward();

  bmt::nn::VPEmbedding emb(vocab, dim, at::kFloat, bmt::init::normal(0, 1), sequence_parallel);
  bmt::scatter_logical(emb->weight, table);
  const std::string what = std::string("vp_embedding sequence_parallel=") + (sequence_parallel ? "1" : "0");
  auto mine = [&](const at::Tensor& t) { return sequence_parallel ? rows_chunk(t) : t; };
  at::Tensor out = emb->forward(mine(ids));
  expect_close(out, mine(e), what + " lookup");
  at::Tensor hin = mine(h).requires_grad_();
  at::Tensor lg = emb->projection(hin);
  expect_close(lg, cols_chunk(logits), what + " projection");
  ((out * mine(g)).sum() + (lg * cols_chunk(gl)).sum()).backward();
  expect_close(hin.grad(), mine(hd.grad()), what + " projection input grad");
  expect_close(logical_grad(emb->weight), dp * td.grad(), what + " weight grad");
  // 3-dim input: BMTrain's (x.size(0), -1, vocab/tp) of the gathered rows, i.e. the whole sequence for batch 1.
  at::Tensor lg3 = emb->projection(mine(h).unsqueeze(0));
  expect_close(lg3, cols_chunk(logits).unsqueeze(0), what + " projection of (1, rows, dim)");
}

// forward_replicated_ids (the C++ models' token rows): the same ids on every tp rank, this rank's rows back
// (sequence parallel) or all of them, without gathering the table.
void embedding_replicated_ids_case(bool sequence_parallel) {
  const auto& c = bmt::config();
  const int dp = c.tp_zero_size;
  const int64_t vocab = 16, dim = 5, rows = 8;
  at::manual_seed(19);
  at::Tensor table = at::randn({vocab, dim}), ids = at::randint(vocab, {rows}, at::kLong), g = at::randn({rows, dim});
  at::Tensor td = table.clone().requires_grad_();
  at::Tensor e = at::embedding(td, ids);
  (e * g).sum().backward();
  bmt::nn::VPEmbedding emb(vocab, dim, at::kFloat, bmt::init::normal(0, 1), sequence_parallel);
  bmt::scatter_logical(emb->weight, table);
  const std::string what = std::string("vp_embedding replicated ids sequence_parallel=") + (sequence_parallel ? "1" : "0");
  auto mine = [&](const at::Tensor& t) { return sequence_parallel ? rows_chunk(t) : t; };
  at::Tensor out = emb->forward_replicated_ids(ids);
  expect_close(out, mine(e), what + " lookup");
  (out * mine(g)).sum().backward();
  expect_close(logical_grad(emb->weight), dp * td.grad(), what + " weight grad");
}

// BMTrain's OpParallelLinear.apply: the bias is added on every rank before the reduction (tp · bias in the output),
// and gather_input + split_input + reduce-scatter is BMTrain's split_input row layout.
void op_parallel_linear_case() {
  const auto& c = bmt::config();
  const int64_t tp = c.tp_size, rows = 8, in = 12, out = 5;
  at::manual_seed(23);
  at::Tensor x = at::randn({rows, in}), w = at::randn({out, in}), b = at::randn({out}), g = at::randn({rows, out});
  Dense d = dense_linear(x, w, b, g);
  {  // this rank's features, all rows; all-reduced output with the bias inside
    at::Tensor xin = cols_chunk(x).requires_grad_(), wr = cols_chunk(w).requires_grad_(), br = b.clone().requires_grad_();
    at::Tensor y = bmt::nn::op_parallel_linear(xin, wr, br, false, false, false, bmt::nn::TpReduce::kAllReduce);
    expect_close(y, d.y + (tp - 1) * b, "op_parallel_linear all_reduce output (tp * bias)");
    (y * g).sum().backward();
    expect_close(xin.grad(), cols_chunk(d.x.grad()), "op_parallel_linear all_reduce input grad");
    expect_close(wr.grad(), cols_chunk(d.w.grad()), "op_parallel_linear all_reduce weight grad");
    expect_close(br.grad(), d.b.grad(), "op_parallel_linear all_reduce bias grad");
  }
  {  // all features, rows split; gathered, own features, reduce-scattered rows
    at::Tensor xin = rows_chunk(x).requires_grad_(), wr = cols_chunk(w).requires_grad_();
    at::Tensor y = bmt::nn::op_parallel_linear(xin, wr, at::Tensor(), true, false, true, bmt::nn::TpReduce::kReduceScatter);
    expect_close(y, rows_chunk(d.y - b), "op_parallel_linear split_input reduce_scatter output");
    (y * rows_chunk(g)).sum().backward();
    expect_close(xin.grad(), rows_chunk(d.x.grad()), "op_parallel_linear split_input reduce_scatter input grad");
    expect_close(wr.grad(), cols_chunk(d.w.grad()), "op_parallel_linear split_input reduce_scatter weight grad");
  }
}

void all_layer_cases() {
  for (bool gi : {false, true})
    for (bool go : {false, true}) column_case(gi, go);
  grouped_column_case();
  for (bool si : {false, true})
    for (bool ar : {false, true}) row_case(si, ar);
  for (bool sp : {false, true}) embedding_case(sp);
  for (bool sp : {false, true}) embedding_replicated_ids_case(sp);
  op_parallel_linear_case();
}

TEST(ParallelLayers, Tp2) { run_ranks(2, all_layer_cases, tp_init(2)); }
TEST(ParallelLayers, Tp4) { run_ranks(4, all_layer_cases, tp_init(4)); }
TEST(ParallelLayers, Dp2Tp2ShardedPieces) { run_ranks(4, all_layer_cases, tp_init(2)); }
TEST(ParallelLayers, Tp1IsDense) { run_ranks(1, all_layer_cases, tp_init(1)); }

// The tp ops as forward round trips (their closed-form gradients: test_tp_ops_grads.cpp).
TEST(TpOps, SplitAndGatherRowsRoundTrip) {
  run_ranks(2, [] {
    at::Tensor x = at::arange(24, at::kFloat).view({4, 6});
    at::Tensor mine = bmt::tp::split_rows(x.clone().requires_grad_());
    expect_close(mine, rows_chunk(x), "split_rows");
    at::Tensor back = bmt::tp::gather_rows(mine);
    expect_close(back, x, "gather_rows(split_rows(x))");
    at::Tensor last = bmt::tp::gather_last_dim(bmt::tp::split_last_dim(x));
    expect_close(last, x, "gather_last_dim(split_last_dim(x))");
  }, tp_init(2));
}

// Megatron layout inside a ZeRO-3 Block at dp 2 x tp 2: LayerNorm (tp-replicated, averaged) -> column (replicated
// input) -> GELU -> row (all-reduced output) + residual; the replicated LayerNorm and row bias keep one value.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t d, int64_t ff, bool sp)
      : norm(register_module("norm", bmt::nn::LayerNorm(d))),
        up(register_module("up", bmt::nn::ColumnParallelLinear(d, ff, true, at::kFloat, false, sp))),
        down(register_module("down", bmt::nn::RowParallelLinear(ff, d, true, at::kFloat, false, !sp))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down->forward(at::gelu(up->forward(norm->forward(x)))); }
  bmt::nn::LayerNorm norm;
  bmt::nn::ColumnParallelLinear up;
  bmt::nn::RowParallelLinear down;
};
TORCH_MODULE(Mlp);

void block_mlp_case(bool sp) {
  const auto& c = bmt::config();
  const int64_t d = 6, ff = 8, rows = 8;
  at::manual_seed(3);
  Mlp dense_holder(nullptr);
  at::Tensor x = at::randn({rows, d}), g = at::randn({rows, d});
  auto mlp = std::make_shared<MlpImpl>(d, ff, sp);
  bmt::init_parameters(*mlp);
  std::map<std::string, at::Tensor> full;
  for (auto& kv : mlp->named_parameters()) full[kv.key()] = bmt::gather_logical(kv.value());
  // Dense reference from the same logical values.
  std::map<std::string, at::Tensor> p;
  for (auto& kv : full) p[kv.first] = kv.second.clone().requires_grad_();
  at::Tensor xd = x.clone().requires_grad_();
  at::Tensor hd = at::layer_norm(xd, {d}, p["norm.weight"], p["norm.bias"], 1e-5);
  at::Tensor yd = xd + at::linear(at::gelu(at::linear(hd, p["up.weight"], p["up.bias"])), p["down.weight"],
                                  p["down.bias"]);
  (yd * g).sum().backward();

  auto block = bmt::make_block(mlp, bmt::BlockOptions{3, true});
  at::Tensor xin = (sp ? rows_chunk(x) : x).requires_grad_();
  at::Tensor y = block->forward(xin);
  const std::string what = std::string("block mlp sequence_parallel=") + (sp ? "1" : "0");
  expect_close(y, sp ? rows_chunk(yd) : yd, what + " output");
  (y * (sp ? rows_chunk(g) : g)).sum().backward();
  expect_close(xin.grad(), sp ? rows_chunk(xd.grad()) : xd.grad(), what + " input grad");
  std::vector<at::Tensor> params;
  double dense_sq = 0, dense_max = 0;
  for (auto& kv : mlp->named_parameters()) {
    expect_close(logical_grad(kv.value()), c.tp_zero_size * p[kv.key()].grad(), what + " grad of " + kv.key());
    params.push_back(kv.value());
    at::Tensor gd = c.tp_zero_size * p[kv.key()].grad().to(at::kDouble);
    dense_sq += gd.pow(2).sum().item<double>();
    dense_max = std::max(dense_max, gd.abs().max().item<double>());
  }
  // Global norms over the world count every element once: TP pieces once, tp-replicated copies once.
  const double norm2 = bmt::optim::global_grad_norm(params, 2.0, c.comm.get());
  EXPECT_NEAR(norm2, std::sqrt(dense_sq), 1e-5 * std::sqrt(dense_sq)) << what << " 2-norm";
  const double norm_inf = bmt::optim::global_grad_norm(params, INFINITY, c.comm.get());
  EXPECT_NEAR(norm_inf, dense_max, 1e-5 * dense_max) << what << " inf-norm";
}

TEST(ParallelLayers, BlockDp2Tp2Megatron) { run_ranks(4, [] { block_mlp_case(false); }, tp_init(2, false)); }
TEST(ParallelLayers, BlockDp2Tp2SequenceParallel) { run_ranks(4, [] { block_mlp_case(true); }, tp_init(2, true)); }

TEST(ParallelLayers, SizesNotDivisibleByTp) {
  run_ranks(2, [] {
    auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
        ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_error([] { bmt::nn::ColumnParallelLinear(4, 7); }, "nn::ColumnParallelLinear");
    expect_error([] { bmt::nn::RowParallelLinear(9, 4); }, "in_features = 9 is not divisible by tp_size 2");
    expect_error([] { bmt::nn::VPEmbedding(50257, 8); }, "vocab_size = 50257");
    bmt::nn::RowParallelLinear row(8, 4);
    expect_error([&] { row->forward(at::randn({4, 8})); }, "split_input=true");
    bmt::nn::ColumnParallelLinear col(4, 8, true, at::kFloat, false, true);
    expect_error([&] { bmt::nn::RowParallelLinear r2(8, 4); r2->forward(at::randn({3, 4})); }, "divisible by tp_size");
  }, tp_init(2));
}

TEST(ParallelLayers, ReprNamesTheConfiguration) {
  run_ranks(2, [] {
    std::ostringstream os;
    os << *bmt::nn::ColumnParallelLinear(4, 8) << " " << *bmt::nn::RowParallelLinear(8, 4) << " "
       << *bmt::nn::VPEmbedding(16, 4);
    EXPECT_NE(os.str().find("out_features_per_partition=4"), std::string::npos) << os.str();
    EXPECT_NE(os.str().find("in_features_per_partition=4"), std::string::npos) << os.str();
    EXPECT_NE(os.str().find("vocab_per_partition=8"), std::string::npos) << os.str();
  }, tp_init(2));
}

}  // namespace
