// World size 2 over NCCL, one process per GPU (run_ranks): skipped (GTEST_SKIP) where fewer than 2 GPUs are visible.
//  - NcclWorld2.CollectivesMatchClosedForms: every Communicator operation (all_reduce with every ReduceOp,
//    reduce_scatter, all_gather, broadcast from each root, send/recv in a group, barrier, split) in every collective
//    dtype, against results computed locally from both ranks' inputs (each rank knows what the other sent).
//  - NcclWorld2.OptimizersMatchPlainLibTorchAdamW/*: the tiny model (ZeRO-3 block list) trained 3 steps at world 2
//    with AdamOptimizer, AdamOffloadOptimizer (synchronous) and AdamOffloadOptimizer (asynchronous, per-Block early
//    start) equals an unsharded plain-LibTorch model trained with torch::optim::AdamW on the CPU.
//  - NcclWorld2.ShardedCheckpointSaveAt2LoadAt1AndBack/*: a sharded checkpoint (model, optimizer state, schedule)
//    saved at world 2 resumes at world 1, is saved again there and resumes at world 2; the losses of the resumed runs
//    equal the uninterrupted world-2 run's (fp32 tolerance: only reduction orders differ). GPU Adam and offload.
//  - NcclWorld2Fault.DeadPeerAbortsTheCommunicatorAndWakesABlockedSync/{Kill,Stop}: rank 1 is killed (or stopped)
//    while rank 0 waits for an all_reduce in a plain cudaStreamSynchronize (as torch's .item() does); the watchdog
//    aborts the communicator, the synchronise returns, and the next call throws a DistError naming the operation,
//    the communicator and rank 1, within the timeout (8 s) + 10 s.
#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/pending_update.h"
#include "bmt/params/module_state.h"
#include "bmt/runtime/stream_sync.h"
#include "ckpt_test_util.h"
#include "collective_dtypes.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

using bmt::core::DType;
using bmt::core::ReduceOp;
namespace ck = bmt::checkpoint;

constexpr int kWorld = 2;

bmt::InitOptions nccl_init() {
  bmt::InitOptions o = bmt::testing::test_init();
  o.backend = bmt::Backend::kNccl;
  return o;
}

#define BMT_NEED_TWO_GPUS()                                                                        \
  if (c10::cuda::device_count() < kWorld)                                                        \
  GTEST_SKIP() << "needs " << kWorld << " GPUs (one NCCL rank per GPU); " << c10::cuda::device_count() \
               << " visible"

cudaStream_t current() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Rank r's input: small integers (exact in every dtype and in sums/products of two), different on each rank.
at::Tensor input_of(int r, int64_t n, at::ScalarType st) {
  at::Tensor i = at::arange(n, at::kDouble);
  at::Tensor v = at::remainder(i * (3 + r) + 5 * r, 13) - 6;
  return v.to(st);
}

at::Tensor reduce_ref(const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  switch (op) {
    case ReduceOp::kSum: return (x + y).to(a.scalar_type());
    case ReduceOp::kAvg:  // integers truncate toward zero, as NCCL's ncclAvg does
      return at::isIntegralType(a.scalar_type(), false) ? at::div(x + y, 2, "trunc").to(a.scalar_type())
                                                        : ((x + y) / 2).to(a.scalar_type());
    case ReduceOp::kMax: return at::maximum(x, y).to(a.scalar_type());
    case ReduceOp::kMin: return at::minimum(x, y).to(a.scalar_type());
    case ReduceOp::kProd: return (x * y).to(a.scalar_type());
  }
  return a;
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  at::Tensor g = got.cpu();  // syncs the current stream
  ASSERT_EQ(g.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(g, want)) << what << " on rank " << bmt::rank();
}

}  // namespace

TEST(NcclWorld2, CollectivesMatchClosedForms) {
  BMT_NEED_TWO_GPUS();
  bmt::testing::run_ranks(kWorld, [] {
    auto& c = *bmt::config().comm;
    ASSERT_EQ(c.size(), kWorld);
    const int me = c.rank(), other = 1 - me;
    const auto dev = bmt::config().device;
    for (const auto& d : bmt::testing::kCollectiveDTypes) {
      for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{(1 << 20) + 3}}) {
        const std::string tag = std::string(d.name) + " n=" + std::to_string(n);
        at::Tensor mine = input_of(me, n, d.st), theirs = input_of(other, n, d.st);
        at::Tensor x = mine.to(dev);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd}) {
          at::Tensor want = reduce_ref(input_of(0, n, d.st), input_of(1, n, d.st), op);
          at::Tensor out = at::empty_like(x);
          c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, op, current());
          expect_equal(out, want, "all_reduce " + tag + " " + bmt::core::reduce_op_name(op));
          // reduce_scatter: 2n inputs (mine, then 2 * mine), rank r gets the reduction of chunk r.
          at::Tensor two = at::cat({mine, mine * 2}).to(dev);
          at::Tensor rs = at::empty({n}, x.options());
          c.reduce_scatter(two.data_ptr(), rs.data_ptr(), n, d.dt, op, current());
          auto chunk = [&](int r, int k) { return k == 0 ? input_of(r, n, d.st) : input_of(r, n, d.st) * 2; };
          expect_equal(rs, reduce_ref(chunk(0, me), chunk(1, me), op),
                       "reduce_scatter " + tag + " " + bmt::core::reduce_op_name(op));
        }
        at::Tensor ag = at::empty({2 * n}, x.options());
        c.all_gather(x.data_ptr(), ag.data_ptr(), n, d.dt, current());
        expect_equal(ag, at::cat({input_of(0, n, d.st), input_of(1, n, d.st)}), "all_gather " + tag);
        at::Tensor ag_in_place = at::zeros({2 * n}, x.options());
        ag_in_place.narrow(0, me * n, n).copy_(x);
        c.all_gather(ag_in_place.narrow(0, me * n, n).data_ptr(), ag_in_place.data_ptr(), n, d.dt, current());
        expect_equal(ag_in_place, at::cat({input_of(0, n, d.st), input_of(1, n, d.st)}), "all_gather in place " + tag);
        for (int root : {0, 1}) {
          at::Tensor bc = at::zeros_like(x);
          c.broadcast(x.data_ptr(), bc.data_ptr(), n, d.dt, root, current());
          expect_equal(bc, input_of(root, n, d.st), "broadcast root " + std::to_string(root) + " " + tag);
        }
        // Both directions at once: a group (one send and one recv per rank) cannot deadlock.
        at::Tensor got = at::zeros_like(x);
        c.group_start();
        c.send(x.data_ptr(), n, d.dt, other, current());
        c.recv(got.data_ptr(), n, d.dt, other, current());
        c.group_end();
        expect_equal(got, theirs, "send/recv " + tag);
      }
    }
    c.barrier();
    // Split: a communicator of one per rank (the identity) and a renamed copy of the world.
    auto alone = c.split(me, 0, "alone");
    auto both = c.split(0, other, "reversed");  // key = other rank: the order flips
    EXPECT_EQ(alone->size(), 1);
    EXPECT_EQ(both->size(), 2);
    EXPECT_EQ(both->rank(), other);
    at::Tensor v = at::full({4}, static_cast<float>(me + 1), at::TensorOptions().device(dev));
    both->all_reduce(v.data_ptr(), v.data_ptr(), 4, DType::kFloat32, ReduceOp::kSum, current());
    expect_equal(v, at::full({4}, 3.0f), "all_reduce on the split communicator");
    alone->all_reduce(v.data_ptr(), v.data_ptr(), 4, DType::kFloat32, ReduceOp::kSum, current());
    expect_equal(v, at::full({4}, 3.0f), "all_reduce on a communicator of one");
    both->synchronize(current());
    c.check_async_error();
  }, nccl_init());
}

namespace {

enum class OptKind { kAdam, kOffload, kOffloadAsync };

std::string kind_name(const ::testing::TestParamInfo<OptKind>& info) {
  switch (info.param) {
    case OptKind::kAdam: return "Adam";
    case OptKind::kOffload: return "Offload";
    case OptKind::kOffloadAsync: return "OffloadAsync";
  }
  return "?";
}

constexpr uint64_t kSeed = 91;
constexpr int kSteps = 3;
constexpr int64_t kBatch = 8, kSeq = 6;

at::Tensor tokens(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(900 + step);
  return at::randint(0, 16, {kBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

bmt::optim::AdamOptions adam_options() {
  bmt::optim::AdamOptions o(1e-2);
  o.weight_decay(0.01);
  o.decoupled_weight_decay(true);  // the reference is torch::optim::AdamW
  return o;
}

}  // namespace

class NcclWorld2Optim : public ::testing::TestWithParam<OptKind> {};

TEST_P(NcclWorld2Optim, OptimizersMatchPlainLibTorchAdamW) {
  BMT_NEED_TWO_GPUS();
  const OptKind kind = GetParam();
  bmt::testing::run_ranks(kWorld, [kind] {
    at::globalContext().setAllowTF32CuBLAS(false);
    tiny::Dims d;
    // The reference: unsharded, on the CPU, torch::optim::AdamW over the whole batch.
    auto plist = tiny::reference_params(d, kSeed);
    std::map<std::string, at::Tensor> P(plist.begin(), plist.end());
    std::vector<at::Tensor> ref_params;
    for (auto& kv : plist) ref_params.push_back(kv.second);
    torch::optim::AdamW ref_opt(ref_params, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.999}).eps(1e-8)
                                                .weight_decay(0.01));
    for (int s = 0; s < kSteps; ++s) {
      at::Tensor tok = tokens(s);
      at::Tensor logits = tiny::reference_logits(d, P, tok.narrow(1, 0, kSeq));
      at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})).backward();
      ref_opt.step();
      ref_opt.zero_grad();
    }
    // World 2 over NCCL, ZeRO-3 with the block list.
    tiny::Model model(d, {}, true);
    std::map<std::string, at::Tensor> init;
    for (auto& kv : tiny::reference_params(d, kSeed)) init[kv.first] = kv.second.detach();
    bmt::load_state_dict(model, init);
    std::shared_ptr<bmt::optim::AdamBase> opt;
    int hook = -1;
    if (kind == OptKind::kAdam) {
      opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), adam_options());
    } else {
      auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters(), adam_options());
      if (kind == OptKind::kOffloadAsync) {
        off->set_async_step(true);
        hook = bmt::add_grad_ready_hook([off](bmt::Block& b) {
          bmt::wait_for_gradient_reduction();
          off->step_params(b.module()->parameters());
        });
      }
      opt = off;
    }
    const int64_t per_rank = kBatch / kWorld;
    for (int s = 0; s < kSteps; ++s) {
      at::Tensor tok = tokens(s).narrow(0, bmt::rank() * per_rank, per_rank).to(bmt::config().device);
      at::Tensor logits = model.forward(tok.narrow(1, 0, kSeq));
      // Gradients are summed over the ranks: the mean over the global batch is the sum of the halves / 2.
      (at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})) / kWorld)
          .backward();
      bmt::wait_for_gradient_reduction();
      opt->step();
      opt->zero_grad();
    }
    bmt::StateDict sd = bmt::state_dict(model);  // waits for asynchronous updates
    EXPECT_EQ(bmt::num_pending_updates(), 0u);
    if (hook >= 0) bmt::remove_grad_ready_hook(hook);
    for (auto& kv : P) {
      ASSERT_TRUE(sd.count(kv.first)) << kv.first;
      EXPECT_LT((sd[kv.first].cpu() - kv.second.detach()).abs().max().item<double>(), 1e-4)
          << kv.first << " rank " << bmt::rank();
    }
  }, nccl_init());
}
INSTANTIATE_TEST_SUITE_P(Kinds, NcclWorld2Optim,
                         ::testing::Values(OptKind::kAdam, OptKind::kOffload, OptKind::kOffloadAsync), kind_name);

namespace {

// ckpt_test::Trainer's schedule and data on the GPU, with GPU Adam or the offloaded optimizer.
struct GpuTrainer {
  tiny::Dims dims;
  std::unique_ptr<tiny::Model> model;
  std::shared_ptr<bmt::optim::AdamBase> adam;
  std::shared_ptr<bmt::optim::lr_scheduler::Cosine> sched;
  std::unique_ptr<bmt::optim::OptimManager> manager;

  explicit GpuTrainer(bool offload) {
    bmt::BlockOptions opts;
    opts.zero_level = 3;
    model = std::make_unique<tiny::Model>(dims, opts, true);
    at::manual_seed(ckpt_test::kSeed);
    bmt::init_parameters(*model);
    if (offload)
      adam = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model->parameters(), bmt::optim::AdamOptions(2e-2));
    else
      adam = std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), bmt::optim::AdamOptions(2e-2));
    sched = std::make_shared<bmt::optim::lr_scheduler::Cosine>(adam, 2e-2, 2, 12);
    manager = std::make_unique<bmt::optim::OptimManager>();
    manager->add_optimizer(adam, sched);
  }
  ck::TrainingState state(int64_t step) {
    ck::TrainingState s;
    s.model = model.get();
    s.add("optim", *manager);
    s.step = step;
    return s;
  }
  double step(int step) {
    const auto& cfg = bmt::config();
    const int64_t per_rank = ckpt_test::kGlobalBatch / cfg.world_size;
    at::Tensor tok = ckpt_test::batch_tokens(step).narrow(0, cfg.rank * per_rank, per_rank).to(cfg.device);
    at::Tensor logits = model->forward(tok.narrow(1, 0, ckpt_test::kSeq));
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, dims.vocab}),
                                             tok.narrow(1, 1, ckpt_test::kSeq).reshape({-1}));
    manager->backward(loss);
    manager->step();
    manager->zero_grad();
    return bmt::sum_loss(loss.detach()).item<double>();
  }
};

constexpr int kBefore = 3, kAfter = 3;

void resume_and_compare(const ckpt_test::SharedDir& dir, const std::string& from, bool offload, int saved_world) {
  at::globalContext().setAllowTF32CuBLAS(false);
  GpuTrainer t(offload);
  t.step(100);  // a perturbation the load must overwrite
  ck::TrainingState st = t.state(0);
  ck::LoadInfo info = ck::load(dir / from, st);
  EXPECT_EQ(info.step, kBefore);
  EXPECT_EQ(info.saved_world_size, saved_world);
  std::vector<double> ref = ckpt_test::read_doubles(dir / "losses.txt");
  ASSERT_EQ(ref.size(), static_cast<size_t>(kAfter));
  for (int s = 0; s < kAfter; ++s)
    EXPECT_NEAR(t.step(kBefore + s), ref[s], 2e-5 * std::abs(ref[s]))
        << "step " << kBefore + s << " at world " << bmt::world_size() << " from " << from;
}

}  // namespace

class NcclWorld2Ckpt : public ::testing::TestWithParam<bool> {};

TEST_P(NcclWorld2Ckpt, ShardedCheckpointSaveAt2LoadAt1AndBack) {
  BMT_NEED_TWO_GPUS();
  const bool offload = GetParam();
  ckpt_test::SharedDir dir(offload ? "nccl_offload" : "nccl_adam");
  bmt::testing::run_ranks(kWorld, [&] {
    at::globalContext().setAllowTF32CuBLAS(false);
    GpuTrainer t(offload);
    for (int s = 0; s < kBefore; ++s) t.step(s);
    ck::save(dir / "at2", t.state(kBefore)).wait();
    std::vector<double> losses;
    for (int s = 0; s < kAfter; ++s) losses.push_back(t.step(kBefore + s));
    if (bmt::rank() == 0) ckpt_test::write_doubles(dir / "losses.txt", losses);
  }, nccl_init());
  // World 1: resume from the world-2 checkpoint; then load it again and save it at world 1.
  bmt::testing::run_ranks(1, [&] {
    resume_and_compare(dir, "at2", offload, 2);
    GpuTrainer t(offload);
    ck::TrainingState st = t.state(0);
    ck::load(dir / "at2", st);
    ck::save(dir / "at1", t.state(kBefore)).wait();
  }, nccl_init());
  // Back at world 2, from the world-1 checkpoint.
  bmt::testing::run_ranks(kWorld, [&] { resume_and_compare(dir, "at1", offload, 1); }, nccl_init());
}
INSTANTIATE_TEST_SUITE_P(Optimizer, NcclWorld2Ckpt, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Offload" : "Adam"; });

namespace {

std::string status_of(const bmt::testing::RankRunReport& report, int r) {
  std::string head = "rank " + std::to_string(r) + " of " + std::to_string(kWorld) + " failed (";
  auto pos = report.summary.find(head);
  if (pos == std::string::npos) return "ok";
  pos += head.size();
  return report.summary.substr(pos, report.summary.find_first_of(";,)", pos) - pos);
}

}  // namespace

class NcclWorld2Fault : public ::testing::TestWithParam<int> {};

TEST_P(NcclWorld2Fault, DeadPeerAbortsTheCommunicatorAndWakesABlockedSync) {
  BMT_NEED_TWO_GPUS();
  const int sig = GetParam();
  constexpr int kTimeoutS = 8;
  bmt::InitOptions init = nccl_init();
  init.timeout = std::chrono::seconds(kTimeoutS);
  bmt::testing::RankRunOptions run;
  run.kill_on_first_failure = false;
  run.expect_failure = true;
  run.wall_timeout = std::chrono::seconds(120);
  auto report = bmt::testing::run_ranks(kWorld, [sig] {
    using Clock = std::chrono::steady_clock;
    auto& cfg = bmt::config();
    auto& c = *cfg.comm;
    if (bmt::rank() == 1) {
      std::string pid = std::to_string(getpid());
      cfg.store->set("test/rank1_pid", std::vector<uint8_t>(pid.begin(), pid.end()));
    }
    c.barrier();
    at::Tensor x = at::ones({1 << 20}, at::TensorOptions().device(cfg.device));
    if (bmt::rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 waits in its all_reduce by now
      raise(sig);
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
    auto t0 = Clock::now();
    auto since = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    c.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), DType::kFloat32, ReduceOp::kSum, current());
    cudaError_t sync = cudaStreamSynchronize(current());  // a plain blocking wait: only an abort ends it
    std::printf("rank 0: the blocked synchronise returned after %.2f s (%s)\n", since(), cudaGetErrorString(sync));
    int code = 44;  // no error raised
    try {
      for (int i = 0; i < 3; ++i) {
        c.all_reduce(x.data_ptr(), x.data_ptr(), x.numel(), DType::kFloat32, ReduceOp::kSum, current());
        c.synchronize(current());
      }
    } catch (const bmt::core::DistError& e) {
      const std::string m = e.what();
      std::printf("rank 0: DistError after %.2f s: %s\n", since(), m.c_str());
      code = 42;
      for (const char* part : {"all_reduce", "'world'", "rank 1 is dead"})
        if (m.find(part) == std::string::npos) {
          std::printf("rank 0: the message lacks '%s'\n", part);
          code = 43;
        }
      if (code == 42 && since() > kTimeoutS + 10.0) code = 45;
    }
    auto pid = cfg.store->get("test/rank1_pid");
    kill(std::atoi(std::string(pid.begin(), pid.end()).c_str()), SIGKILL);  // a stopped rank would linger
    std::fflush(stdout);
    std::_Exit(code);
  }, init, run);
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 0), "exit code 42") << report.summary;
  EXPECT_EQ(status_of(report, 1), "signal Killed") << report.summary;
}
INSTANTIATE_TEST_SUITE_P(Signals, NcclWorld2Fault, ::testing::Values(SIGKILL, SIGSTOP),
                         [](const ::testing::TestParamInfo<int>& i) { return i.param == SIGKILL ? "Kill" : "Stop"; });
