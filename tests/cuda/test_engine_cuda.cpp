// The ZeRO engine on a GPU with NCCL at world size 1: the tiny model (ZeRO-2/3, checkpointing on/off, list on/off)
// trains to the same losses and parameters as the unsharded plain-LibTorch reference on the CPU (TF32 off;
// tolerance 1e-4 relative: different kernels sum in different orders), gathered buffers are freed, and the
// host never has to wait for the comm stream inside a step (only events order the streams). The asynchronous
// offloaded step on GPU parameters: zero_grad and step leave the Blocks' updates to the next forward, which waits
// Block by Block (host, and the compute stream after each copy back).
#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>

#include "bmt/engine/block.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "bmt/params/pending_update.h"
#include "bmt/params/module_state.h"
#include "bmt/runtime/stream_sync.h"
#include "gated_pool.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

constexpr uint64_t kSeed = 77;
constexpr int kSteps = 3;
constexpr int64_t kBatch = 8, kSeq = 6;
constexpr double kLr = 0.5;

at::Tensor tokens(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return at::randint(0, 16, {kBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

bmt::InitOptions nccl_init() {
  bmt::InitOptions o = bmt::testing::test_init();
  o.backend = bmt::Backend::kNccl;
  return o;
}

}  // namespace

class EngineCudaWorld : public ::testing::TestWithParam<int> {};

TEST_P(EngineCudaWorld, MatchesCpuReferenceWithNccl) {
  const int world = GetParam();
  if (c10::cuda::device_count() < world) GTEST_SKIP() << "needs " << world << " GPUs (NCCL refuses two ranks on one GPU)";
  bmt::testing::run_ranks(world, [] {
    at::globalContext().setAllowTF32CuBLAS(false);
    ASSERT_TRUE(bmt::config().device.is_cuda());
    tiny::Dims d;
    // CPU reference.
    auto plist = tiny::reference_params(d, kSeed);
    std::map<std::string, at::Tensor> P(plist.begin(), plist.end());
    std::vector<double> ref_losses;
    for (int s = 0; s < kSteps; ++s) {
      at::Tensor tok = tokens(s);
      at::Tensor logits = tiny::reference_logits(d, P, tok.narrow(1, 0, kSeq));
      at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1}));
      loss.backward();
      ref_losses.push_back(loss.item<double>());
      at::NoGradGuard ng;
      for (auto& kv : P) {
        kv.second.sub_(kLr * kv.second.grad());
        kv.second.mutable_grad().zero_();
      }
    }
    for (int zero : {2, 3})
      for (bool ckpt : {true, false})
        for (bool list : {true, false}) {
          bmt::BlockOptions opts;
          opts.zero_level = zero;
          opts.use_checkpoint = ckpt;
          tiny::Model model(d, opts, list);
          // The reference initialised on the CPU generator: initialise on CPU and load, then train on the GPU.
          std::map<std::string, at::Tensor> init;
          for (auto& kv : tiny::reference_params(d, kSeed)) init[kv.first] = kv.second.detach();
          bmt::load_state_dict(model, init);
          const int W = bmt::world_size();
          const int64_t per_rank = kBatch / W;
          for (int s = 0; s < kSteps; ++s) {
            at::Tensor tok = tokens(s).narrow(0, bmt::rank() * per_rank, per_rank).to(bmt::config().device);
            at::Tensor logits = model.forward(tok.narrow(1, 0, kSeq));
            at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})) / W;
            loss.backward();
            double total = bmt::distributed::all_reduce(loss.detach(), bmt::core::ReduceOp::kSum, *bmt::config().comm).item<double>();
            EXPECT_NEAR(total, ref_losses[s], 1e-4 * ref_losses[s])
                << "step " << s << " zero " << zero << " ckpt " << ckpt << " list " << list;
            bmt::wait_for_gradient_reduction();
            at::NoGradGuard ng;
            for (auto& p : model.parameters()) {
              at::Tensor g = bmt::main_grad(p);
              p.sub_(kLr * g);
              g.zero_();
            }
          }
          auto sd = bmt::state_dict(model);
          for (auto& kv : P)
            EXPECT_LT((sd[kv.first] - kv.second.detach()).abs().max().item<double>(), 1e-4)
                << kv.first << " zero " << zero << " ckpt " << ckpt << " list " << list;
          EXPECT_EQ(bmt::memory_stats().gathered_nbytes, 0);
        }
  }, nccl_init());
}
INSTANTIATE_TEST_SUITE_P(World, EngineCudaWorld, ::testing::Values(1, 2));

TEST(EngineCuda, Bf16ParametersGetFp32Gradients) {
  bmt::testing::run_ranks(1, [] {
    bmt::nn::Linear lin(8, 8, true, at::kBFloat16);
    auto block = bmt::make_block(lin.ptr());
    bmt::init_parameters(*lin);
    at::Tensor x = at::randn({4, 8}, at::TensorOptions().device(bmt::config().device).dtype(at::kBFloat16)).requires_grad_(true);
    block->forward(x).to(at::kFloat).sum().backward();
    bmt::wait_for_gradient_reduction();
    for (auto& p : lin->parameters()) {
      EXPECT_EQ(bmt::main_grad(p).scalar_type(), at::kFloat);
      EXPECT_GT(bmt::main_grad(p).abs().sum().item<double>(), 0.0);
    }
    EXPECT_TRUE(x.grad().defined());
  }, nccl_init());
}

namespace {

// Tiny model on the GPU, Adam with per-Block early start: AdamOptimizer, or AdamOffloadOptimizer in asynchronous
// mode on a pool whose only worker is held throughout, so every Block update runs inside somebody's wait (the next
// forward's gather, Block by Block, or the final state_dict).
bmt::StateDict train_adam_on_gpu(bool offload_async) {
  bmt::testing::GatedPool gated;  // outlives the optimizer
  tiny::Dims d;
  tiny::Model model(d, {}, true);
  std::map<std::string, at::Tensor> init;
  for (auto& kv : tiny::reference_params(d, kSeed)) init[kv.first] = kv.second.detach();
  bmt::load_state_dict(model, init);
  bmt::optim::AdamOptions o(1e-2);
  o.weight_decay(0.01);
  std::shared_ptr<bmt::optim::AdamBase> opt;
  int hook = -1;
  if (offload_async) {
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters(), o);
    off->set_thread_pool(gated.pool);
    off->set_async_step(true);
    hook = bmt::add_grad_ready_hook([off](bmt::Block& b) {
      bmt::wait_for_gradient_reduction();
      off->step_params(b.module()->parameters());
    });
    opt = off;
    gated.close();
  } else {
    opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), o);
  }
  size_t num_block_params = 0;
  for (auto& p : model.parameters()) num_block_params += bmt::meta_of(p).block != nullptr ? 1 : 0;
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor tok = tokens(s).to(bmt::config().device);
    at::Tensor logits = model.forward(tok.narrow(1, 0, kSeq));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})).backward();
    opt->step();
    opt->zero_grad();
    if (offload_async) {
      // GPU parameters: neither step() nor zero_grad() waited for the Blocks' updates on the host.
      EXPECT_EQ(bmt::num_pending_updates(), num_block_params) << "step " << s;
      int running = 0;
      for (auto& p : model.parameters()) {
        auto u = bmt::find_pending_update(p);
        running += u != nullptr && !u->host_done() ? 1 : 0;
      }
      EXPECT_GT(running, 0) << "step " << s;
    }
  }
  bmt::StateDict sd = bmt::state_dict(model);  // waits for the last step's Block updates
  EXPECT_EQ(bmt::num_pending_updates(), 0u);
  if (hook >= 0) bmt::remove_grad_ready_hook(hook);
  return sd;
}

}  // namespace

TEST(EngineCuda, AsyncOffloadStepWaitsPerBlockAndMatchesAdam) {
  bmt::testing::run_ranks(1, [] {
    at::globalContext().setAllowTF32CuBLAS(false);
    ASSERT_TRUE(bmt::config().device.is_cuda());
    auto ref = train_adam_on_gpu(false);
    auto async = train_adam_on_gpu(true);
    // The same CPU and CUDA Adam arithmetic (bit-identical, see the optimizer CUDA tests); the tolerance only covers
    // GPU forward/backward kernels that may sum in a different order between runs.
    for (auto& kv : ref)
      EXPECT_LT((kv.second - async.at(kv.first)).abs().max().item<double>(), 1e-5) << kv.first;
  }, nccl_init());
}

// OptimManager::overlap_step_with_backward on the GPU (bf16 parameters, fp32 master weights and gradients): each
// Block's Adam is queued during the backward without a host wait (the inf/NaN flag lives on the device) and its
// gradient shards are freed; the parameters after 3 steps equal those of the plain step() bit for bit (the same
// kernels on the same gradients), and the engine counts no Block gradient bytes after each backward.
TEST(EngineCuda, StepInBackwardEqualsThePlainStepAndFreesGradients) {
  bmt::testing::run_ranks(1, [] {
    tiny::Dims d;
    d.dtype = at::kBFloat16;
    std::vector<bmt::StateDict> results;
    for (bool early : {false, true}) {
      tiny::Model model(d, {}, true);
      std::map<std::string, at::Tensor> init;
      for (auto& kv : tiny::reference_params(d, kSeed)) init[kv.first] = kv.second.detach().to(at::kBFloat16);
      bmt::load_state_dict(model, init);
      auto opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), bmt::optim::AdamOptions(1e-2));
      bmt::optim::OptimManager manager;
      manager.add_optimizer(opt);
      bmt::optim::OffloadOverlap overlap;
      if (early) overlap = manager.overlap_step_with_backward(true);
      for (int s = 0; s < kSteps; ++s) {
        at::Tensor tok = tokens(s).to(bmt::config().device);
        at::Tensor logits = model.forward(tok.narrow(1, 0, kSeq));
        manager.backward(at::cross_entropy_loss(logits.reshape({-1, d.vocab}).to(at::kFloat),
                                                tok.narrow(1, 1, kSeq).reshape({-1})));
        if (early) EXPECT_EQ(bmt::memory_stats().grad_nbytes, 0) << "step " << s;
        EXPECT_TRUE(manager.step());
        manager.zero_grad();
      }
      if (early) EXPECT_EQ(overlap.num_early_starts(), kSteps * d.layers);
      results.push_back(bmt::state_dict(model));
    }
    for (auto& kv : results[0]) EXPECT_TRUE(at::equal(kv.second, results[1].at(kv.first))) << kv.first;
  });
}
