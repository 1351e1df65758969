// FP8 in the tensor-parallel layers (tp_layer_ops.h, fp8 = true) at tp 2 on CPU ranks over Gloo: a
// ColumnParallelLinear (sequence-parallel rows all-gathered) -> GELU -> RowParallelLinear (rows reduce-scattered)
// against the same computation written per shard with nn::fp8_linear on one rank (no communication: every shard's
// weights all-gathered first). The communication moves bytes and adds two partial sums (exact in either order), so
// outputs and gradients are bit-identical; nn::fp8_linear itself is checked against fp64 in test_fp8_linear.cpp.
// The same layers with fp8 off give other outputs (FP8 really ran). Label multirank.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/params/parameter.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "full_grad.h"
#include "run_ranks.h"

namespace {

constexpr int64_t kRows = 32, kIn = 64, kFf = 96;  // every GEMM dimension of every shard a multiple of 16

at::Tensor fixed_randn(std::vector<int64_t> sizes, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen);
}

at::Tensor all_shards(const at::Tensor& param) {  // [tp, ...]: every tp rank's piece of a TP-split parameter
  const at::Tensor t = bmt::gather_full(param);
  std::vector<int64_t> sizes{bmt::config().tp_size};
  sizes.insert(sizes.end(), t.sizes().begin(), t.sizes().end());
  return bmt::distributed::raw_all_gather(t.contiguous(), *bmt::config().tp_comm).view(sizes);
}

}  // namespace

TEST(Fp8TensorParallel, ColumnAndRowLayersEqualTheirShardsFp8Products) {
  bmt::InitOptions init = bmt::testing::test_init();
  init.tp_size = 2;
  init.sequence_parallel = true;
  bmt::testing::run_ranks(2, [] {
    const int r = bmt::config().tp_rank, tp = bmt::config().tp_size;
    const int64_t mine = kRows / tp;
    bmt::nn::ColumnParallelLinear col(kIn, kFf, true, at::kFloat, /*gather_output=*/false, /*gather_input=*/true);
    bmt::nn::RowParallelLinear row(kFf, kIn, true, at::kFloat, /*split_input=*/false, /*all_reduce_output=*/false);
    at::manual_seed(3);
    bmt::init_parameters(*col);
    bmt::init_parameters(*row);
    // non-zero biases, so their place in the sums is tested
    bmt::scatter_full(col->bias, fixed_randn({kFf / tp}, 10 + r) * 0.1);
    bmt::scatter_full(row->bias, fixed_randn({kIn}, 20) * 0.1);
    const at::Tensor row_bias = bmt::gather_full(row->bias);
    col->fp8 = row->fp8 = true;
    const at::Tensor x_full = fixed_randn({kRows, kIn}, 1), g_full = fixed_randn({kRows, kIn}, 2);
    at::Tensor x = x_full.narrow(0, mine * r, mine).clone().requires_grad_();
    const at::Tensor y = row->forward(at::gelu(col->forward(x), "tanh"));
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{mine, kIn}));
    (y * g_full.narrow(0, mine * r, mine)).sum().backward();

    // The reference: every shard's product on this rank.
    const at::Tensor wc = all_shards(col->weight), bc = all_shards(col->bias), wr = all_shards(row->weight);
    std::vector<at::Tensor> wc_ref, bc_ref, wr_ref;
    at::Tensor xr = x_full.clone().requires_grad_(), yr;
    for (int s = 0; s < tp; ++s) {
      wc_ref.push_back(wc[s].clone().requires_grad_());
      bc_ref.push_back(bc[s].clone().requires_grad_());
      wr_ref.push_back(wr[s].clone().requires_grad_());
      const at::Tensor h = at::gelu(bmt::nn::fp8_linear(xr, wc_ref[s], bc_ref[s]), "tanh");
      const at::Tensor part = bmt::nn::fp8_linear(h, wr_ref[s]);
      yr = s == 0 ? part : yr + part;
    }
    yr = yr + row_bias;
    (yr * g_full).sum().backward();

    const std::string who = "tp rank " + std::to_string(r);
    EXPECT_TRUE(at::equal(y.detach(), yr.detach().narrow(0, mine * r, mine))) << who << ": output";
    EXPECT_TRUE(at::equal(x.grad(), xr.grad().narrow(0, mine * r, mine))) << who << ": input gradient";
    using bmt::testing::full_main_grad;
    EXPECT_TRUE(at::equal(full_main_grad(col->weight), wc_ref[r].grad())) << who << ": column weight gradient";
    EXPECT_TRUE(at::equal(full_main_grad(col->bias), bc_ref[r].grad())) << who << ": column bias gradient";
    EXPECT_TRUE(at::equal(full_main_grad(row->weight), wr_ref[r].grad())) << who << ": row weight gradient";

    col->fp8 = row->fp8 = false;  // FP8 really ran: the fp32 layers give other outputs
    at::NoGradGuard no_grad;
    const at::Tensor y32 = row->forward(at::gelu(col->forward(x.detach()), "tanh"));
    const double rel = ((y32 - y).abs().max() / y32.abs().max()).item<double>();
    EXPECT_GT(rel, 1e-4) << who << ": FP8 and fp32 outputs agree too closely";
    EXPECT_LT(rel, 0.2) << who << ": FP8 output far from fp32";
  }, init);
}
