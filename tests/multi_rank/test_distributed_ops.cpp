// Gradients of the differentiable bmt::distributed ops, send/recv_activations, sum_loss and gather_result, on
// real processes over real Gloo.
//
// Convention (distributed.h): the objective is the SUM over ranks r of each rank's local loss L_r. Every rank
// builds L_r = sum(W_r * y) with rank-dependent weights
//     W_r[k] = w(r, k) = (r + 1) + 2 * (k % 5)          (k: flat index into y)
// so that the sum over ranks has the closed form  Wsum(k) = ws(ws+1)/2 + 2 ws (k % 5). The expected gradients
// below are derived by hand from the op's definition (never from the op):
//   all_gather      y = [x_0; ...; x_{ws-1}]       dObj/dx_s[m]   = Wsum(s*numel(x) + m)
//   reduce_scatter  y_r = sum_s x_s[chunk r]       dObj/dx_s[p]   = w(p / numel(y), p % numel(y))   (any s)
//   all_reduce sum  y = sum_s x_s                  dObj/dx_s[k]   = Wsum(k)
//              max  y = max_s x_s                  dObj/dx_s[k]   = Wsum(k) / #holders if s holds the max, else 0
//                                                  (ties share evenly, like torch's amax)
//              prod y = prod_s x_s                 dObj/dx_s[k]   = Wsum(k) * prod_{t != s} x_t[k]  (zeros too)
//   broadcast       y = x_root                     dObj/dx_s      = Wsum if s == root else 0
// For avg ops the weights are multiplied by ws, which cancels the 1/ws and keeps everything an exact integer.
#include <gtest/gtest.h>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "run_ranks.h"

namespace {

using bmt::core::Communicator;
using bmt::core::ReduceOp;
namespace bd = bmt::distributed;

at::Tensor idx(int64_t n) { return at::arange(n, at::kDouble); }
at::Tensor w_of(int r, int64_t n) { return (r + 1) + 2 * at::remainder(idx(n), 5); }
at::Tensor wsum_of(int ws, int64_t n) { return ws * (ws + 1) / 2.0 + 2 * ws * at::remainder(idx(n), 5); }

void expect_values(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (!got.defined()) {
    ADD_FAILURE() << what << ": undefined (no gradient)";
    return;
  }
  if (got.numel() != want.numel()) {
    ADD_FAILURE() << what << ": got " << got.numel() << " elements, want " << want.numel();
    return;
  }
  at::Tensor g = got.detach().to(at::kDouble).reshape({-1});
  at::Tensor w = want.to(at::kDouble).reshape({-1});
  if (g.numel() == 0 || at::equal(g, w)) return;
  at::Tensor bad = (g != w).nonzero();
  int64_t k = bad[0][0].item<int64_t>();
  ADD_FAILURE() << what << ": " << bad.size(0) << " of " << g.numel() << " elements differ; first at " << k
                << ": got " << g[k].item<double>() << ", want " << w[k].item<double>();
}

std::string where(const Communicator& c, const std::string& what, at::ScalarType st) {
  return bmt::core::concat(what, " [", c10::toString(st), "] on '", c.name(), "' rank ", c.rank(), " of ", c.size());
}

at::Tensor leaf(const at::Tensor& values, at::ScalarType st) { return values.to(st).requires_grad_(true); }

// local loss: sum(W * y) with W given in double, in y's dtype
at::Tensor local_loss(const at::Tensor& y, const at::Tensor& w) {
  return (y * w.reshape(y.sizes()).to(y.scalar_type())).sum();
}

void gradient_checks(Communicator& c) {
  const int ws = c.size(), r = c.rank();
  for (at::ScalarType st : {at::kFloat, at::kDouble, at::kBFloat16}) {
    {  // all_gather: x (2, 3) -> y (ws, 2, 3)
      at::Tensor x = leaf(idx(6).reshape({2, 3}) + 10 * r, st);
      at::Tensor y = bd::all_gather(x, c);
      EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{ws, 2, 3}));
      local_loss(y, w_of(r, ws * 6)).backward();
      expect_values(x.grad(), wsum_of(ws, ws * 6).narrow(0, r * 6, 6), where(c, "grad of all_gather", st));
      EXPECT_EQ(x.grad().sizes(), x.sizes());
    }
    {  // all_gather with a non-contiguous incoming gradient: L_r = sum(V_r * y.transpose(1, 2)), V_r (ws, 3, 2)
      at::Tensor x = leaf(idx(6).reshape({2, 3}), st);
      at::Tensor y = bd::all_gather(x, c);
      at::Tensor v = w_of(r, ws * 6).reshape({ws, 3, 2});
      local_loss(y.transpose(1, 2), v).backward();
      // dObj/dx_r[a][b] = sum_t V_t[r][b][a]; sum_t V_t = Wsum reshaped the same way.
      at::Tensor want = wsum_of(ws, ws * 6).reshape({ws, 3, 2})[r].t();
      expect_values(x.grad(), want.contiguous(), where(c, "grad of all_gather (transposed use)", st));
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {  // reduce_scatter: x (ws*2, 3) -> y (2, 3)
      const double scale = op == ReduceOp::kAvg ? ws : 1;
      at::Tensor x = leaf(idx(ws * 6).reshape({ws * 2, 3}) * (r + 1), st);
      at::Tensor y = bd::reduce_scatter(x, op, c);
      EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{2, 3}));
      local_loss(y, scale * w_of(r, 6)).backward();
      std::vector<at::Tensor> chunks;  // grad x_s[p] = w(p / 6, p % 6)
      for (int t = 0; t < ws; ++t) chunks.push_back(w_of(t, 6));
      expect_values(x.grad(), at::cat(chunks),
                    where(c, std::string("grad of reduce_scatter ") + bmt::core::reduce_op_name(op), st));
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {  // all_reduce sum / avg: x (7,)
      const double scale = op == ReduceOp::kAvg ? ws : 1;
      at::Tensor x = leaf(idx(7) - r, st);
      at::Tensor y = bd::all_reduce(x, op, c);
      local_loss(y, scale * w_of(r, 7)).backward();
      expect_values(x.grad(), wsum_of(ws, 7),
                    where(c, std::string("grad of all_reduce ") + bmt::core::reduce_op_name(op), st));
    }
    for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
      // Elements 0..6: x_s[k] = (k + s) % ws, distinct over s, so exactly one rank holds the extreme.
      // Elements 7..11: x_s[k] = 5 on even s, 1 on odd s: ties, which share the gradient evenly (torch's
      // amax/amin convention), so dObj/dx_s[k] = Wsum(k) * [s holds the extreme] / (number of holders).
      auto xs = [ws](int s) {
        at::Tensor k = idx(12);
        return at::where(k < 7, at::remainder(k + s, ws), at::full({12}, s % 2 == 0 ? 5.0 : 1.0, at::kDouble));
      };
      at::Tensor x = leaf(xs(r), st);
      at::Tensor y = bd::all_reduce(x, op, c);
      local_loss(y, w_of(r, 12)).backward();
      std::vector<at::Tensor> all;
      for (int t = 0; t < ws; ++t) all.push_back(xs(t));
      at::Tensor stacked = at::stack(all);
      at::Tensor extreme = op == ReduceOp::kMax ? std::get<0>(stacked.max(0)) : std::get<0>(stacked.min(0));
      at::Tensor holders = (stacked == extreme).to(at::kDouble).sum(0);
      at::Tensor want = wsum_of(ws, 12) * (xs(r) == extreme).to(at::kDouble) / holders;
      expect_values(x.grad(), want, where(c, std::string("grad of all_reduce ") + bmt::core::reduce_op_name(op), st));
    }
    if (st != at::kBFloat16) {
      // all_reduce prod. Elements 0..6: x_s[k] = (k + s) % 3 + 1, never 0. Elements 7..13 have zeros: one rank
      // per element where (k + s) % 5 == 0, and for k == 13 also ranks 0 and 1 (two zeros).
      // dObj/dx_s[k] = Wsum(k) * prod_{t != s} x_t[k], which stays finite (and non-zero) where x_s[k] == 0.
      // Not in bf16: the backward's own products (up to 42 * 81) are rounded there, so no exact closed form.
      auto xs = [](int s) {
        at::Tensor k = idx(14);
        at::Tensor zero = ((k >= 7) & (at::remainder(k + s, 5) == 0)) | ((k == 13) & (s <= 1));
        return at::where(zero, at::zeros({14}, at::kDouble), at::remainder(k + s, 3) + 1);
      };
      at::Tensor x = leaf(xs(r), st);
      at::Tensor y = bd::all_reduce(x, ReduceOp::kProd, c);
      local_loss(y, w_of(r, 14)).backward();
      at::Tensor others = at::ones({14}, at::kDouble);
      for (int t = 0; t < ws; ++t)
        if (t != r) others = others * xs(t);
      expect_values(x.grad(), wsum_of(ws, 14) * others, where(c, "grad of all_reduce prod", st));
    }
    for (int root = 0; root < ws; ++root) {  // broadcast: x (7,)
      at::Tensor x = leaf(idx(7) + r, st);
      at::Tensor y = bd::broadcast(x, root, c);
      local_loss(y, w_of(r, 7)).backward();
      at::Tensor want = r == root ? wsum_of(ws, 7) : at::zeros({7}, at::kDouble);
      expect_values(x.grad(), want, where(c, "grad of broadcast root " + std::to_string(root), st));
    }
  }
  {  // a chain through two collectives: y = all_reduce(all_gather(x), sum); dObj/dx_s[m] = ws * Wsum(s*3+m)
    at::Tensor x = leaf(idx(3) + r, at::kFloat);
    at::Tensor y = bd::all_reduce(bd::all_gather(x, c), ReduceOp::kSum, c);
    local_loss(y, w_of(r, ws * 3)).backward();
    expect_values(x.grad(), ws * wsum_of(ws, ws * 3).narrow(0, r * 3, 3), where(c, "grad of a chain", at::kFloat));
  }
}

// ---------------------------------------------------------------------------------------------------------
// send/recv_activations: a ring of messages of many dtypes and shapes (rank r -> r+1).

struct Message {
  at::ScalarType st;
  std::vector<int64_t> shape;
  bool transpose;  // send a non-contiguous view (the transpose of shape[::-1])
};

std::vector<Message> messages() {
  std::vector<int64_t> many_dims(16, 1);
  many_dims[3] = 2;
  many_dims[15] = 3;
  return {{at::kFloat, {2, 3, 4}, false}, {at::kHalf, {7}, false},       {at::kBFloat16, {1, 1, 5}, false},
          {at::kLong, {}, false},         {at::kDouble, {3, 2}, true},   {at::kInt, {4}, false},
          {at::kByte, {5}, false},        {at::kFloat, {0, 3}, false},   {at::kFloat, {1000003}, false},
          {at::kFloat, many_dims, false}, {at::kBFloat16, {2, 9}, true}};
}

// The payload rank s sends as message m: small integers (exact everywhere), int64 beyond 2^32.
at::Tensor payload(const Message& m, int s, size_t which) {
  int64_t n = 1;
  for (auto d : m.shape) n *= d;
  at::Tensor v = at::remainder(idx(n) + 3.0 * static_cast<double>(which), 50) + s;
  if (m.st == at::kLong) v = v + 8589934592.0;  // 2^33
  return v.reshape(m.shape);
}

void activation_checks(Communicator& c) {
  const int ws = c.size(), r = c.rank();
  if (ws < 2) return;
  const int to = (r + 1) % ws, from = (r + ws - 1) % ws;
  auto msgs = messages();
  auto send_all = [&] {
    for (size_t k = 0; k < msgs.size(); ++k) {
      at::Tensor x = payload(msgs[k], r, k).to(msgs[k].st);
      if (msgs[k].transpose) {
        std::vector<int64_t> rev(msgs[k].shape.rbegin(), msgs[k].shape.rend());
        x = x.t().contiguous().reshape(rev).t();  // same values, strided
        EXPECT_FALSE(x.is_contiguous());
      }
      bd::send_activations(x, to, c);
    }
  };
  auto recv_all = [&] {
    for (size_t k = 0; k < msgs.size(); ++k) {
      at::Tensor y = bd::recv_activations(from, c, at::Device(at::kCPU));
      std::string what = where(c, "recv_activations message " + std::to_string(k), msgs[k].st);
      EXPECT_EQ(y.scalar_type(), msgs[k].st) << what;
      EXPECT_EQ(y.sizes().vec(), msgs[k].shape) << what;
      EXPECT_TRUE(y.is_contiguous()) << what;
      if (y.sizes().vec() == msgs[k].shape) expect_values(y, payload(msgs[k], from, k), what);
    }
  };
  if (r % 2 == 0) {
    send_all();
    recv_all();
  } else {
    recv_all();
    send_all();
  }
  // More than 16 dims is refused before anything is sent.
  std::vector<int64_t> too_many(17, 1);
  try {
    bd::send_activations(at::zeros(too_many), to, c);
    ADD_FAILURE() << "send_activations accepted 17 dims";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
  }
  c.barrier();
}

void loss_and_result_checks() {
  const int ws = bmt::world_size(), r = bmt::rank();
  {  // sum_loss = mean over ranks; L_r = (r + 1) * sum_loss(l_r): dObj/dl_s = sum_r (r + 1) / ws = (ws + 1) / 2
    at::Tensor l = at::full({}, 2.0 * (r + 1), at::kFloat).requires_grad_(true);
    at::Tensor m = bmt::sum_loss(l);
    EXPECT_EQ(m.dim(), 0);
    EXPECT_EQ(m.item<double>(), ws + 1.0);  // mean of 2, 4, ..., 2 ws
    ((r + 1) * m).backward();
    EXPECT_EQ(l.grad().item<double>(), (ws + 1) / 2.0);
    at::Tensor vec = bmt::sum_loss(at::full({3}, 4.0 * r, at::kDouble));
    EXPECT_TRUE(at::equal(vec, at::full({3}, 2.0 * (ws - 1), at::kDouble))) << vec;
  }
  {  // gather_result: (2, 3) -> (2 ws, 3), rows [2s, 2s + 2) from rank s
    auto xs = [](int s) { return idx(6).reshape({2, 3}) + 100 * s; };
    at::Tensor g = bmt::gather_result(xs(r).to(at::kFloat));
    EXPECT_EQ(g.sizes().vec(), (std::vector<int64_t>{2 * ws, 3}));
    std::vector<at::Tensor> rows;
    for (int s = 0; s < ws; ++s) rows.push_back(xs(s));
    expect_values(g, at::cat(rows), "gather_result (2, 3)");
    at::Tensor g1 = bmt::gather_result(at::full({5}, r, at::kLong));
    EXPECT_EQ(g1.sizes().vec(), (std::vector<int64_t>{5 * ws}));
    EXPECT_EQ(g1.scalar_type(), at::kLong);
    expect_values(g1, at::floor_divide(idx(5 * ws), 5), "gather_result (5,) int64");
  }
}

}  // namespace

TEST(DistributedOps, GradientsActivationsLossAndResultWorlds1To4) {
  for (int world : {1, 2, 3, 4}) {
    bmt::testing::run_ranks(world, [] {
      gradient_checks(*bmt::config().comm);
      activation_checks(*bmt::config().comm);
      loss_and_result_checks();
    });
  }
}

TEST(DistributedOps, GradientsOnTensorParallelGroups) {
  bmt::InitOptions opts = bmt::testing::test_init();
  opts.tp_size = 2;
  bmt::testing::run_ranks(4, [] {
    gradient_checks(*bmt::config().tp_comm);
    gradient_checks(*bmt::config().tp_zero_comm);
    activation_checks(*bmt::config().tp_comm);
  }, opts);
}
