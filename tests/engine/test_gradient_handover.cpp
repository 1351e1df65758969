// The gradient hand-over (add_grad_ready_hook's GradTakeoverQuery): on one rank, a Block whose gradients a hook
// takes over gives the parameters' own (bf16) gradients as main gradients, no fp32 shard; the values are those the
// shard would hold, bit for bit (a widening copy). Gradients still held at the next backward are moved into a
// shard and accumulated into as if they had been there all along. With several ranks the query is not honoured
// (the reduction needs a shard).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

using Grads = std::vector<at::Tensor>;  // main gradients of every Block parameter, widened to fp32, in order

struct Outcome {
  std::vector<Grads> after_backward;   // one entry per backward
  std::vector<std::string> dtypes_seen;  // main-gradient dtype of each Block parameter when the hook ran
  std::vector<int64_t> shard_nbytes_seen;  // Block::grad_nbytes() when the hook ran
};

Grads block_grads(tiny::Model& model) {
  Grads out;
  for (size_t i = 0; i < model.list->size(); ++i)
    for (auto& p : (*model.list)[i].module()->parameters()) out.push_back(bmt::main_grad(p).to(at::kFloat).clone());
  return out;
}

Outcome train(bool take_over, int backwards) {
  tiny::Dims d;
  d.dtype = at::kBFloat16;
  tiny::Model model(d, {}, true);
  at::manual_seed(11);
  bmt::init_parameters(model);
  Outcome run;
  int hook = -1;
  if (take_over)
    hook = bmt::add_grad_ready_hook(
        [&run](bmt::Block& block) {
          for (auto& p : block.module()->parameters())
            run.dtypes_seen.push_back(c10::toString(bmt::main_grad(p).scalar_type()));
          run.shard_nbytes_seen.push_back(block.grad_nbytes());
        },
        [](const bmt::Block&) { return true; });  // claims the gradients but never frees them
  at::manual_seed(12);
  for (int b = 0; b < backwards; ++b) {
    at::Tensor ids = at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong));
    at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}).to(at::kFloat), ids.narrow(1, 1, 4).reshape({-1})).backward();
    run.after_backward.push_back(block_grads(model));
  }
  if (hook >= 0) bmt::remove_grad_ready_hook(hook);
  return run;
}

void expect_same(const Grads& ref, const Grads& got, const std::string& what) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(at::equal(ref[i], got[i])) << what << ", parameter " << i;
}

}  // namespace

TEST(GradientHandover, OneRankHandsOverBf16GradientsEqualToTheShard) {
  bmt::testing::run_ranks(1, [] {
    const Outcome ref = train(false, 2);
    const Outcome got = train(true, 2);
    ASSERT_EQ(got.after_backward.size(), 2u);
    expect_same(ref.after_backward[0], got.after_backward[0], "first backward (handed over)");
    expect_same(ref.after_backward[1], got.after_backward[1], "second backward (moved into a shard, accumulated)");
    // First backward: every Block handed over its own bf16 gradients, no shard allocated. Second: a shard again.
    const size_t per_backward = got.dtypes_seen.size() / 2;
    ASSERT_GT(per_backward, 0u);
    for (size_t i = 0; i < per_backward; ++i) EXPECT_EQ(got.dtypes_seen[i], "BFloat16") << i;
    for (size_t i = per_backward; i < got.dtypes_seen.size(); ++i) EXPECT_EQ(got.dtypes_seen[i], "Float") << i;
    const size_t blocks = got.shard_nbytes_seen.size() / 2;
    for (size_t i = 0; i < blocks; ++i) EXPECT_EQ(got.shard_nbytes_seen[i], 0) << "Block " << i;
    for (size_t i = blocks; i < 2 * blocks; ++i) EXPECT_GT(got.shard_nbytes_seen[i], 0) << "Block " << i;
  });
}

TEST(GradientHandover, SeveralRanksKeepTheReducedShard) {
  bmt::testing::run_ranks(2, [] {
    const Outcome ref = train(false, 1);
    const Outcome got = train(true, 1);
    expect_same(ref.after_backward[0], got.after_backward[0], "reduced");
    for (const std::string& dt : got.dtypes_seen) EXPECT_EQ(dt, "Float");
  });
}
