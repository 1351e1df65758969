// The NCCL backend at world size 1, in this single process (RANK / WORLD_SIZE unset): bmt::init_distributed with
// backend kNccl, then every operation of the Communicator interface and of bmt::distributed on CUDA tensors.
// At world size 1 every collective is the identity (sum / avg / max / min / prod of one value is that value),
// so the expected result of each op is its input, bit for bit, in every dtype.
// Also: stream ordering (a collective on config().load_stream ordered after a kernel on the current stream by a
// CUDA event), check_async_error, synchronize, barrier, split and argument errors.
// Needs a GPU; skipped (not failed) where none is visible.
#include <gtest/gtest.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "collective_dtypes.h"
#include "run_ranks.h"

namespace {

using bmt::core::Communicator;
using bmt::core::DType;
using bmt::core::ReduceOp;
namespace bd = bmt::distributed;

using DT = bmt::testing::CollectiveDType;
constexpr const auto& kDTypes = bmt::testing::kCollectiveDTypes;
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd};

// Initialises bmtrain once per process as a world of one over NCCL.
void ensure_initialized() {
  if (bmt::is_initialized()) return;
  for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                        "BMT_TIMEOUT_S", "TORCHELASTIC_USE_AGENT_STORE"})
    unsetenv(v);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  static const bmt::testing::PortReservation port;  // held for the process's life: the store binds it too
  setenv("MASTER_PORT", std::to_string(port.port()).c_str(), 1);
  bmt::InitOptions o;
  o.backend = bmt::Backend::kNccl;
  o.quiet = true;
  o.timeout = std::chrono::seconds(60);
  bmt::init_distributed(o);
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (c10::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
    ensure_initialized();
  }
};

at::TensorOptions cuda(at::ScalarType st) { return at::TensorOptions().dtype(st).device(bmt::config().device); }

// Values exactly representable in the dtype: small integers and halves, with both signs.
at::Tensor values(int64_t n, at::ScalarType st, int salt = 0) {
  at::Tensor i = at::arange(n, at::TensorOptions().dtype(at::kDouble).device(bmt::config().device));
  at::Tensor v = at::remainder(i * 7 + salt, 97) - 48;
  if (at::isFloatingType(st)) v = v / 2;
  return v.to(st);
}

cudaStream_t current() { return c10::cuda::getCurrentCUDAStream().stream(); }

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got.cpu(), want.cpu())) << what;  // .cpu() syncs the current stream
}

std::string label(const char* op, const DT& d, int64_t n) {
  return bmt::core::concat(op, " ", d.name, " n=", n);
}

void raw_identity_checks(Communicator& c, const std::vector<int64_t>& counts) {
  for (const DT& d : kDTypes) {
    for (int64_t n : counts) {
      at::Tensor x = values(n, d.st);
      for (ReduceOp op : kOps) {
        std::string name = label("all_reduce", d, n) + " " + bmt::core::reduce_op_name(op);
        at::Tensor out = at::full({n}, 99, cuda(d.st));
        c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, op, current());
        expect_same(out, x, name);
        at::Tensor inplace = x.clone();
        c.all_reduce(inplace.data_ptr(), inplace.data_ptr(), n, d.dt, op, current());
        expect_same(inplace, x, name + " in place");
        at::Tensor rs = at::full({n}, 99, cuda(d.st));
        c.reduce_scatter(x.data_ptr(), rs.data_ptr(), n, d.dt, op, current());
        expect_same(rs, x, label("reduce_scatter", d, n) + " " + bmt::core::reduce_op_name(op));
      }
      at::Tensor ag = at::full({n}, 99, cuda(d.st));
      c.all_gather(x.data_ptr(), ag.data_ptr(), n, d.dt, current());
      expect_same(ag, x, label("all_gather", d, n));
      at::Tensor ag_inplace = x.clone();
      c.all_gather(ag_inplace.data_ptr(), ag_inplace.data_ptr(), n, d.dt, current());
      expect_same(ag_inplace, x, label("all_gather in place", d, n));
      at::Tensor bc = at::full({n}, 99, cuda(d.st));
      c.broadcast(x.data_ptr(), bc.data_ptr(), n, d.dt, 0, current());
      expect_same(bc, x, label("broadcast", d, n));
      // Several operations in one group.
      at::Tensor g1 = at::empty({n}, cuda(d.st)), g2 = at::empty({n}, cuda(d.st));
      c.group_start();
      c.all_reduce(x.data_ptr(), g1.data_ptr(), n, d.dt, ReduceOp::kAvg, current());
      c.broadcast(x.data_ptr(), g2.data_ptr(), n, d.dt, 0, current());
      c.group_end();
      expect_same(g1, x, label("grouped all_reduce avg", d, n));
      expect_same(g2, x, label("grouped broadcast", d, n));
    }
  }
  c.synchronize(current());
  c.check_async_error();
}

}  // namespace

TEST_F(Nccl, InitialisesAWorldOfOne) {
  const auto& cfg = bmt::config();
  EXPECT_EQ(cfg.world_size, 1);
  EXPECT_EQ(cfg.rank, 0);
  EXPECT_EQ(cfg.backend, bmt::Backend::kNccl);
  EXPECT_TRUE(cfg.device.is_cuda());
  EXPECT_EQ(cfg.device.index(), 0);
  for (auto* c : {cfg.comm.get(), cfg.zero_comm.get(), cfg.tp_comm.get(), cfg.tp_zero_comm.get(),
                  cfg.pipe_comm.get()}) {
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->size(), 1);
    EXPECT_EQ(c->rank(), 0);
    EXPECT_STREQ(c->backend_name(), "nccl");
    EXPECT_EQ(c->device_kind(), bmt::core::DeviceKind::kCUDA);
    EXPECT_EQ(c->timeout_ms(), 60000);
  }
  ASSERT_TRUE(cfg.calc_stream.has_value());
  ASSERT_TRUE(cfg.load_stream.has_value());
  ASSERT_TRUE(cfg.tp_comm_stream.has_value());
  EXPECT_NE(cfg.load_stream->id(), cfg.calc_stream->id());
  EXPECT_NE(cfg.tp_comm_stream->id(), cfg.load_stream->id());
}

TEST_F(Nccl, RawOpsAreTheIdentityAtWorldOne) {
  raw_identity_checks(*bmt::config().comm, {1, 7, 1000003});
  // The sub-communicators (split from the world) too.
  raw_identity_checks(*bmt::config().tp_comm, {7});
  raw_identity_checks(*bmt::config().pipe_comm, {7});
}

TEST_F(Nccl, SplitCommunicatorWorks) {
  auto child = bmt::config().comm->split(5, 0, "child");
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(child->size(), 1);
  EXPECT_EQ(child->rank(), 0);
  raw_identity_checks(*child, {1, 33});
  child->barrier();
  auto grandchild = child->split(0, 0, "grandchild");
  raw_identity_checks(*grandchild, {3});
}

TEST_F(Nccl, TensorOpsAndGradients) {
  auto& c = *bmt::config().comm;
  for (const DT& d : kDTypes) {
    at::Tensor x = values(15, d.st).reshape({3, 5});
    at::Tensor ag = bd::all_gather(x, c);
    EXPECT_EQ(ag.sizes().vec(), (std::vector<int64_t>{1, 3, 5}));
    expect_same(ag[0], x, label("distributed::all_gather", d, 15));
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg})
      expect_same(bd::reduce_scatter(x, op, c), x, label("distributed::reduce_scatter", d, 15));
    for (ReduceOp op : kOps) expect_same(bd::all_reduce(x, op, c), x, label("distributed::all_reduce", d, 15));
    expect_same(bd::broadcast(x, 0, c), x, label("distributed::broadcast", d, 15));
    expect_same(bd::all_reduce(x.t(), ReduceOp::kSum, c), x.t().contiguous(),
                label("distributed::all_reduce of a transpose", d, 15));
  }
  // Gradients at world 1: every op is the identity map, so dL/dx = W (sum(W * y) losses).
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor w = values(6, st, 3).reshape({2, 3});
    auto grad_of = [&](auto&& op) {
      at::Tensor x = values(6, st).reshape({2, 3}).requires_grad_(true);
      at::Tensor y = op(x).reshape({2, 3});
      (y * w).sum().backward();
      return x.grad();
    };
    expect_same(grad_of([&](const at::Tensor& x) { return bd::all_gather(x, c); }), w, "grad of all_gather");
    expect_same(grad_of([&](const at::Tensor& x) { return bd::reduce_scatter(x, ReduceOp::kSum, c); }), w,
                "grad of reduce_scatter");
    expect_same(grad_of([&](const at::Tensor& x) { return bd::all_reduce(x, ReduceOp::kAvg, c); }), w,
                "grad of all_reduce avg");
    expect_same(grad_of([&](const at::Tensor& x) { return bd::broadcast(x, 0, c); }), w, "grad of broadcast");
  }
  at::Tensor loss = at::full({}, 2.5, cuda(at::kFloat));
  EXPECT_EQ(bmt::sum_loss(loss).item<float>(), 2.5f);
  at::Tensor r = values(6, at::kFloat).reshape({2, 3});
  expect_same(bmt::gather_result(r), r, "gather_result");
  expect_same(bmt::gather_result(r.cpu()).to(r.device()), r, "gather_result of a CPU tensor");
  // A CPU tensor handed to the NCCL communicator: a clear error.
  try {
    bd::all_reduce(at::ones({4}), ReduceOp::kSum, c);
    ADD_FAILURE() << "a CPU tensor was accepted by the NCCL communicator";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
}

// A collective on config().load_stream, ordered after slow work on the current stream by an event, reads the
// finished data; the current stream then waits for the collective the same way.
TEST_F(Nccl, LoadStreamOrderedByEvents) {
  const auto& cfg = bmt::config();
  c10::cuda::CUDAStream calc = c10::cuda::getCurrentCUDAStream();
  c10::cuda::CUDAStream load(*cfg.load_stream);
  ASSERT_NE(calc.stream(), load.stream());
  const int64_t n = 1 << 22;
  for (int round = 0; round < 3; ++round) {
    at::Tensor x = at::zeros({n}, cuda(at::kFloat));
    at::Tensor out = at::full({n}, -1.0f, cuda(at::kFloat));
    c10::cuda::device_synchronize();
    // Slow work on the current stream (tens of ms of matmuls), then the data the collective must see.
    at::Tensor a = at::rand({4096, 4096}, cuda(at::kFloat));
    at::Tensor acc = a;
    for (int k = 0; k < 8; ++k) acc = at::mm(acc, a) / 4096.0;
    x.copy_(at::arange(n, cuda(at::kFloat)) + round);  // runs after the slow chain (same stream)
    c10::cuda::CUDAEvent ready;
    ready.record(calc);
    ready.block(load);
    cfg.comm->all_reduce(x.data_ptr(), out.data_ptr(), n, DType::kFloat32, ReduceOp::kSum, load.stream());
    c10::cuda::CUDAEvent done;
    done.record(load);
    done.block(calc);
    // Allocator hygiene: x and out were used on the load stream.
    c10::cuda::CUDACachingAllocator::recordStream(x.storage().data_ptr(), load);
    c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), load);
    EXPECT_TRUE(at::equal(out, at::arange(n, cuda(at::kFloat)) + round)) << "round " << round;
    // The same through synchronize(): host waits for the load stream, with error polling.
    at::Tensor out2 = at::empty({n}, cuda(at::kFloat));
    ready.record(calc);
    ready.block(load);
    cfg.comm->all_gather(x.data_ptr(), out2.data_ptr(), n, DType::kFloat32, load.stream());
    cfg.comm->synchronize(load.stream());
    EXPECT_TRUE(at::equal(out2, x)) << "round " << round;
  }
  cfg.comm->check_async_error();
  bmt::synchronize();
}

TEST_F(Nccl, BarrierAndAsyncErrorsAreClean) {
  const auto& cfg = bmt::config();
  for (int k = 0; k < 5; ++k) {
    cfg.comm->barrier();
    cfg.tp_comm->barrier();
  }
  EXPECT_NO_THROW(cfg.comm->check_async_error());
  EXPECT_NO_THROW(cfg.comm->synchronize(current()));
  EXPECT_NO_THROW(bmt::synchronize());
  cfg.comm->check_async_error();
}

TEST_F(Nccl, BadArgumentsGiveClearErrors) {
  auto& c = *bmt::config().comm;
  at::Tensor x = at::ones({4}, cuda(at::kFloat));
  auto expect_error = [](auto&& f, const std::vector<std::string>& fragments) {
    try {
      f();
      ADD_FAILURE() << "no exception";
    } catch (const bmt::core::DistError& e) {
      ADD_FAILURE() << "DistError (communicator aborted?) instead of an argument error: " << e.what();
    } catch (const bmt::core::Error& e) {
      for (const auto& frag : fragments)
        EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << frag << " not in " << e.what();
    }
  };
  expect_error([&] { c.broadcast(x.data_ptr(), x.data_ptr(), 4, DType::kFloat32, 1, current()); },
               {"broadcast", "root 1", "out of range"});
  expect_error([&] { c.broadcast(x.data_ptr(), x.data_ptr(), 4, DType::kFloat32, -1, current()); }, {"root -1"});
  expect_error([&] { c.send(x.data_ptr(), 4, DType::kFloat32, 0, current()); }, {"send", "peer 0"});
  expect_error([&] { c.recv(x.data_ptr(), 4, DType::kFloat32, 0, current()); }, {"recv", "peer 0"});
  expect_error([&] { bd::reduce_scatter(x, ReduceOp::kMax, c); }, {"reduce_scatter", "max"});
  // The communicator is untouched by rejected calls.
  at::Tensor y = bd::all_reduce(x, ReduceOp::kSum, c);
  expect_same(y, x, "all_reduce after rejected calls");
  c.check_async_error();
}
