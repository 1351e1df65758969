// The overlapped sequence-parallel linears (src/bmt/nn/tp_overlap.h) against the separate ops they replace, on CPU
// ranks over Gloo at tp 2 and 4 (and dp 2 x tp 2): outputs and the input, weight and bias gradients, for 2-D and
// 3-D inputs and chunk counts that do and do not divide the rows (and exceed them); then ColumnParallelLinear and
// RowParallelLinear with the switch on against the same layers with it off. Nothing overlaps on Gloo; what is
// checked is that chunking and the block order give the separate ops' values.
#include <gtest/gtest.h>

#include "bmt/nn/parallel_layers.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/nn/tp_overlap.h"
#include "run_ranks.h"
#include "tp_test_util.h"

namespace {

using bmt::testing::expect_close;
using bmt::testing::run_ranks;

using bmt::testing::tp_init;

at::Tensor seeded(uint64_t seed, std::vector<int64_t> shape) {
  at::manual_seed(seed);
  return at::randn(shape);
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

void ops_match_the_separate_ops() {
  const int r = bmt::config().tp_rank, tp = bmt::config().tp_size;
  const int64_t in = 5, out = 7;
  for (const std::vector<int64_t>& local_shape : {std::vector<int64_t>{6, in}, std::vector<int64_t>{3, 2, in}}) {
    for (int64_t chunks : {1, 2, 4, 100}) {
      const std::string what = "rows " + std::to_string(local_shape[0]) + (local_shape.size() == 3 ? " (3-D)" : "") +
                               ", chunks " + std::to_string(chunks);
      // gather_rows_linear: each rank's own rows, one weight (the column-parallel piece), one bias.
      const at::Tensor x0 = seeded(100 + r, local_shape), w0 = seeded(7, {out, in}), b0 = seeded(8, {out});
      std::vector<int64_t> gathered_shape = local_shape;
      gathered_shape[0] *= tp;
      gathered_shape.back() = out;
      const at::Tensor g0 = seeded(200 + r, gathered_shape);  // this rank's upstream gradient
      at::Tensor x = leaf(x0), w = leaf(w0), b = leaf(b0);
      at::Tensor y = bmt::tp::gather_rows_linear(x, w, b, chunks);
      y.backward(g0);
      at::Tensor xr = leaf(x0), wr = leaf(w0), br = leaf(b0);
      at::Tensor yr = at::linear(bmt::tp::gather_rows(xr), wr, br);
      yr.backward(g0);
      expect_close(y, yr, "gather_rows_linear y, " + what);
      expect_close(x.grad(), xr.grad(), "gather_rows_linear dx, " + what);
      expect_close(w.grad(), wr.grad(), "gather_rows_linear dw, " + what);
      expect_close(b.grad(), br.grad(), "gather_rows_linear db, " + what);

      // linear_reduce_scatter_rows: every rank's full rows of its input features (row-parallel), its weight piece.
      std::vector<int64_t> full_shape = local_shape;
      full_shape[0] *= tp;
      const at::Tensor a0 = seeded(300 + r, full_shape), v0 = seeded(400 + r, {out, in});
      std::vector<int64_t> scattered_shape = local_shape;
      scattered_shape.back() = out;
      const at::Tensor h0 = seeded(500 + r, scattered_shape);
      at::Tensor a = leaf(a0), v = leaf(v0);
      at::Tensor z = bmt::tp::linear_reduce_scatter_rows(a, v, chunks);
      z.backward(h0);
      at::Tensor ar = leaf(a0), vr = leaf(v0);
      at::Tensor zr = bmt::tp::reduce_scatter_rows(at::linear(ar, vr));
      zr.backward(h0);
      expect_close(z, zr, "linear_reduce_scatter_rows y, " + what);
      expect_close(a.grad(), ar.grad(), "linear_reduce_scatter_rows dx, " + what);
      expect_close(v.grad(), vr.grad(), "linear_reduce_scatter_rows dw, " + what);
    }
  }
  // Rows that do not split over tp: the error names the sizes (before any collective, on every rank alike).
  if (tp > 1) {
    try {
      bmt::tp::linear_reduce_scatter_rows(at::randn({tp * 3 + 1, in}), at::randn({out, in}), 2);
      ADD_FAILURE() << "no error for rows that tp does not divide";
    } catch (const bmt::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("divisible by tp_size"), std::string::npos) << e.what();
    }
  }
}

// The layers with BMT_TP_OVERLAP_CHUNKS' switch on against the same layers with it off: same outputs, same input
// gradients (the weight gradients go through the same autograd as above).
void layers_match_with_the_switch() {
  const int r = bmt::config().tp_rank, tp = bmt::config().tp_size;
  const int64_t d = 8, ff = 16, rows = 4;
  bmt::nn::ColumnParallelLinear fc(d, ff, true, at::kFloat);
  bmt::nn::RowParallelLinear proj(ff, d, true, at::kFloat);
  const at::Tensor x0 = seeded(600 + r, {rows, d}), g0 = seeded(700 + r, {rows, d});
  auto run = [&](int64_t chunks) {
    bmt::tp::set_overlap_chunks(chunks);
    at::Tensor x = leaf(x0);
    at::Tensor y = proj->forward(at::gelu(fc->forward(x)));
    y.backward(g0);
    bmt::tp::set_overlap_chunks(0);
    return std::make_pair(y.detach(), x.grad());
  };
  const auto [y_off, dx_off] = run(0);
  for (int64_t chunks : {1, 3}) {
    const auto [y_on, dx_on] = run(chunks);
    expect_close(y_on, y_off, "layers y, chunks " + std::to_string(chunks) + ", tp " + std::to_string(tp));
    expect_close(dx_on, dx_off, "layers dx, chunks " + std::to_string(chunks));
  }
}

}  // namespace

TEST(TpOverlap, OpsMatchTheSeparateOpsTp2) { run_ranks(2, ops_match_the_separate_ops, tp_init(2)); }
TEST(TpOverlap, OpsMatchTheSeparateOpsTp4) { run_ranks(4, ops_match_the_separate_ops, tp_init(4)); }
TEST(TpOverlap, OpsMatchTheSeparateOpsDp2Tp2) { run_ranks(4, ops_match_the_separate_ops, tp_init(2)); }
TEST(TpOverlap, Tp1IsAPlainLinear) { run_ranks(1, ops_match_the_separate_ops, tp_init(1)); }
TEST(TpOverlap, LayersMatchWithTheSwitchTp2) { run_ranks(2, layers_match_with_the_switch, tp_init(2)); }
