// The fast checkpoint I/O paths, single process: slicing-by-16 CRC-32 against a bitwise reference, checksums
// computed in parallel segments against the one-shot checksum, the staged shard writer (sync ring and async
// snapshot) across chunk boundaries, and the reader's large verified reads and its byte count (a partial read
// reads only the checksum blocks it needs).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <future>
#include <random>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/checkpoint/parallel_crc_internal.h"
#include "bmt/checkpoint/shard_writer_internal.h"
#include "bmt/checkpoint/slice_plan.h"
#include "error_of.h"

using namespace bmt::checkpoint;

namespace {

// The definition: one bit at a time (reflected 0xEDB88320, init and final xor ~0).
uint32_t crc32_bitwise(const char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= static_cast<uint8_t>(p[i]);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
  }
  return ~c;
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(g());
  return s;
}

std::string temp_dir() {
  char tmpl[] = "/tmp/bmt_ckpt_fastio_XXXXXX";
  return mkdtemp(tmpl);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Restores the default staging chunk size at scope exit.
struct ChunkSize {
  explicit ChunkSize(int64_t n) { set_stage_chunk_nbytes(n); }
  ~ChunkSize() { set_stage_chunk_nbytes(kDefaultStageChunkNbytes); }
};

}  // namespace

TEST(Crc32Fast, SlicingBy16MatchesTheBitwiseDefinitionAtEverySizeAndAlignment) {
  const std::string buf = random_bytes(5000, 1);
  for (size_t off = 0; off < 19; ++off)
    for (size_t n = 0; n <= 300; ++n)
      ASSERT_EQ(crc32(buf.data() + off, n), crc32_bitwise(buf.data() + off, n)) << "offset " << off << " size " << n;
  for (size_t n : {size_t{1023}, size_t{4096}, size_t{4981}})
    EXPECT_EQ(crc32(buf.data() + 3, n), crc32_bitwise(buf.data() + 3, n)) << n;
  // Streaming over uneven pieces continues the same checksum.
  uint32_t c = 0;
  for (size_t pos = 0, step = 1; pos < buf.size(); pos += step, step = step * 3 % 97 + 1)
    c = crc32_update(c, buf.data() + pos, std::min(step, buf.size() - pos));
  EXPECT_EQ(c, crc32_bitwise(buf.data(), buf.size()));
}

TEST(Crc32Fast, FixedLengthCombinerEqualsCombine) {
  const std::string buf = random_bytes(9000, 2);
  for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{1024}, int64_t{4999}}) {
    Crc32Combiner comb(n);
    const uint32_t a = crc32(buf.data(), 4000), b = crc32(buf.data() + 4000, static_cast<size_t>(n));
    EXPECT_EQ(comb.combine(a, b), crc32_combine(a, b, n)) << n;
    EXPECT_EQ(comb.combine(a, b), crc32_bitwise(buf.data(), static_cast<size_t>(4000 + n))) << n;
  }
}

// The writer's way: the file in chunks of C bytes, each chunk's segments checksummed on the pool, joined in order.
TEST(Crc32Fast, ChunkedParallelChecksumsEqualOneShotBlockAndFileChecksums) {
  const std::string data = random_bytes(100003, 3);
  for (int64_t B : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}, int64_t{4096}, int64_t{1} << 20}) {
    for (int64_t C : {int64_t{13}, int64_t{4096}, int64_t{65536}, int64_t{1} << 22}) {
      for (int64_t size : {int64_t{0}, int64_t{1}, B - 1, B, B + 1, 3 * B + 5, int64_t{100003}}) {
        if (size < 0 || size > static_cast<int64_t>(data.size()) || (B == 1 && C == 13 && size > 5000)) continue;
        BlockCrcAccumulator acc(B);
        for (int64_t lo = 0; lo < size; lo += C) {
          const int64_t n = std::min(C, size - lo);
          for (const CrcSegment& s : checksum_async(crc_pool(), data.data() + lo, lo, n, B).get()) acc.add(s);
        }
        ShardFileInfo info;
        acc.finish(info);
        const std::string what = "B " + std::to_string(B) + " C " + std::to_string(C) + " size " + std::to_string(size);
        ASSERT_EQ(info.nbytes, size) << what;
        ASSERT_EQ(info.crc32, crc32_bitwise(data.data(), static_cast<size_t>(size))) << what;
        ASSERT_EQ(static_cast<int64_t>(info.block_crc32.size()), (size + B - 1) / B) << what;
        for (size_t k = 0; k < info.block_crc32.size(); ++k) {
          const int64_t lo = static_cast<int64_t>(k) * B, n = std::min(B, size - lo);
          ASSERT_EQ(info.block_crc32[k], crc32(data.data() + lo, static_cast<size_t>(n))) << what << " block " << k;
        }
      }
    }
  }
}

namespace {

// Items of several dtypes at 64-byte aligned offsets with gaps, some of them a sub-range of their tensor; the
// expected file image built independently.
struct Layout {
  std::vector<WriteItem> items;
  std::string image;
};

Layout make_layout() {
  Layout l;
  std::vector<at::Tensor> ts = {at::randn({3000}), at::randn({77, 13}).to(at::kBFloat16), at::arange(5000, at::kLong),
                                at::randn({1}).to(at::kDouble), at::randn({40000})};
  int64_t pos = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor flat = ts[i].reshape({-1});
    const int64_t begin = i == 2 ? 100 : 0, end = i == 4 ? flat.numel() - 7 : flat.numel();
    pos = (pos + 63) / 64 * 64 + (i == 3 ? 128 : 0);  // alignment gaps, and one wider gap
    l.items.push_back({pos, ts[i], begin, end, false});
    const int64_t nbytes = (end - begin) * static_cast<int64_t>(flat.element_size());
    l.image.resize(static_cast<size_t>(pos), '\0');
    l.image.append(static_cast<const char*>(flat.data_ptr()) + begin * flat.element_size(), static_cast<size_t>(nbytes));
    pos += nbytes;
  }
  l.image.resize(static_cast<size_t>((pos + 63) / 64 * 64 + 10), '\0');  // a zero tail
  return l;
}

void expect_info_matches(const ShardFileInfo& info, const std::string& image, int64_t B, const std::string& what) {
  EXPECT_EQ(info.nbytes, static_cast<int64_t>(image.size())) << what;
  EXPECT_EQ(info.crc32, crc32_bitwise(image.data(), image.size())) << what;
  ASSERT_EQ(static_cast<int64_t>(info.block_crc32.size()), (info.nbytes + B - 1) / B) << what;
  for (size_t k = 0; k < info.block_crc32.size(); ++k) {
    const int64_t lo = static_cast<int64_t>(k) * B, n = std::min(B, info.nbytes - lo);
    EXPECT_EQ(info.block_crc32[k], crc32(image.data() + lo, static_cast<size_t>(n))) << what << " block " << k;
  }
}

}  // namespace

TEST(StagedShardWriter, SyncRingAndAsyncSnapshotWriteTheExactImageAcrossChunkBoundaries) {
  const std::string dir = temp_dir();
  at::manual_seed(7);
  for (int64_t C : {int64_t{64}, int64_t{1000}, int64_t{4096}, int64_t{1} << 20}) {
    ChunkSize chunk(C);
    for (int64_t B : {int64_t{333}, int64_t{4096}}) {
      Layout l = make_layout();
      const int64_t n = static_cast<int64_t>(l.image.size());
      const std::string what = "chunk " + std::to_string(C) + " block " + std::to_string(B);
      const std::string a = join_path(dir, "sync.bin"), b = join_path(dir, "async.bin");
      WriteProfile prof;
      ShardFileInfo ia = write_shard_file(a, "sync.bin", l.items, n, B, &prof);
      EXPECT_EQ(file_bytes(a), l.image) << what;
      expect_info_matches(ia, l.image, B, what);
      EXPECT_EQ(prof.chunks, (n + C - 1) / C) << what;
      // The snapshot holds the values at construction: changing the tensors afterwards changes nothing.
      ShardSnapshot snap(l.items, n);
      for (WriteItem& it : l.items) it.src.zero_();
      l.items.clear();
      ShardFileInfo ib = snap.write(b, "async.bin", B);
      EXPECT_EQ(file_bytes(b), l.image) << what;
      expect_info_matches(ib, l.image, B, what);
    }
  }
  remove_tree(dir);
}

TEST(StagedShardWriter, AWriteErrorNamesTheFile) {
  const std::string dir = temp_dir();
  std::vector<WriteItem> items{{0, at::ones({100}), 0, 100, false}};
  const std::string path = join_path(dir, "missing_subdir/rank-00000.bin");
  const std::string msg = bmt::testing::error_of([&] { write_shard_file(path, "rank-00000.bin", items, 400, 64); });
  EXPECT_NE(msg.find("cannot create file " + path), std::string::npos) << msg;
  remove_tree(dir);
}

namespace {

// A one-rank checkpoint of one F32 entry written through the staged writer.
std::string write_checkpoint(const std::string& dir, const at::Tensor& t, int64_t B) {
  make_directory(dir);
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  std::vector<WriteItem> items{{0, t, 0, t.numel(), false}};
  CheckpointMetadata m;
  m.files = {write_shard_file(join_path(dir, shard_file_name(0)), shard_file_name(0), items, nbytes, B)};
  m.checksum_block_nbytes = B;
  m.entries = {{"model/w", "F32", {t.numel()}, {{"role", "model"}}, {{0, 0, 0, t.numel()}}}};
  write_file_durable(join_path(dir, kMetadataFileName), serialize_metadata(m));
  return join_path(dir, shard_file_name(0));
}

}  // namespace

// prepare_host_chunks (the first async save's buffers, allocated ahead on a background thread): it returns at
// once; a borrow issued while it is still running waits for it and then takes its chunks (the preparer allocated
// every one of them, the borrow none); a later preparation of chunks that exist allocates nothing.
TEST(HostStaging, BackgroundPreparationIsWaitedForAndTakenByTheNextBorrow) {
  set_stage_chunk_nbytes(4096);  // also frees the cached chunks
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::atomic<int> allocated{0};
  set_prepare_hook([&](int64_t i) {
    if (i == 2) open.wait();  // held before its third chunk
    ++allocated;
  });
  const auto t0 = std::chrono::steady_clock::now();
  prepare_host_chunks(5, /*pinned=*/false);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5)
      << "prepare_host_chunks must not wait for the allocation";
  EXPECT_FALSE(host_chunks_prepared());
  auto borrowed = std::async(std::launch::async, [] { return borrow_host_chunks(5, false); });
  EXPECT_EQ(borrowed.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the borrow did not wait for the preparation";
  gate.set_value();
  const std::vector<HostChunk*> chunks = borrowed.get();
  EXPECT_TRUE(host_chunks_prepared());
  ASSERT_EQ(chunks.size(), 5u);
  EXPECT_EQ(allocated.load(), 5) << "the borrow allocated chunks of its own instead of taking the prepared ones";
  EXPECT_EQ(host_chunk_count(), 5);
  for (HostChunk* c : chunks) {
    ASSERT_NE(c->data, nullptr);
    std::memset(c->data, 0x5a, 4096);  // usable memory of the chunk size
  }
  prepare_host_chunks(5, false);  // all there: nothing to allocate
  borrow_host_chunks(5, false);
  EXPECT_EQ(allocated.load(), 5);
  set_prepare_hook(nullptr);
  set_stage_chunk_nbytes(kDefaultStageChunkNbytes);
  EXPECT_EQ(host_chunk_count(), 0);
}

TEST(CheckpointReaderFast, PartialReadsReadOnlyTheirChecksumBlocks) {
  const std::string dir = join_path(temp_dir(), "ckpt");
  const int64_t B = 4096, numel = 300000;  // 1.2 MB: 293 blocks, the last one partial
  at::Tensor t = at::randn({numel});
  write_checkpoint(dir, t, B);
  {
    CheckpointReader r(dir);
    const EntryMeta& e = *r.find("model/w");
    // Elements [5000, 200003): bytes [20000, 800012) -> blocks 4 .. 195 (bytes 16384 .. 802816).
    at::Tensor part = r.read(e, 5000, 200003);
    EXPECT_TRUE(at::equal(part, t.narrow(0, 5000, 195003)));
    EXPECT_EQ(r.bytes_read(), 802816 - 16384);
    // Inside verified blocks only the bytes asked for are read again.
    const int64_t before = r.bytes_read();
    at::Tensor again = r.read(e, 6000, 6010);
    EXPECT_TRUE(at::equal(again, t.narrow(0, 6000, 10)));
    EXPECT_EQ(r.bytes_read() - before, 40);
  }
  {
    CheckpointReader r(dir);
    at::Tensor all = r.read_full(*r.find("model/w"));
    EXPECT_TRUE(at::equal(all, t));
    EXPECT_EQ(r.bytes_read(), numel * 4);  // every byte once
    EXPECT_TRUE(r.verify_all().empty());
  }
  remove_tree(parent_directory(dir));
}

// One batch of spans: spans that share a checksum block read it once (straight into both destinations), and
// overlapping spans (the same bytes to two places) are served from one verified read too.
TEST(CheckpointReaderFast, ABatchOfSpansReadsEachBlockOnce) {
  const std::string dir = join_path(temp_dir(), "ckpt");
  const int64_t B = 4096;
  at::Tensor t = at::randn({300000});
  write_checkpoint(dir, t, B);
  CheckpointReader r(dir);
  const EntryMeta& e = *r.find("model/w");
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{0, 1000}, {1000, 5000}, {500, 1500}, {4990, 5000}};
  std::vector<at::Tensor> outs;
  std::vector<CheckpointReader::FileSpan> spans;
  for (const auto& [a, b] : ranges) {
    outs.push_back(at::zeros({b - a}));
    const size_t first = spans.size();
    r.spans_of(e, a, b, spans);
    for (size_t i = first; i < spans.size(); ++i)
      spans[i].dst = static_cast<char*>(outs.back().data_ptr()) + spans[i].dst_offset;
  }
  r.read_spans(spans);
  for (size_t i = 0; i < ranges.size(); ++i)
    EXPECT_TRUE(at::equal(outs[i], t.narrow(0, ranges[i].first, ranges[i].second - ranges[i].first))) << i;
  EXPECT_EQ(r.bytes_read(), 5 * B);  // elements [0, 5000) = bytes [0, 20000): blocks 0..4, each once
  remove_tree(parent_directory(dir));
}

TEST(CheckpointReaderFast, CorruptionInsideALargeReadIsReportedWithItsBlock) {
  const std::string dir = join_path(temp_dir(), "ckpt");
  at::Tensor t = at::randn({400000});
  const std::string shard = write_checkpoint(dir, t, int64_t{1} << 16);
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(1000000);
    f.get(c);
    f.seekp(1000000);
    f.put(static_cast<char>(c ^ 0x5a));
  }
  CheckpointReader r(dir);
  const std::string msg = bmt::testing::error_of([&] { r.read_full(*r.find("model/w")); });
  EXPECT_NE(msg.find("checksum mismatch in rank-00000.bin (bytes 983040-1048576)"), std::string::npos) << msg;
  remove_tree(parent_directory(dir));
}
