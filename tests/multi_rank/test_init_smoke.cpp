#include <gtest/gtest.h>

#include "bmt/runtime/distributed.h"
#include "run_ranks.h"

TEST(InitSmoke, WorldAndGroups) {
  for (int world : {1, 2, 4}) {
    bmt::InitOptions opts = bmt::testing::test_init();
    opts.tp_size = world >= 2 ? 2 : 1;
    bmt::testing::run_ranks(world, [&] {
      const auto& c = bmt::config();
      EXPECT_EQ(c.world_size, world);
      EXPECT_EQ(c.tp_size, opts.tp_size);
      EXPECT_EQ(c.tp_zero_size, world / opts.tp_size);
      at::Tensor x = at::full({5}, static_cast<double>(c.rank + 1));
      at::Tensor s = bmt::distributed::all_reduce(x, bmt::core::ReduceOp::kSum, *c.comm);
      EXPECT_EQ(s[0].item<float>(), world * (world + 1) / 2);
    }, opts);
  }
}
