// Sharded checkpoint load into GPU tensors (one GPU, world 1): the model's bf16 parameters and the Adam state
// (fp32 exp_avg, exp_avg_sq, master on the GPU) go file → pinned staging chunks → side-stream copies. Small
// staging chunks and checksum blocks make the load cross many chunk and block boundaries; the loaded state must
// equal the saved one bit for bit.
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <cstdlib>

#include "bmt/checkpoint/checkpoint.h"
#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/runtime/distributed.h"
#include "bmt/params/module_state.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace ck = bmt::checkpoint;

namespace {

struct GpuTrainer {
  tiny::Dims dims;
  std::unique_ptr<tiny::Model> model;
  std::shared_ptr<bmt::optim::AdamOptimizer> adam;
  std::unique_ptr<bmt::optim::OptimManager> manager;
  explicit GpuTrainer(uint64_t seed) {
    dims = tiny::Dims{64, 64, 256, 2};
    dims.dtype = at::kBFloat16;
    bmt::BlockOptions opts;
    opts.zero_level = 3;
    model = std::make_unique<tiny::Model>(dims, opts, true);
    at::manual_seed(seed);
    bmt::init_parameters(*model);
    adam = std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), bmt::optim::AdamOptions(1e-2));
    manager = std::make_unique<bmt::optim::OptimManager>();
    manager->add_optimizer(adam);
  }
  void step(int s) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(900 + s);
    at::Tensor tok = at::randint(0, dims.vocab, {4, 9}, g, at::TensorOptions().dtype(at::kLong)).to(bmt::config().device);
    at::Tensor logits = model->forward(tok.narrow(1, 0, 8));
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, dims.vocab}).to(at::kFloat), tok.narrow(1, 1, 8).reshape({-1}));
    manager->backward(loss);
    manager->step();
    manager->zero_grad();
  }
  ck::TrainingState state() {
    ck::TrainingState s;
    s.model = model.get();
    s.add("optim", *manager);
    return s;
  }
};

}  // namespace

TEST(CkptLoadCuda, StateLoadsIntoGpuTensorsThroughPinnedStaging) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // The default path; a BMT_CKPT_LOAD_IN_PLACE=0 left in the environment would test the old one.
  ::unsetenv("BMT_CKPT_LOAD_IN_PLACE");
  const std::string dir = "/tmp/bmt_ckpt_load_cuda_" + std::to_string(::getpid());
  bmt::InitOptions init = bmt::testing::test_init();
  init.backend = bmt::Backend::kNccl;
  bmt::testing::run_ranks(1, [&] {
    ck::set_stage_chunk_nbytes(64 << 10);  // many chunks through the 4-chunk ring
    GpuTrainer a(11);
    for (int s = 0; s < 2; ++s) a.step(s);
    ck::SaveOptions o;
    o.checksum_block_nbytes = 4096;
    ck::save(dir, a.state(), o).wait();
    const bmt::optim::StateDict want = a.manager->state_dict();
    const bmt::StateDict want_model = bmt::state_dict(*a.model);
    GpuTrainer b(12);  // other values, no optimizer state yet
    ck::TrainingState st = b.state();
    ck::load(dir, st);
    for (const at::Tensor& p : b.model->parameters()) {
      const bmt::optim::AdamState* s = b.adam->find_state(p);
      ASSERT_NE(s, nullptr);
      EXPECT_TRUE(s->exp_avg.is_cuda() && s->master.is_cuda());
    }
    const bmt::optim::StateDict got = b.manager->state_dict();
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [k, v] : want) {
      ASSERT_TRUE(got.count(k)) << k;
      EXPECT_TRUE(at::equal(got.at(k).cpu(), v.cpu())) << k;
    }
    const bmt::StateDict got_model = bmt::state_dict(*b.model);
    for (const auto& [k, v] : want_model) EXPECT_TRUE(at::equal(got_model.at(k).cpu(), v.cpu())) << k;
    ck::set_stage_chunk_nbytes(ck::kDefaultStageChunkNbytes);
    if (bmt::rank() == 0) ck::remove_tree(dir);
  }, init);
}

namespace {

// A plain LibTorch module whose parameters are separate allocations of 2 MiB each: the caching allocator gives
// each its own cudaMalloc segment, and consecutive segments are often adjacent in address space. The staged load
// must copy each parameter on its own (plan_staged_load never merges copies of two items, tests/checkpoint/
// test_load_plan.cpp): a copy spanning two allocations fails in cudaMemcpyAsync or writes the wrong one.
struct SeparateParams : torch::nn::Module {
  explicit SeparateParams(int64_t seed) {
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
    for (int i = 0; i < 6; ++i)
      ps.push_back(register_parameter("p" + std::to_string(i),
                                      at::randn({1024, 1024}, g, at::kFloat).to(at::kBFloat16).to(at::kCUDA)));
  }
  std::vector<at::Tensor> ps;
};

}  // namespace

TEST(CkptLoadCuda, ParametersInSeparateAllocationsLoadInPlaceEachIntoItsOwn) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ::unsetenv("BMT_CKPT_LOAD_IN_PLACE");
  const std::string dir = "/tmp/bmt_ckpt_load_sep_" + std::to_string(::getpid());
  bmt::InitOptions init = bmt::testing::test_init();
  init.backend = bmt::Backend::kNccl;
  bmt::testing::run_ranks(1, [&] {
    ck::set_stage_chunk_nbytes(8 << 20);  // several parameters per staging chunk: copies could merge across them
    SeparateParams a(1);
    ck::TrainingState sa;
    sa.model = &a;
    sa.rng = false;
    ck::save(dir, sa).wait();
    SeparateParams b(2);
    int adjacent = 0;
    for (size_t i = 1; i < b.ps.size(); ++i) {
      const char* end = static_cast<const char*>(b.ps[i - 1].data_ptr()) + b.ps[i - 1].nbytes();
      if (end == b.ps[i].data_ptr()) ++adjacent;
      ASSERT_NE(b.ps[i - 1].data_ptr(), b.ps[i].data_ptr());
    }
    std::printf("[ %d of %zu consecutive parameters are adjacent in device memory ]\n", adjacent, b.ps.size() - 1);
    ck::TrainingState sb;
    sb.model = &b;
    sb.rng = false;
    const ck::LoadInfo info = ck::load(dir, sb);
    EXPECT_GT(info.model_bytes_read, 0);
    torch::cuda::synchronize();
    for (size_t i = 0; i < a.ps.size(); ++i)
      EXPECT_TRUE(at::equal(b.ps[i].cpu(), a.ps[i].cpu())) << "p" << i << " after the in-place load";
    ck::set_stage_chunk_nbytes(ck::kDefaultStageChunkNbytes);
    if (bmt::rank() == 0) ck::remove_tree(dir);
  }, init);
}

// The first async save of a process that prepared no host buffers copies the GPU state into device memory and
// returns (SaveOptions::device_staging), then stages it to the file through a 4-chunk pinned ring. Training that
// runs while the file is written must not reach it: the checkpoint holds the state of the save call, bit for bit,
// on either way (device, and the pinned host snapshot with device_staging off).
TEST(CkptLoadCuda, AsyncSaveWithoutPreparedBuffersHoldsTheStateOfTheCall) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ::unsetenv("BMT_CKPT_DEVICE_STAGING");
  bmt::InitOptions init = bmt::testing::test_init();
  init.backend = bmt::Backend::kNccl;
  bmt::testing::run_ranks(1, [&] {
    for (const bool device_staging : {true, false}) {
      const std::string dir = "/tmp/bmt_ckpt_async_dev_" + std::to_string(::getpid()) + (device_staging ? "d" : "h");
      ck::set_stage_chunk_nbytes(64 << 10);  // frees the cached chunks: none are prepared
      GpuTrainer a(21);
      for (int s = 0; s < 2; ++s) a.step(s);
      const bmt::optim::StateDict want = a.manager->state_dict();
      const bmt::StateDict want_model = bmt::state_dict(*a.model);
      ck::SaveOptions o;
      o.async = true;
      o.device_staging = device_staging;
      ck::SaveHandle h = ck::save(dir, a.state(), o);
      for (int s = 2; s < 5; ++s) a.step(s);  // changes every parameter and moment while the file is written
      const ck::SaveStats stats = h.wait();
      EXPECT_EQ(stats.device_staged, device_staging);
      // The device way borrows only the ring; the host way the whole file.
      const int64_t file_chunks = (stats.rank_nbytes + (64 << 10) - 1) / (64 << 10);
      if (device_staging) EXPECT_LE(ck::host_chunk_count(), ck::kSyncRingChunks);
      else EXPECT_EQ(ck::host_chunk_count(), file_chunks);
      GpuTrainer b(22);
      ck::TrainingState st = b.state();
      ck::load(dir, st);
      const bmt::optim::StateDict got = b.manager->state_dict();
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [k, v] : want) {
        ASSERT_TRUE(got.count(k)) << k;
        EXPECT_TRUE(at::equal(got.at(k).cpu(), v.cpu())) << k << (device_staging ? " (device way)" : " (host way)");
      }
      const bmt::StateDict got_model = bmt::state_dict(*b.model);
      for (const auto& [k, v] : want_model)
        EXPECT_TRUE(at::equal(got_model.at(k).cpu(), v.cpu())) << k << (device_staging ? " (device way)" : " (host way)");
      if (bmt::rank() == 0) ck::remove_tree(dir);
    }
    ck::set_stage_chunk_nbytes(ck::kDefaultStageChunkNbytes);
  }, init);
}
