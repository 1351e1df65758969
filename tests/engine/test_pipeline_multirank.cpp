// Pipeline parallelism (PipelineTransformerBlockList) on CPU ranks over Gloo against the unsharded model in plain
// LibTorch (pipe_test_model.h): pp 2 and 4, pp2 x dp2 (ZeRO-2 and 3), pp2 x tp2, activation checkpointing on and
// off, 1F1B and GPipe. Each run trains 3 steps of torch::optim::Adam-equivalent AdamOptimizer under an OptimManager
// with loss scaling and global-norm clipping; the losses (sum_loss), the global gradient norms (clip_grad_norm:
// across stages) and every parameter after every step match the reference (Adam eps 1e-4 keeps fp32
// summation-order noise below 1e-6 of an update; bounds 2e-5). Also: a checkpoint (sharded with optimizer state,
// and consolidated) saved at pp 2 loads at pp 1 and pp 4 and training continues identically; an inf on one stage
// skips the step on all; the schedules pair every transfer (simulated); bad sizes are refused. Label multirank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <optional>
#include <set>

#include <torch/optim/adam.h>

#include "bmt/checkpoint/checkpoint.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/runtime/distributed.h"
#include "bmt/params/module_state.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "bmt/pipeline/pipeline.h"
#include "pipe_test_model.h"
#include "run_ranks.h"

namespace {

using bmt::testing::run_ranks;

constexpr uint64_t kSeed = 99;
constexpr int kSteps = 3;
constexpr int64_t kBatch = 24, kSeq = 4;  // 24 rows: dp 1 or 2 x 4 or 6 micro-batches
constexpr double kLr = 1e-2, kEps = 1e-4, kMaxNorm = 0.5;

at::Tensor batch_tokens(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5000 + step);
  return at::randint(0, 16, {kBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

struct RefStep {
  double loss = 0, grad_norm = 0;
  std::map<std::string, at::Tensor> params;  // after the step
};

// Plain LibTorch: whole batch, clip to kMaxNorm, torch::optim::Adam. Steps from `first_step`.
std::vector<RefStep> reference(const pipe_test::Dims& d, int steps) {
  std::map<std::string, at::Tensor> P = pipe_test::reference_params(d, kSeed);
  std::vector<at::Tensor> leaves;
  for (auto& kv : P) leaves.push_back(kv.second.requires_grad_());
  torch::optim::Adam adam(leaves, torch::optim::AdamOptions(kLr).eps(kEps));
  std::vector<RefStep> out;
  for (int s = 0; s < steps; ++s) {
    adam.zero_grad();
    RefStep r;
    at::Tensor loss = pipe_test::reference_loss(d, P, batch_tokens(s));
    loss.backward();
    r.loss = loss.item<double>();
    double sq = 0;
    for (auto& l : leaves) sq += l.grad().pow(2).sum().item<double>();
    r.grad_norm = std::sqrt(sq);
    if (r.grad_norm > kMaxNorm) {
      at::NoGradGuard ng;
      for (auto& l : leaves) l.mutable_grad().mul_(kMaxNorm / (r.grad_norm + 1e-6));
    }
    adam.step();
    for (auto& kv : P) r.params[kv.first] = kv.second.detach().clone();
    out.push_back(r);
  }
  return out;
}

// Loads the reference initial parameters; every key of this stage's model must be found.
void load_reference(torch::nn::Module& model, const pipe_test::Dims& d) {
  bmt::StateDict init;
  for (auto& kv : pipe_test::reference_params(d, kSeed)) init[kv.first] = kv.second;
  bmt::LoadResult r = bmt::load_state_dict(model, init, /*strict=*/false);
  ASSERT_TRUE(r.missing_keys.empty());
}

struct Trainer {
  Trainer(pipe_test::Net& net) : net(net) {
    adam = std::make_shared<bmt::optim::AdamOptimizer>(net.parameters(),
                                                       bmt::optim::AdamOptions(kLr, {0.9, 0.999}, kEps));
    bmt::optim::OptimManagerOptions mo;
    mo.loss_scale = 1024;
    manager = std::make_unique<bmt::optim::OptimManager>(mo);
    manager->add_optimizer(adam);
  }
  // One step on this data-parallel rank's rows of batch `s`; returns (world mean loss, gradient norm).
  std::pair<double, double> step(int s) {
    const bmt::Topology& t = bmt::config().topology;
    const int64_t per = kBatch / t.dp_size;
    at::Tensor mine = batch_tokens(s).narrow(0, t.pp_tp_zero_id * per, per);
    auto st = net.step(mine);
    st.scale_loss = [this](const at::Tensor& l) { return manager->scale_loss(l); };
    at::Tensor loss = net.layers->forward_backward(st);
    const double norm = manager->clip_grad_norm(kMaxNorm);
    EXPECT_TRUE(manager->step());
    manager->zero_grad();
    return {bmt::sum_loss(loss).item<double>(), norm};
  }
  pipe_test::Net& net;
  std::shared_ptr<bmt::optim::AdamOptimizer> adam;
  std::unique_ptr<bmt::optim::OptimManager> manager;
};

void expect_params(torch::nn::Module& model, const std::map<std::string, at::Tensor>& ref, const std::string& what) {
  bmt::StateDict sd = bmt::state_dict(model);
  ASSERT_FALSE(sd.empty()) << what;
  for (auto& kv : sd) {
    ASSERT_TRUE(ref.count(kv.first)) << what << ": unexpected key " << kv.first;
    EXPECT_LT((kv.second - ref.at(kv.first)).abs().max().item<double>(), 2e-5) << what << ": " << kv.first;
  }
}

// The keys this stage must hold.
std::set<std::string> expected_keys(const pipe_test::Dims& d, const bmt::PipelineTransformerBlockList& pipe) {
  std::set<std::string> k;
  if (pipe.is_first_stage()) k.insert("embed.weight");
  for (int64_t l = pipe.layer_range().first; l < pipe.layer_range().second; ++l)
    for (const char* n : {"ln.weight", "ln.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"})
      k.insert("layers." + std::to_string(l) + "." + n);
  if (pipe.is_last_stage()) k.insert({"ln_f.weight", "ln_f.bias", "head.weight"});
  return k;
}

struct Case {
  Case(int zero, bool ckpt, bmt::PipeSchedule schedule, int micro, bool tp = false, std::vector<int64_t> part = {})
      : zero(zero), ckpt(ckpt), schedule(schedule), micro(micro), tp(tp), partition(std::move(part)) {}
  int zero;
  bool ckpt;
  bmt::PipeSchedule schedule;
  int micro;
  bool tp;
  std::vector<int64_t> partition;
};

void run_case(const Case& c, const pipe_test::Dims& d, const std::vector<RefStep>& ref) {
  const auto& cfg = bmt::config();
  const std::string what = "pp " + std::to_string(cfg.pipe_size) + " dp " + std::to_string(cfg.topology.dp_size) +
                           " tp " + std::to_string(cfg.tp_size) + " zero " + std::to_string(c.zero) + " ckpt " +
                           std::to_string(c.ckpt) + " " + bmt::pipe_schedule_name(c.schedule) + " M " +
                           std::to_string(c.micro);
  bmt::BlockOptions bo;
  bo.zero_level = c.zero;
  bo.use_checkpoint = c.ckpt;
  bmt::PipelineOptions po;
  po.schedule = c.schedule;
  po.num_micro_batches = c.micro;
  po.partition = c.partition;
  pipe_test::Net net(d, bo, po, c.tp);
  std::set<std::string> keys;
  for (auto& p : net.named_parameters()) keys.insert(p.key());
  EXPECT_EQ(keys, expected_keys(d, *net.layers)) << what;
  load_reference(net, d);
  Trainer tr(net);
  for (int s = 0; s < kSteps; ++s) {
    auto [loss, norm] = tr.step(s);
    EXPECT_NEAR(loss, ref[s].loss, 2e-5 * std::abs(ref[s].loss)) << what << " step " << s;
    EXPECT_NEAR(norm, ref[s].grad_norm, 2e-5 * ref[s].grad_norm) << what << " step " << s;
    expect_params(net, ref[s].params, what + " step " + std::to_string(s));
  }
}

bmt::InitOptions pipe_init(int pp, int tp = 1) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.pipe_size = pp;
  o.tp_size = tp;
  o.sequence_parallel = false;  // TpMlpLayer's replicated activations
  return o;
}

// The same path in the test process and in its rank processes.
struct SharedDir {
  SharedDir() {
    const int owner = bmt::testing::in_rank_process() ? getppid() : getpid();
    path = "/tmp/bmt_pipe_mr_" + std::to_string(owner);
    if (!bmt::testing::in_rank_process()) {
      bmt::checkpoint::remove_tree(path);  // not std::filesystem: libtorch exports an incompatible copy
      bmt::checkpoint::make_directory(path);
    }
  }
  ~SharedDir() {
    if (!bmt::testing::in_rank_process() && !::testing::Test::HasFailure()) bmt::checkpoint::remove_tree(path);
  }
  std::string path;
};

}  // namespace

TEST(PipelineSchedule, EveryTransferIsPairedAndNothingDeadlocksUnderRendezvousSends) {
  using A = bmt::PipeAction;
  for (auto sched : {bmt::PipeSchedule::k1F1B, bmt::PipeSchedule::kGPipe})
    for (int P = 1; P <= 5; ++P)
      for (int M = 1; M <= 7; ++M) {
        std::vector<std::vector<A>> acts;
        for (int s = 0; s < P; ++s) acts.push_back(bmt::pipe_schedule(sched, s, P, M));
        std::vector<size_t> pc(P, 0);
        // Every transfer blocks until its partner is at the head of the neighbour's list (the strictest transport).
        auto partner = [&](int s, const A& a, int& peer) -> std::optional<A> {
          switch (a.kind) {
            case A::kRecvAct: peer = s - 1; return A{A::kSendAct, a.micro};
            case A::kSendAct: peer = s + 1; return A{A::kRecvAct, a.micro};
            case A::kRecvGrad: peer = s + 1; return A{A::kSendGrad, a.micro};
            case A::kSendGrad: peer = s - 1; return A{A::kRecvGrad, a.micro};
            case A::kSendActRecvGrad: peer = s + 1; return A{A::kSendGradRecvAct, a.other, a.micro};
            case A::kSendGradRecvAct: peer = s - 1; return A{A::kSendActRecvGrad, a.other, a.micro};
            default: return std::nullopt;
          }
        };
        std::vector<std::set<int>> fwd(P), bwd(P);
        int in_flight_max = 0;
        for (bool progress = true; progress;) {
          progress = false;
          for (int s = 0; s < P; ++s) {
            if (pc[s] == acts[s].size()) continue;
            const A& a = acts[s][pc[s]];
            int peer = -1;
            auto want = partner(s, a, peer);
            if (!want) {
              if (a.kind == A::kForward) {
                EXPECT_TRUE(fwd[s].insert(a.micro).second);
              } else {
                EXPECT_TRUE(fwd[s].count(a.micro)) << "backward before forward";
                EXPECT_TRUE(bwd[s].insert(a.micro).second);
              }
              in_flight_max = std::max<int>(in_flight_max, static_cast<int>(fwd[s].size() - bwd[s].size()));
              ++pc[s];
              progress = true;
              continue;
            }
            ASSERT_TRUE(peer >= 0 && peer < P) << "transfer to a missing stage";
            if (pc[peer] == acts[peer].size()) continue;
            const A& b = acts[peer][pc[peer]];
            if (b.kind == want->kind && b.micro == want->micro && b.other == want->other) {
              ++pc[s];
              ++pc[peer];
              progress = true;
            }
          }
        }
        for (int s = 0; s < P; ++s) {
          ASSERT_EQ(pc[s], acts[s].size()) << bmt::pipe_schedule_name(sched) << " P " << P << " M " << M
                                           << ": stage " << s << " deadlocked at "
                                           << bmt::to_string(acts[s][pc[s]]);
          EXPECT_EQ(static_cast<int>(fwd[s].size()), M);
          EXPECT_EQ(static_cast<int>(bwd[s].size()), M);
        }
        if (sched == bmt::PipeSchedule::k1F1B) EXPECT_LE(in_flight_max, std::min(P, M));
      }
}

TEST(PipelineTopology, SizesThatDoNotDivideAreRefusedWithTheFix) {
  try {
    bmt::make_topology(0, 6, 4, 1);
    ADD_FAILURE() << "no error";
  } catch (const bmt::core::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("pipe_size (4)"), std::string::npos) << m;
    EXPECT_NE(m.find("does not divide 6"), std::string::npos) << m;
    EXPECT_NE(m.find("Choose pipe_size and tp_size"), std::string::npos) << m;
  }
  // BMTrain's layout: world 8 = pp 2 x dp 2 x tp 2.
  bmt::Topology t = bmt::make_topology(6, 8, 2, 2);
  EXPECT_EQ(t.stage_id, 1);
  EXPECT_EQ(t.pipe_idx, 2);
  EXPECT_EQ(t.tp_id, 0);
  EXPECT_EQ(t.tp_idx, 3);
  EXPECT_EQ(t.pp_tp_zero_id, 1);
  EXPECT_EQ(t.pp_tp_zero_idx, 2);
  EXPECT_EQ(t.dp_size, 2);
  EXPECT_EQ(t.stage_rank(0), 2);
  EXPECT_EQ(t.get_group_rank("pipe"), 1);
  EXPECT_EQ(t.get_group_id("pipe"), 2);
  EXPECT_EQ(t.get_group_rank("tp_zero"), 1);
  EXPECT_THROW(t.get_group_rank("nope"), bmt::core::Error);
}

TEST(PipelineMultirank, Pp2MatchesPlainLibTorch) {
  pipe_test::Dims d;
  const auto ref = reference(d, kSteps);
  run_ranks(2, [&] {
    const auto& t = bmt::config().topology;
    ASSERT_EQ(bmt::config().pipe_size, 2);
    EXPECT_EQ(t.stage_id, bmt::rank());
    EXPECT_EQ(bmt::config().num_micro_batches, 2);  // default: pipe_size
    for (auto sched : {bmt::PipeSchedule::k1F1B, bmt::PipeSchedule::kGPipe})
      for (bool ckpt : {true, false}) run_case(Case{3, ckpt, sched, 4}, d, ref);
    run_case(Case{2, true, bmt::PipeSchedule::k1F1B, 4, false, {1, 3}}, d, ref);  // ZeRO-2, uneven partition
    // Errors name the fix.
    bmt::PipelineOptions po;
    po.partition = {1, 2};
    EXPECT_THROW(pipe_test::Net(d, {}, po), bmt::core::Error);
  }, pipe_init(2));
}

TEST(PipelineMultirank, Pp4MatchesPlainLibTorch) {
  pipe_test::Dims d;
  d.layers = 5;  // uneven: 2, 1, 1, 1
  const auto ref = reference(d, kSteps);
  run_ranks(4, [&] {
    run_case(Case{3, true, bmt::PipeSchedule::k1F1B, 6}, d, ref);
    run_case(Case{3, false, bmt::PipeSchedule::kGPipe, 3}, d, ref);
    run_case(Case{3, false, bmt::PipeSchedule::k1F1B, 2}, d, ref);  // fewer micro-batches than stages
  }, pipe_init(4));
}

TEST(PipelineMultirank, Pp2Dp2MatchesPlainLibTorch) {
  pipe_test::Dims d;
  const auto ref = reference(d, kSteps);
  run_ranks(4, [&] {
    ASSERT_EQ(bmt::config().topology.dp_size, 2);
    ASSERT_EQ(bmt::config().zero_size, 2);
    run_case(Case{3, true, bmt::PipeSchedule::k1F1B, 3}, d, ref);
    run_case(Case{2, false, bmt::PipeSchedule::k1F1B, 3}, d, ref);
    run_case(Case{3, false, bmt::PipeSchedule::kGPipe, 2}, d, ref);
  }, pipe_init(2));
}

TEST(PipelineMultirank, Pp2Tp2MatchesPlainLibTorch) {
  pipe_test::Dims d;
  const auto ref = reference(d, kSteps);
  run_ranks(4, [&] {
    ASSERT_EQ(bmt::config().tp_size, 2);
    run_case(Case{3, true, bmt::PipeSchedule::k1F1B, 4, true}, d, ref);
    run_case(Case{2, false, bmt::PipeSchedule::kGPipe, 4, true}, d, ref);
  }, pipe_init(2, 2));
}

TEST(PipelineMultirank, InfOnOneStageSkipsTheStepEverywhere) {
  pipe_test::Dims d;
  run_ranks(2, [&] {
    bmt::PipelineOptions po;
    po.num_micro_batches = 2;
    pipe_test::Net net(d, {}, po);
    load_reference(net, d);
    Trainer tr(net);
    auto st = net.step(batch_tokens(0));
    st.scale_loss = [&](const at::Tensor& l) { return tr.manager->scale_loss(l); };
    net.layers->forward_backward(st);
    if (net.layers->is_last_stage()) bmt::main_grad(net.head->weight).view({-1})[0] = INFINITY;
    EXPECT_FALSE(tr.manager->step());
    EXPECT_DOUBLE_EQ(tr.manager->loss_scale(), 512.0);
  }, pipe_init(2));
}

TEST(PipelineMultirank, CheckpointSavedAtPp2LoadsAtPp1AndPp4) {
  pipe_test::Dims d;
  const auto ref = reference(d, 2);
  SharedDir dir;
  auto state_of = [](pipe_test::Net& net, Trainer& tr) {
    bmt::checkpoint::TrainingState st;
    st.model = &net;
    st.add("optim", *tr.manager);
    return st;
  };
  run_ranks(2, [&] {
    pipe_test::Net net(d, {}, {});
    load_reference(net, d);
    Trainer tr(net);
    tr.step(0);
    bmt::checkpoint::save(dir.path + "/sharded", state_of(net, tr)).wait();
    bmt::save(net, dir.path + "/model.safetensors");
  }, pipe_init(2));
  for (int pp : {1, 4}) {
    run_ranks(pp, [&] {
      const std::string what = "load at pp " + std::to_string(pp);
      {
        pipe_test::Net net(d, {}, {});
        bmt::LoadResult r = bmt::load(net, dir.path + "/model.safetensors");
        EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty()) << what;
        expect_params(net, ref[0].params, what + " consolidated");
      }
      pipe_test::Net net(d, {}, {});
      Trainer tr(net);
      auto st = state_of(net, tr);
      bmt::checkpoint::LoadInfo info = bmt::checkpoint::load(dir.path + "/sharded", st);
      EXPECT_TRUE(info.missing_keys.empty() && info.unexpected_keys.empty()) << what;
      expect_params(net, ref[0].params, what + " sharded");
      auto [loss, norm] = tr.step(1);  // Adam moments and the loss scale came back too
      EXPECT_NEAR(loss, ref[1].loss, 2e-5 * ref[1].loss) << what;
      expect_params(net, ref[1].params, what + " sharded, one more step");
    }, pipe_init(pp));
  }
}
