// The staged (CUDA) in-place load's plan, on CPUs: plan_staged_load (load_staging_internal.h) lays the items' file
// spans into staging chunks and lists the host-to-device copies. Checked against the rules it must keep:
//  * every byte of every item is read once and copied once, to the right place of the right item;
//  * copies merge only within one item (two items may be separate allocations adjacent in address space: one
//    cudaMemcpyAsync must never span two of them), and only where staging and destination are both contiguous;
//  * a chunk that ends inside a span ends at a checksum-block boundary where the piece crosses one, so such a
//    block is read by one chunk only (without a boundary in the piece, the cut is at the chunk's end);
//  * no chunk exceeds the chunk size.
// The GPU side (tests/cuda/test_ckpt_load_cuda.cpp) loads real tensors, separate allocations included.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "bmt/checkpoint/load_staging_internal.h"

namespace {

using bmt::checkpoint::StagedChunk;
using FileSpan = bmt::checkpoint::CheckpointReader::FileSpan;

FileSpan span(int file, int64_t file_offset, int64_t nbytes, int64_t dst_offset) {
  return {file, file_offset, nbytes, dst_offset, nullptr};
}

// Replays the plan byte by byte: for every item byte, (file, file offset) it came from; checks the invariants.
// The spans given never touch each other in a file, so two file-contiguous pieces in consecutive chunks are one
// span cut by the chunk end.
void check_plan(const std::vector<std::vector<FileSpan>>& items, const std::vector<StagedChunk>& plan, int64_t C,
                int64_t B) {
  for (size_t k = 0; k + 1 < plan.size(); ++k) {
    const FileSpan& a = plan[k].spans.back();
    const FileSpan& b = plan[k + 1].spans.front();
    if (a.file != b.file || a.file_offset + a.nbytes != b.file_offset) continue;
    const int64_t cut = b.file_offset;
    const bool had_boundary = (cut - 1) / B * B > a.file_offset;  // a multiple of B in (a.file_offset, cut)
    EXPECT_TRUE(cut % B == 0 || !had_boundary)
        << "chunk " << k << " ends at file offset " << cut << ", not at the block boundary inside its last piece";
  }
  std::vector<std::map<int64_t, std::pair<int, int64_t>>> landed(items.size());
  for (size_t k = 0; k < plan.size(); ++k) {
    std::map<int64_t, std::pair<int, int64_t>> staged;  // staging offset -> file byte
    for (const FileSpan& s : plan[k].spans) {
      ASSERT_GT(s.nbytes, 0);
      ASSERT_LE(s.dst_offset + s.nbytes, C) << "chunk " << k << " overflows the staging chunk";
      for (int64_t i = 0; i < s.nbytes; ++i) {
        ASSERT_TRUE(staged.emplace(s.dst_offset + i, std::make_pair(s.file, s.file_offset + i)).second)
            << "chunk " << k << ": staging byte " << s.dst_offset + i << " read twice";
      }
    }
    for (const auto& c : plan[k].copies) {
      ASSERT_LT(c.item, items.size());
      for (int64_t i = 0; i < c.nbytes; ++i) {
        auto it = staged.find(c.staged_offset + i);
        ASSERT_NE(it, staged.end()) << "chunk " << k << " copies a staging byte nothing read";
        ASSERT_TRUE(landed[c.item].emplace(c.dst_offset + i, it->second).second)
            << "item " << c.item << " byte " << c.dst_offset + i << " written twice";
      }
    }
  }
  for (size_t item = 0; item < items.size(); ++item) {
    size_t want = 0;
    for (const FileSpan& s : items[item]) {
      want += static_cast<size_t>(s.nbytes);
      for (int64_t i = 0; i < s.nbytes; ++i) {
        auto it = landed[item].find(s.dst_offset + i);
        ASSERT_NE(it, landed[item].end()) << "item " << item << " byte " << s.dst_offset + i << " never written";
        EXPECT_EQ(it->second, std::make_pair(s.file, s.file_offset + i)) << "item " << item << " byte " << s.dst_offset + i;
      }
    }
    EXPECT_EQ(landed[item].size(), want) << "item " << item;
  }
}

}  // namespace

TEST(LoadPlan, CopiesNeverMergeAcrossItemsEvenWhenEverythingIsContiguous) {
  // Two items whose bytes follow each other in the file and in staging (and could follow each other in memory):
  // one copy each.
  const std::vector<std::vector<FileSpan>> items = {{span(0, 0, 100, 0)}, {span(0, 100, 60, 0)}};
  const auto plan = bmt::checkpoint::plan_staged_load(items, 1 << 20, 1 << 20);
  ASSERT_EQ(plan.size(), 1u);
  ASSERT_EQ(plan[0].copies.size(), 2u);
  EXPECT_EQ(plan[0].copies[0].item, 0u);
  EXPECT_EQ(plan[0].copies[0].nbytes, 100);
  EXPECT_EQ(plan[0].copies[1].item, 1u);
  EXPECT_EQ(plan[0].copies[1].staged_offset, 100);
  EXPECT_EQ(plan[0].copies[1].dst_offset, 0);
  check_plan(items, plan, 1 << 20, 1 << 20);
}

TEST(LoadPlan, CopiesMergeWithinAnItemOnlyWhereTheDestinationIsContiguous) {
  // One item, three spans from two files: 0..40 and 40..100 are contiguous in the item (one copy), 150.. is not.
  const std::vector<std::vector<FileSpan>> items = {{span(0, 1000, 40, 0), span(1, 0, 60, 40), span(1, 500, 30, 150)}};
  const auto plan = bmt::checkpoint::plan_staged_load(items, 1 << 20, 1 << 20);
  ASSERT_EQ(plan.size(), 1u);
  ASSERT_EQ(plan[0].spans.size(), 3u) << "one read per span";
  ASSERT_EQ(plan[0].copies.size(), 2u);
  EXPECT_EQ(plan[0].copies[0].nbytes, 100);
  EXPECT_EQ(plan[0].copies[1].dst_offset, 150);
  EXPECT_EQ(plan[0].copies[1].nbytes, 30);
  check_plan(items, plan, 1 << 20, 1 << 20);
}

TEST(LoadPlan, AChunkEndingInsideASpanEndsAtABlockBoundary) {
  // Chunk 100 bytes, blocks 32: a 250-byte span starting at file offset 10 is cut at offsets 96 (86 bytes: the last
  // block boundary inside the first chunk), 192, and the rest.
  const std::vector<std::vector<FileSpan>> items = {{span(0, 10, 250, 0)}};
  const auto plan = bmt::checkpoint::plan_staged_load(items, 100, 32);
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0].spans[0].nbytes, 86);
  EXPECT_EQ(plan[1].spans[0].file_offset, 96);
  EXPECT_EQ(plan[1].spans[0].nbytes, 96);
  EXPECT_EQ(plan[2].spans[0].file_offset, 192);
  EXPECT_EQ(plan[2].spans[0].nbytes, 68);
  check_plan(items, plan, 100, 32);
}

TEST(LoadPlan, BlocksLargerThanTheChunkStillCoverEveryByteOnce) {
  // No block boundary inside the chunk's share of the span: the chunk is cut at its end (a block then spans two
  // chunks: allowed only because there is no boundary to cut at).
  const std::vector<std::vector<FileSpan>> items = {{span(0, 0, 300, 0)}};
  const auto plan = bmt::checkpoint::plan_staged_load(items, 64, 1024);
  EXPECT_EQ(plan.size(), 5u);
  check_plan(items, plan, 64, 1024);
}

TEST(LoadPlan, RandomLayoutsKeepEveryRule) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t B = int64_t{8} << (rng() % 4), C = B * (1 + static_cast<int64_t>(rng() % 5)) + (rng() % 2 ? 0 : 13);
    std::vector<std::vector<FileSpan>> items(1 + rng() % 5);
    int64_t file_pos = static_cast<int64_t>(rng() % 50);
    for (auto& spans : items) {
      int64_t dst = 0;
      for (int s = 0, n = 1 + static_cast<int>(rng() % 4); s < n; ++s) {
        const int64_t len = 1 + static_cast<int64_t>(rng() % 200);
        spans.push_back(span(static_cast<int>(rng() % 2), file_pos, len, dst));
        file_pos += len + 1 + static_cast<int64_t>(rng() % 3) * 7;  // spans never touch (see check_plan)
        dst += len + (rng() % 3 == 0 ? 16 : 0);  // sometimes a gap in the destination
      }
    }
    const auto plan = bmt::checkpoint::plan_staged_load(items, C, B);
    SCOPED_TRACE("trial " + std::to_string(trial) + " C " + std::to_string(C) + " B " + std::to_string(B));
    check_plan(items, plan, C, B);
    // Merging: two consecutive copies of one chunk for the same item are never mergeable (else the plan missed it).
    for (const auto& ch : plan)
      for (size_t i = 1; i < ch.copies.size(); ++i) {
        const auto &a = ch.copies[i - 1], &b = ch.copies[i];
        EXPECT_FALSE(a.item == b.item && a.staged_offset + a.nbytes == b.staged_offset &&
                     a.dst_offset + a.nbytes == b.dst_offset);
      }
    if (::testing::Test::HasFailure()) break;
  }
}
