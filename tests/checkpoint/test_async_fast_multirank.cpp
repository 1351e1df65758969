// Async saves through the host snapshot: the files equal a sync save's byte for byte (also with small staging
// chunks, so that pieces straddle chunk boundaries), and a failure of the background write (a real write error:
// the file-size limit of the rank processes) is reported at the next save and at wait(), naming the file.
#include <signal.h>
#include <sys/resource.h>

#include <chrono>
#include <thread>

#include "bmt/checkpoint/host_staging_internal.h"
#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(AsyncSnapshot, AsyncSaveWritesTheSameBytesAsASyncSave) {
  SharedDir dir("async_bits");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true);
    t.step(0);
    for (int64_t chunk : {int64_t{1000}, ck::kDefaultStageChunkNbytes}) {
      ck::set_stage_chunk_nbytes(chunk);
      const std::string tag = std::to_string(chunk);
      ck::save(dir / ("sync" + tag), t.state(1)).wait();
      ck::SaveOptions o;
      o.async = true;
      ck::SaveHandle h = ck::save(dir / ("async" + tag), t.state(1), o);
      t.step(1);  // training goes on while the snapshot is written
      const ck::SaveStats s = h.wait();
      EXPECT_GT(s.rank_nbytes, 1000) << "the file should span several chunks";
      bmt::synchronize();
      for (int r = 0; r < 2; ++r) {
        const std::string name = ck::shard_file_name(r);
        const std::string a = file_bytes(dir / ("sync" + tag + "/" + name)), b = file_bytes(dir / ("async" + tag + "/" + name));
        EXPECT_FALSE(a.empty());
        EXPECT_TRUE(a == b) << name << " differs between the sync and the async save (chunk " << chunk << ")";
      }
      // And it loads into the state it was taken from.
      Trainer fresh(3, true);
      ck::TrainingState st = fresh.state(0);
      ck::load(dir / ("async" + tag), st);
      EXPECT_EQ(st.step, 1);
    }
    ck::set_stage_chunk_nbytes(ck::kDefaultStageChunkNbytes);
  });
}

// prepare_async_save allocates exactly the chunks the async save of that state takes (the whole shard file), on a
// background thread; the save then allocates none, and what it writes loads back.
TEST(AsyncSnapshot, PreparedBuffersAreExactlyThoseTheFirstAsyncSaveUses) {
  SharedDir dir("async_prepared");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true);
    t.step(0);
    ck::set_stage_chunk_nbytes(1000);  // several chunks per shard file; no chunk cached
    ASSERT_EQ(ck::host_chunk_count(), 0);
    ck::prepare_async_save(t.state(1));
    t.step(1);  // training goes on while the buffers are allocated
    while (!ck::host_chunks_prepared()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int64_t prepared = ck::host_chunk_count();
    ck::SaveOptions o;
    o.async = true;
    ck::SaveHandle h = ck::save(dir / "ckpt", t.state(2), o);
    const int64_t after_save = ck::host_chunk_count();
    const ck::SaveStats s = h.wait();
    EXPECT_EQ(after_save, (s.rank_nbytes + 999) / 1000) << "prepared chunks differ from what the save needed";
    EXPECT_EQ(prepared, after_save) << "the save allocated chunks of its own";
    Trainer fresh(3, true);
    ck::TrainingState st = fresh.state(0);
    ck::load(dir / "ckpt", st);
    EXPECT_EQ(st.step, 2);
    ck::set_stage_chunk_nbytes(ck::kDefaultStageChunkNbytes);
  });
}

TEST(AsyncSnapshot, ABackgroundWriteErrorIsReportedAtTheNextSaveNamingTheFile) {
  SharedDir dir("async_fail");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true);
    t.step(0);
    ck::save(dir / "ckpt", t.state(1)).wait();  // a good checkpoint that must survive
    // Writes past 1 KiB fail with EFBIG in this rank process (the shard files are larger; the markers are not).
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit old {};
    ::getrlimit(RLIMIT_FSIZE, &old);
    struct rlimit small = old;
    small.rlim_cur = 1024;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    ck::SaveOptions o;
    o.async = true;
    ck::SaveHandle h = ck::save(dir / "ckpt", t.state(2), o);  // returns: the write fails in the background
    t.step(1);
    std::string msg;
    try {
      ck::save(dir / "other", t.state(3), o);  // the next save waits for the failed one and reports it
    } catch (const bmt::core::Error& e) {
      msg = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    EXPECT_NE(msg.find("checkpoint save to " + dir / "ckpt"), std::string::npos) << msg;
    EXPECT_NE(msg.find(".tmp-"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/rank-0000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("file-size limit"), std::string::npos) << msg;
    // wait() on the failed handle reports the same error again.
    std::string again;
    try {
      h.wait();
    } catch (const bmt::core::Error& e) {
      again = e.what();
    }
    EXPECT_NE(again.find("file-size limit"), std::string::npos) << again;
    // Nothing was committed: the previous checkpoint is intact, the other one does not exist.
    bmt::synchronize();
    EXPECT_FALSE(ck::path_exists(dir / "other"));
    Trainer fresh(3, true);
    ck::TrainingState st = fresh.state(0);
    EXPECT_EQ(ck::load(dir / "ckpt", st).step, 1);
    // And saving works again.
    ck::save(dir / "ckpt", t.state(4), o).wait();
    EXPECT_EQ(ck::load(dir / "ckpt", st).step, 4);
  });
}
