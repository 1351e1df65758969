// run_ranks itself: a rank process whose test takes another path than the parent's and never reaches the
// run_ranks call it was started for must fail (it would otherwise pass without running anything).
#include <gtest/gtest.h>

#include "bmt/runtime/distributed.h"
#include "run_ranks.h"

TEST(RunRanks, ChildThatNeverReachesItsBodyFails) {
  if (bmt::testing::in_rank_process()) return;  // the child's path: skips the call below
  bmt::testing::RankRunOptions run;
  run.expect_failure = true;
  auto report = bmt::testing::run_ranks(2, [] {}, bmt::testing::test_init(), run);
  EXPECT_FALSE(report.all_ok) << "a rank that skipped its body passed";
  EXPECT_NE(report.summary.find("exit code 3"), std::string::npos) << report.summary;
  EXPECT_NE(report.summary.find("without reaching the run_ranks call"), std::string::npos) << report.summary;
}

TEST(RunRanks, RunDirIsSharedByTheRanksOfOneCall) {
  bmt::testing::run_ranks(2, [] {
    const std::string dir = bmt::testing::run_dir();
    EXPECT_EQ(dir.rfind("/tmp/bmt_ranks_", 0), 0u) << dir;
    // Each rank writes a file; after a barrier both see both.
    FILE* f = std::fopen((dir + "/hello" + std::to_string(bmt::rank())).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
    bmt::synchronize();
    for (int r = 0; r < 2; ++r) {
      FILE* seen = std::fopen((dir + "/hello" + std::to_string(r)).c_str(), "r");
      EXPECT_NE(seen, nullptr) << "rank " << r << "'s file is missing";
      if (seen) std::fclose(seen);
    }
  });
}
