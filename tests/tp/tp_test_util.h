// Helpers of the tensor-parallel tests: reading back gradients in logical (unsplit) form and comparing tensors.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "run_ranks.h"

namespace bmt::testing {

// The test initialisation with a tp group of `tp` ranks and the given activation layout.
inline InitOptions tp_init(int tp, bool sequence_parallel = true) {
  InitOptions o = test_init();
  o.tp_size = tp;
  o.sequence_parallel = sequence_parallel;
  return o;
}

// The gradient of this rank's tp piece of `param` (its full_shape), assembled from every ZeRO shard's main_grad.
inline at::Tensor piece_grad(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  at::Tensor full = at::zeros({m.full_numel}, at::kFloat);
  at::Tensor g = main_grad(param);
  if (g.defined() && g.numel() > 0) full.narrow(0, m.shard_begin, g.numel()).copy_(g.reshape({-1}).to(at::kFloat));
  return distributed::raw_all_reduce(full, core::ReduceOp::kSum, *m.comm).view(m.full_shape);
}

// The gradient of the whole logical tensor (pieces all-gathered over tp for split parameters).
inline at::Tensor logical_grad(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  at::Tensor piece = piece_grad(param);
  if (!m.is_tp_split()) return piece;
  at::Tensor all = distributed::raw_all_gather(piece.contiguous(), *config().tp_comm);
  return logical_from_pieces(m, all.unbind(0));
}

inline void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what, double tol = 2e-5) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  at::Tensor g = got.detach().to(at::kDouble), w = want.detach().to(at::kDouble);
  const double err = (g - w).abs().max().item<double>();
  const double scale = std::max(1.0, w.abs().max().item<double>());
  EXPECT_LE(err, tol * scale) << what << " (rank " << config().rank << ", tp rank " << config().tp_rank
                              << "): max abs error " << err;
}

}  // namespace bmt::testing
