// Every collective of the Communicator interface and of bmt::distributed, on real processes over real Gloo.
//
// Expected values come from closed forms over (element index i, rank s, world size ws); inputs are small integers
// (or 2^40 + small integers for int64), exactly representable in every dtype, so every result is exact:
//   sum input   K + i%7 + s              -> ws*K + ws*(i%7) + ws(ws-1)/2       (<= 45 for ws 4: exact in bf16)
//   avg input   ws*(K + i%7 + s)         -> the same value (the sum is a multiple of ws, so integer avg is exact)
//   max/min     (3i + 5s)%11 - 5         -> max/min over s, computed by the test
//   prod        +-((i + s)%3 + 1)        -> product over s (|prod| <= 81: exact in bf16)
//   gather/bcast/p2p payload  K + i%13 + 16s                                   (<= 60: exact in bf16)
// K = 2^40 for int64 (exercises the full 64-bit path), 0 for floating types.
// Integer AVG of a sum that is not a multiple of ws rounds toward zero (C++ integer division, as NCCL's ncclAvg
// does on integers): input (i%5) - 3 + s, expected trunc(sum / ws), checked separately for int64.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "collective_dtypes.h"
#include "run_ranks.h"

namespace {

using bmt::core::Communicator;
using bmt::core::DType;
using bmt::core::ReduceOp;

using DT = bmt::testing::CollectiveDType;
constexpr const auto& kDTypes = bmt::testing::kCollectiveDTypes;

double big_offset(const DT& d) { return d.st == at::kLong ? 1099511627776.0 : 0.0; }  // 2^40

at::Tensor idx(int64_t n, int64_t start = 0) { return at::arange(start, start + n, at::kDouble); }
at::Tensor rem(const at::Tensor& t, double m) { return at::remainder(t, m); }

// Closed-form inputs (double) of rank s for element indices i.
at::Tensor sum_in(const at::Tensor& i, int s, double K) { return K + rem(i, 7) + s; }
at::Tensor sum_want(const at::Tensor& i, int ws, double K) { return ws * K + ws * rem(i, 7) + ws * (ws - 1) / 2.0; }
at::Tensor avg_in(const at::Tensor& i, int s, int ws, double K) { return ws * sum_in(i, s, K); }
at::Tensor mm_in(const at::Tensor& i, int s) { return rem(3 * i + 5 * s, 11) - 5; }
at::Tensor prod_in(const at::Tensor& i, int s) {
  at::Tensor sign = 1 - 2 * (rem(i + 2 * s, 4) == 0).to(at::kDouble);
  return (rem(i + s, 3) + 1) * sign;
}
at::Tensor tag_in(const at::Tensor& i, int s, double K) { return K + rem(i, 13) + 16 * s; }

at::Tensor mm_want(const at::Tensor& i, int ws, bool is_max) {
  std::vector<at::Tensor> all;
  for (int s = 0; s < ws; ++s) all.push_back(mm_in(i, s));
  at::Tensor st = at::stack(all);
  return is_max ? std::get<0>(st.max(0)) : std::get<0>(st.min(0));
}
at::Tensor prod_want(const at::Tensor& i, int ws) {
  at::Tensor p = at::ones_like(i);
  for (int s = 0; s < ws; ++s) p = p * prod_in(i, s);
  return p;
}

void expect_values(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (got.numel() != want.numel()) {
    ADD_FAILURE() << what << ": got " << got.numel() << " elements, want " << want.numel();
    return;
  }
  at::Tensor g = got.to(at::kDouble).reshape({-1});
  at::Tensor w = want.to(at::kDouble).reshape({-1});
  if (g.numel() == 0 || at::equal(g, w)) return;
  at::Tensor bad = (g != w).nonzero();
  int64_t k = bad.size(0) ? bad[0][0].item<int64_t>() : 0;
  ADD_FAILURE() << what << ": " << bad.size(0) << " of " << g.numel() << " elements differ; first at " << k
                << ": got " << g[k].item<double>() << ", want " << w[k].item<double>();
}

std::string label(const Communicator& c, const char* op, const DT& d, int64_t n) {
  return bmt::core::concat(op, " ", d.name, " n=", n, " on '", c.name(), "' (rank ", c.rank(), " of ", c.size(),
                           ")");
}

// ---------------------------------------------------------------------------------------------------------
// Raw Communicator API: pointers + numel + DType.

void raw_all_reduce_checks(Communicator& c, const DT& d, int64_t n) {
  const int ws = c.size(), r = c.rank();
  const double K = big_offset(d);
  at::Tensor i = idx(n);
  {  // sum, out of place
    at::Tensor x = sum_in(i, r, K).to(d.st), out = at::full({n}, -1, d.st);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kSum, nullptr);
    expect_values(out, sum_want(i, ws, K), label(c, "all_reduce sum", d, n));
    expect_values(x, sum_in(i, r, K), label(c, "all_reduce sum leaves its input alone", d, n));
  }
  {  // sum, in place
    at::Tensor x = sum_in(i, r, K).to(d.st);
    c.all_reduce(x.data_ptr(), x.data_ptr(), n, d.dt, ReduceOp::kSum, nullptr);
    expect_values(x, sum_want(i, ws, K), label(c, "all_reduce sum in place", d, n));
  }
  {  // avg
    at::Tensor x = avg_in(i, r, ws, K).to(d.st), out = at::empty({n}, d.st);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kAvg, nullptr);
    expect_values(out, sum_want(i, ws, K), label(c, "all_reduce avg", d, n));
  }
  if (d.st == at::kLong) {  // integer avg of sums that are not multiples of ws, negative ones too: truncation
    at::Tensor x = (rem(i, 5) - 3 + r).to(d.st), out = at::empty({n}, d.st);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kAvg, nullptr);
    at::Tensor sum = ws * (rem(i, 5) - 3) + ws * (ws - 1) / 2.0;
    expect_values(out, at::trunc(sum / ws), label(c, "all_reduce avg (truncating)", d, n));
  }
  for (bool is_max : {true, false}) {
    at::Tensor x = mm_in(i, r).to(d.st), out = at::empty({n}, d.st);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, is_max ? ReduceOp::kMax : ReduceOp::kMin, nullptr);
    expect_values(out, mm_want(i, ws, is_max), label(c, is_max ? "all_reduce max" : "all_reduce min", d, n));
  }
  {  // prod
    at::Tensor x = prod_in(i, r).to(d.st), out = at::empty({n}, d.st);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kProd, nullptr);
    expect_values(out, prod_want(i, ws), label(c, "all_reduce prod", d, n));
  }
}

void raw_all_gather_checks(Communicator& c, const DT& d, int64_t n) {
  const int ws = c.size(), r = c.rank();
  const double K = big_offset(d);
  at::Tensor i = idx(n);
  std::vector<at::Tensor> parts;
  for (int s = 0; s < ws; ++s) parts.push_back(tag_in(i, s, K));
  at::Tensor want = at::cat(parts);
  {
    at::Tensor x = tag_in(i, r, K).to(d.st), out = at::full({ws * n}, -1, d.st);
    c.all_gather(x.data_ptr(), out.data_ptr(), n, d.dt, nullptr);
    expect_values(out, want, label(c, "all_gather", d, n));
  }
  {  // send aliases my own slot of recv
    at::Tensor buf = at::full({ws * n}, -1, d.st);
    buf.narrow(0, r * n, n).copy_(tag_in(i, r, K).to(d.st));
    auto* slot = static_cast<uint8_t*>(buf.data_ptr()) + r * n * buf.element_size();
    c.all_gather(slot, buf.data_ptr(), n, d.dt, nullptr);
    expect_values(buf, want, label(c, "all_gather in place", d, n));
  }
}

void raw_reduce_scatter_checks(Communicator& c, const DT& d, int64_t n) {
  const int ws = c.size(), r = c.rank();
  const double K = big_offset(d);
  at::Tensor j = idx(ws * n);     // index into the full send buffer
  at::Tensor mine = idx(n, r * n);  // the indices of my chunk
  {
    at::Tensor x = sum_in(j, r, K).to(d.st), out = at::full({n}, -1, d.st);
    c.reduce_scatter(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kSum, nullptr);
    expect_values(out, sum_want(mine, ws, K), label(c, "reduce_scatter sum", d, n));
  }
  {
    at::Tensor x = avg_in(j, r, ws, K).to(d.st), out = at::full({n}, -1, d.st);
    c.reduce_scatter(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kAvg, nullptr);
    expect_values(out, sum_want(mine, ws, K), label(c, "reduce_scatter avg", d, n));
  }
  {
    at::Tensor x = mm_in(j, r).to(d.st), out = at::full({n}, -1, d.st);
    c.reduce_scatter(x.data_ptr(), out.data_ptr(), n, d.dt, ReduceOp::kMax, nullptr);
    expect_values(out, mm_want(mine, ws, true), label(c, "reduce_scatter max", d, n));
  }
}

void raw_broadcast_checks(Communicator& c, const DT& d, int64_t n) {
  const int ws = c.size(), r = c.rank();
  const double K = big_offset(d);
  at::Tensor i = idx(n);
  for (int root = 0; root < ws; ++root) {
    at::Tensor x = tag_in(i, r, K).to(d.st), out = at::full({n}, -1, d.st);
    c.broadcast(x.data_ptr(), out.data_ptr(), n, d.dt, root, nullptr);
    expect_values(out, tag_in(i, root, K), label(c, "broadcast", d, n) + " root " + std::to_string(root));
    at::Tensor inplace = tag_in(i, r, K).to(d.st);
    c.broadcast(inplace.data_ptr(), inplace.data_ptr(), n, d.dt, root, nullptr);
    expect_values(inplace, tag_in(i, root, K),
                  label(c, "broadcast in place", d, n) + " root " + std::to_string(root));
  }
}

// Ring: rank r sends to r+1 and receives from r-1. Even ranks send first, odd ranks receive first, so the ring
// completes even if a send blocks until it is received.
void raw_ring_checks(Communicator& c, const DT& d, int64_t n) {
  const int ws = c.size(), r = c.rank();
  if (ws < 2) return;
  const double K = big_offset(d);
  at::Tensor i = idx(n);
  const int to = (r + 1) % ws, from = (r + ws - 1) % ws;
  at::Tensor x = tag_in(i, r, K).to(d.st), y = at::full({n}, -1, d.st);
  if (r % 2 == 0) {
    c.send(x.data_ptr(), n, d.dt, to, nullptr);
    c.recv(y.data_ptr(), n, d.dt, from, nullptr);
  } else {
    c.recv(y.data_ptr(), n, d.dt, from, nullptr);
    c.send(x.data_ptr(), n, d.dt, to, nullptr);
  }
  expect_values(y, tag_in(i, from, K), label(c, "send/recv ring", d, n) + " from " + std::to_string(from));
  expect_values(x, tag_in(i, r, K), label(c, "send leaves its buffer alone", d, n));
}

void raw_checks(Communicator& c, const std::vector<int64_t>& counts, bool big) {
  for (const DT& d : kDTypes) {
    for (int64_t n : counts) {
      raw_all_reduce_checks(c, d, n);
      raw_all_gather_checks(c, d, n);
      raw_reduce_scatter_checks(c, d, n);
      raw_broadcast_checks(c, d, n);
      raw_ring_checks(c, d, n);
    }
  }
  if (!big) return;
  // Large odd count, fp32: sums stay below 2^24, so exact.
  const DT& f32 = kDTypes[0];
  const int64_t n = 1000003;
  const int ws = c.size(), r = c.rank();
  at::Tensor i = idx(n);
  {
    at::Tensor x = sum_in(i, r, 0).to(at::kFloat), out = at::empty({n}, at::kFloat);
    c.all_reduce(x.data_ptr(), out.data_ptr(), n, f32.dt, ReduceOp::kSum, nullptr);
    expect_values(out, sum_want(i, ws, 0), label(c, "all_reduce sum", f32, n));
  }
  {
    at::Tensor x = tag_in(i, r, 0).to(at::kFloat), out = at::empty({ws * n}, at::kFloat);
    c.all_gather(x.data_ptr(), out.data_ptr(), n, f32.dt, nullptr);
    std::vector<at::Tensor> parts;
    for (int s = 0; s < ws; ++s) parts.push_back(tag_in(i, s, 0));
    expect_values(out, at::cat(parts), label(c, "all_gather", f32, n));
  }
  {
    at::Tensor x = sum_in(idx(ws * n), r, 0).to(at::kFloat), out = at::empty({n}, at::kFloat);
    c.reduce_scatter(x.data_ptr(), out.data_ptr(), n, f32.dt, ReduceOp::kSum, nullptr);
    expect_values(out, sum_want(idx(n, r * n), ws, 0), label(c, "reduce_scatter sum", f32, n));
  }
  {
    const int root = ws - 1;
    at::Tensor x = tag_in(i, r, 0).to(at::kFloat), out = at::empty({n}, at::kFloat);
    c.broadcast(x.data_ptr(), out.data_ptr(), n, f32.dt, root, nullptr);
    expect_values(out, tag_in(i, root, 0), label(c, "broadcast", f32, n));
  }
  raw_ring_checks(c, f32, n);
}

// ---------------------------------------------------------------------------------------------------------
// at::Tensor-level bmt::distributed ops (forward values and shapes; gradients: test_distributed_ops.cpp).

void expect_shape(const at::Tensor& t, std::vector<int64_t> shape, at::ScalarType st, const std::string& what) {
  EXPECT_EQ(t.sizes().vec(), shape) << what;
  EXPECT_EQ(t.scalar_type(), st) << what;
}

void tensor_checks(Communicator& c) {
  namespace bd = bmt::distributed;
  const int ws = c.size(), r = c.rank();
  for (const DT& d : kDTypes) {
    const double K = big_offset(d);
    {  // all_gather: (2, 3) -> (ws, 2, 3)
      at::Tensor i = idx(6);
      at::Tensor y = bd::all_gather(tag_in(i, r, K).reshape({2, 3}).to(d.st), c);
      expect_shape(y, {ws, 2, 3}, d.st, label(c, "distributed::all_gather", d, 6));
      std::vector<at::Tensor> parts;
      for (int s = 0; s < ws; ++s) parts.push_back(tag_in(i, s, K));
      expect_values(y, at::cat(parts), label(c, "distributed::all_gather", d, 6));
    }
    {  // reduce_scatter: (ws * 3, 5) -> (3, 5)
      at::Tensor j = idx(ws * 15), mine = idx(15, r * 15);
      at::Tensor y = bd::reduce_scatter(sum_in(j, r, K).reshape({ws * 3, 5}).to(d.st), ReduceOp::kSum, c);
      expect_shape(y, {3, 5}, d.st, label(c, "distributed::reduce_scatter sum", d, ws * 15));
      expect_values(y, sum_want(mine, ws, K), label(c, "distributed::reduce_scatter sum", d, ws * 15));
      at::Tensor a = bd::reduce_scatter(avg_in(j, r, ws, K).reshape({ws * 3, 5}).to(d.st), ReduceOp::kAvg, c);
      expect_values(a, sum_want(mine, ws, K), label(c, "distributed::reduce_scatter avg", d, ws * 15));
    }
    {  // all_reduce every op: (3, 1, 5)
      at::Tensor i = idx(15);
      auto shaped = [&](const at::Tensor& v) { return v.reshape({3, 1, 5}).to(d.st); };
      at::Tensor s = bd::all_reduce(shaped(sum_in(i, r, K)), ReduceOp::kSum, c);
      expect_shape(s, {3, 1, 5}, d.st, label(c, "distributed::all_reduce sum", d, 15));
      expect_values(s, sum_want(i, ws, K), label(c, "distributed::all_reduce sum", d, 15));
      expect_values(bd::all_reduce(shaped(avg_in(i, r, ws, K)), ReduceOp::kAvg, c), sum_want(i, ws, K),
                    label(c, "distributed::all_reduce avg", d, 15));
      expect_values(bd::all_reduce(shaped(mm_in(i, r)), ReduceOp::kMax, c), mm_want(i, ws, true),
                    label(c, "distributed::all_reduce max", d, 15));
      expect_values(bd::all_reduce(shaped(mm_in(i, r)), ReduceOp::kMin, c), mm_want(i, ws, false),
                    label(c, "distributed::all_reduce min", d, 15));
      expect_values(bd::all_reduce(shaped(prod_in(i, r)), ReduceOp::kProd, c), prod_want(i, ws),
                    label(c, "distributed::all_reduce prod", d, 15));
    }
    {  // non-contiguous input: the transpose of a (3, 5) tensor
      at::Tensor i = idx(15);
      at::Tensor x = sum_in(i, r, K).reshape({3, 5}).to(d.st).t();
      EXPECT_FALSE(x.is_contiguous());
      at::Tensor s = bd::all_reduce(x, ReduceOp::kSum, c);
      expect_shape(s, {5, 3}, d.st, label(c, "distributed::all_reduce of a transpose", d, 15));
      expect_values(s, sum_want(i, ws, K).reshape({3, 5}).t().contiguous(),
                    label(c, "distributed::all_reduce of a transpose", d, 15));
    }
    for (int root = 0; root < ws; ++root) {  // broadcast: (7,), odd count
      at::Tensor i = idx(7);
      at::Tensor y = bd::broadcast(tag_in(i, r, K).to(d.st), root, c);
      expect_shape(y, {7}, d.st, label(c, "distributed::broadcast", d, 7));
      expect_values(y, tag_in(i, root, K), label(c, "distributed::broadcast", d, 7) + " root " + std::to_string(root));
    }
  }
}

// Rank 0 arrives late; everybody else must wait for it. Compared as instants of steady_clock (CLOCK_MONOTONIC: one
// clock for every process of the host), not as each rank's own elapsed time: a rank that a loaded machine delays
// after the previous barrier would start its clock late and measure less than rank 0 slept.
void barrier_checks(Communicator& c) {
  for (int k = 0; k < 3; ++k) c.barrier();
  if (c.size() < 2) return;
  auto now_ns = [] {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now().time_since_epoch())
                                    .count());
  };
  int64_t arrived_ns = 0;
  if (c.rank() == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    arrived_ns = now_ns();
  }
  c.barrier();
  const int64_t left_ns = now_ns();
  int64_t rank0_arrived_ns = 0;
  c.broadcast(&arrived_ns, &rank0_arrived_ns, 1, DType::kInt64, 0, nullptr);
  if (c.rank() != 0) {
    EXPECT_GE(left_ns, rank0_arrived_ns) << "barrier on '" << c.name() << "' returned "
                                         << (rank0_arrived_ns - left_ns) / 1e6 << " ms before rank 0 arrived";
  }
}

// The world ranks of a communicator's members, in the communicator's rank order.
std::vector<int64_t> members(Communicator& c) {
  int64_t me = bmt::rank();
  std::vector<int64_t> all(c.size());
  c.all_gather(&me, all.data(), 1, DType::kInt64, nullptr);
  return all;
}

}  // namespace

TEST(Collectives, RawAndTensorOpsAllDtypesWorlds1To4) {
  for (int world : {1, 2, 3, 4}) {
    bmt::testing::run_ranks(world, [world] {
      auto& comm = *bmt::config().comm;
      ASSERT_EQ(comm.size(), world);
      ASSERT_EQ(comm.rank(), bmt::rank());
      EXPECT_STREQ(comm.backend_name(), "gloo");
      EXPECT_EQ(comm.device_kind(), bmt::core::DeviceKind::kCPU);
      // 0 (empty), 1, odd 7 (not divisible by 2 or 4), 1000 (not divisible by 3).
      raw_checks(comm, {0, 1, 7, 1000}, /*big=*/true);
      tensor_checks(comm);
      barrier_checks(comm);
    });
  }
}

TEST(Collectives, SubCommunicatorsTp2World4AndSplit) {
  bmt::InitOptions opts = bmt::testing::test_init();
  opts.tp_size = 2;
  bmt::testing::run_ranks(4, [] {
    const auto& cfg = bmt::config();
    const int r = cfg.rank;
    // Topology of init.h: tp groups (0,1),(2,3); tp_zero (data-parallel) groups (0,2),(1,3).
    EXPECT_EQ(cfg.tp_rank, r % 2);
    EXPECT_EQ(cfg.tp_size, 2);
    EXPECT_EQ(cfg.tp_zero_rank, r / 2);
    EXPECT_EQ(cfg.tp_zero_size, 2);
    EXPECT_EQ(cfg.zero_size, 4);
    EXPECT_EQ(cfg.zero_rank, r);
    EXPECT_EQ(cfg.pipe_size, 1);
    EXPECT_EQ(members(*cfg.comm), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(members(*cfg.zero_comm), (std::vector<int64_t>{0, 1, 2, 3}));
    EXPECT_EQ(members(*cfg.tp_comm), (std::vector<int64_t>{r / 2 * 2, r / 2 * 2 + 1}));
    EXPECT_EQ(members(*cfg.tp_zero_comm), (std::vector<int64_t>{r % 2, r % 2 + 2}));
    EXPECT_EQ(members(*cfg.pipe_comm), (std::vector<int64_t>{r}));

    // Every op and dtype on the groups, interleaved with world traffic.
    raw_checks(*cfg.tp_comm, {1, 7}, false);
    raw_checks(*cfg.tp_zero_comm, {1, 7}, false);
    raw_checks(*cfg.comm, {7}, false);
    tensor_checks(*cfg.tp_comm);
    tensor_checks(*cfg.tp_zero_comm);
    raw_checks(*cfg.pipe_comm, {7}, false);
    {  // group sums of (world rank + 1): tp (0,1)->3, (2,3)->7; tp_zero (0,2)->4, (1,3)->6
      float v = r + 1.0f, tp = 0, dp = 0;
      cfg.tp_comm->all_reduce(&v, &tp, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
      cfg.tp_zero_comm->all_reduce(&v, &dp, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
      EXPECT_EQ(tp, r < 2 ? 3.0f : 7.0f);
      EXPECT_EQ(dp, r % 2 == 0 ? 4.0f : 6.0f);
    }

    // split with custom colors: odd/even, ordered by descending world rank (key = -r).
    auto parity = cfg.comm->split(r % 2, -r, "parity");
    EXPECT_EQ(parity->size(), 2);
    EXPECT_EQ(parity->rank(), r < 2 ? 1 : 0);
    EXPECT_NE(parity->name().find("parity"), std::string::npos) << parity->name();
    EXPECT_EQ(members(*parity), (std::vector<int64_t>{r % 2 + 2, r % 2}));
    raw_checks(*parity, {7}, false);

    // Uneven split: {0} and {1,2,3}; then split the 3-group again: {1,3} (its ranks 0,2) and {2}.
    auto uneven = cfg.comm->split(r == 0 ? 7 : 3, r, "uneven");
    EXPECT_EQ(uneven->size(), r == 0 ? 1 : 3);
    EXPECT_EQ(uneven->rank(), r == 0 ? 0 : r - 1);
    EXPECT_EQ(members(*uneven), (r == 0 ? std::vector<int64_t>{0} : std::vector<int64_t>{1, 2, 3}));
    raw_checks(*uneven, {1, 7}, false);
    tensor_checks(*uneven);
    auto nested = uneven->split(uneven->rank() % 2, uneven->rank(), "nested");
    std::vector<int64_t> want_nested = r == 0 ? std::vector<int64_t>{0}
                                              : (r == 2 ? std::vector<int64_t>{2} : std::vector<int64_t>{1, 3});
    EXPECT_EQ(members(*nested), want_nested);
    raw_checks(*nested, {7}, false);

    // One color (same as the world) and all colors distinct (singletons).
    auto same = cfg.comm->split(0, r, "same");
    EXPECT_EQ(members(*same), (std::vector<int64_t>{0, 1, 2, 3}));
    auto alone = cfg.comm->split(r, 0, "alone");
    EXPECT_EQ(alone->size(), 1);
    EXPECT_EQ(alone->rank(), 0);
    raw_checks(*alone, {7}, false);
    // Communicators created later are still usable, and the old ones still are too.
    barrier_checks(*same);
    barrier_checks(*cfg.tp_comm);
    barrier_checks(*cfg.comm);
  }, opts);
}

namespace {

// Runs f, expecting a bmt::core::Error (not DistError: bad arguments are detected before any communication)
// whose message holds every fragment.
template <typename F>
void expect_error(F&& f, std::vector<std::string> fragments, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const bmt::core::DistError& e) {
    ADD_FAILURE() << what << ": DistError instead of a plain argument Error: " << e.what();
  } catch (const bmt::core::Error& e) {
    std::string msg = e.what();
    for (const auto& frag : fragments)
      EXPECT_NE(msg.find(frag), std::string::npos) << what << ": '" << frag << "' not in: " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not a bmt::core::Error: " << e.what();
  }
}

}  // namespace

TEST(Collectives, BadInputGivesClearErrors) {
  for (int world : {1, 2}) {
    bmt::testing::run_ranks(world, [world] {
      namespace bd = bmt::distributed;
      auto& c = *bmt::config().comm;
      const int r = c.rank();
      float buf[4] = {1, 2, 3, 4};
      for (int root : {-1, world, world + 3}) {
        std::string rs = "root " + std::to_string(root);
        expect_error([&] { c.broadcast(buf, buf, 4, DType::kFloat32, root, nullptr); },
                     {"broadcast", "'world'", rs, "out of range"}, "raw broadcast " + rs);
        expect_error([&] { bd::broadcast(at::ones({4}), root, c); }, {"broadcast", rs, "out of range"},
                     "distributed::broadcast " + rs);
      }
      std::string self = "peer " + std::to_string(r);
      expect_error([&] { c.send(buf, 4, DType::kFloat32, r, nullptr); }, {"send", "'world'", self}, "send to self");
      expect_error([&] { c.recv(buf, 4, DType::kFloat32, r, nullptr); }, {"recv", "'world'", self},
                   "recv from self");
      expect_error([&] { c.send(buf, 4, DType::kFloat32, world, nullptr); },
                   {"send", "peer " + std::to_string(world)}, "send out of range");
      expect_error([&] { c.recv(buf, 4, DType::kFloat32, -1, nullptr); }, {"recv", "peer -1"}, "recv from -1");
      expect_error([&] { bd::send_activations(at::ones({3}), r, c); }, {"send", self},
                   "send_activations to self");
      if (world == 2) {
        expect_error([&] { bd::reduce_scatter(at::ones({3, 2}), ReduceOp::kSum, c); },
                     {"reduce_scatter", "divisible", "2"}, "reduce_scatter of 3 rows over 2 ranks");
      }
      expect_error([&] { bd::reduce_scatter(at::ones({4}), ReduceOp::kMax, c); }, {"reduce_scatter", "max"},
                   "distributed::reduce_scatter max");
      expect_error([&] { bd::all_reduce(at::ones({4}, at::kBool), ReduceOp::kSum, c); }, {"Bool"},
                   "all_reduce of bool");
      uint8_t bytes[4] = {1, 2, 3, 4};
      expect_error([&] { c.all_reduce(bytes, bytes, 4, DType::kUInt8, ReduceOp::kSum, nullptr); },
                   {"all_reduce", "uint8"}, "uint8 all_reduce");
      // Nothing was communicated by the failed calls: the communicator is still in step.
      float one = 1, sum = 0;
      c.all_reduce(&one, &sum, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
      EXPECT_EQ(sum, static_cast<float>(world));
      c.barrier();
    });
  }
}
