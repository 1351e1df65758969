// Async sharded saves (the checkpoint holds the state at save() time although training modified it while the
// writer ran; the stall is reported) and clear, agreed errors: corrupted shard, unknown format version, optimizer
// state loaded into a different model, missing checkpoint.
#include <cstdio>
#include <fstream>
#include <thread>

#include "bmt/checkpoint/checkpoint_reader.h"

#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

std::string load_error(const std::string& dir, ck::TrainingState& st) {
  try {
    ck::load(dir, st);
  } catch (const bmt::core::Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST(ShardedCheckpoint, AsyncSaveSnapshotsStateAndReportsStall) {
  SharedDir dir("async");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true);
    t.step(0);
    bmt::StateDict expected = bmt::state_dict(*t.model);
    // Slow the writer down so that training provably overlaps the write.
    ck::set_write_hook([](const std::string&, int64_t, int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); });
    ck::SaveOptions o;
    o.async = true;
    ck::SaveHandle h = ck::save(dir / "ckpt", t.state(1), o);
    const double stall_s = h.stall_s();
    EXPECT_GT(stall_s, 0.0);
    const double loss_during = t.step(1);  // modifies the live parameters while the writer runs
    (void)loss_during;
    ck::SaveStats stats = h.wait();
    ck::set_write_hook(nullptr);
    EXPECT_TRUE(h.done());
    EXPECT_GT(stats.rank_nbytes, 0);
    EXPECT_GE(stats.total_s, 0.02);
    EXPECT_LT(stats.stall_s, stats.total_s);
    EXPECT_EQ(stats.stall_s, stall_s);
    EXPECT_GT(stats.snapshot_s, 0.0);
    // A second async save waits for nothing (the first was waited); a third one is joined by the next save.
    ck::save(dir / "ckpt2", t.state(2), o);
    ck::save(dir / "ckpt3", t.state(2), o).wait();

    Trainer fresh(3, true);
    ck::TrainingState st = fresh.state(0);
    ck::load(dir / "ckpt", st);
    EXPECT_EQ(st.step, 1);
    bmt::StateDict got = bmt::state_dict(*fresh.model);
    for (auto& kv : expected) EXPECT_TRUE(at::equal(got.at(kv.first), kv.second)) << kv.first;
    // Replacing an existing checkpoint (ckpt2 is overwritten in place, atomically).
    ck::save(dir / "ckpt2", fresh.state(5)).wait();
    ck::TrainingState st2 = t.state(0);
    EXPECT_EQ(ck::load(dir / "ckpt2", st2).step, 5);
  });
}

TEST(ShardedCheckpoint, ErrorsAreClearAndAgreedOnEveryRank) {
  SharedDir dir("errors");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true);
    t.step(0);
    ck::save(dir / "ckpt", t.state(1)).wait();

    // Loading an optimizer state (and a model) into a different model.
    tiny::Dims other;
    other.ff = 32;
    Trainer wrong(3, true, other);
    ck::TrainingState ws = wrong.state(0);
    std::string msg = load_error(dir / "ckpt", ws);
    EXPECT_NE(msg.find("layers.0.fc1.weight: checkpoint has F32 [16, 8], model has F32 [32, 8]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("exp_avg of layers.0.fc1.weight has shape [16, 8] in the checkpoint, the parameter has [32, 8]"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("ranks 0,1"), std::string::npos) << msg;

    // A component the checkpoint does not have.
    ck::TrainingState extra = t.state(0);
    extra.add("sched2", *t.sched);
    msg = load_error(dir / "ckpt", extra);
    EXPECT_NE(msg.find("no state for component \"sched2\""), std::string::npos) << msg;

    // Missing checkpoint.
    ck::TrainingState st = t.state(0);
    msg = load_error(dir / "nothing_here", st);
    EXPECT_NE(msg.find("no such directory"), std::string::npos) << msg;

    // A corrupted byte in rank 1's shard: the rank reading it and every other rank report the file.
    bmt::synchronize();
    if (bmt::rank() == 0) {
      std::fstream f(dir / "ckpt/rank-00001.bin", std::ios::in | std::ios::out | std::ios::binary);
      char c = 0;
      f.seekg(0);
      f.get(c);
      f.seekp(0);
      f.put(static_cast<char>(c ^ 0x55));
    }
    bmt::synchronize();
    msg = load_error(dir / "ckpt", st);
    EXPECT_NE(msg.find("checksum mismatch in rank-00001.bin"), std::string::npos) << msg;

    // An unknown format version.
    ck::save(dir / "ckpt_v", t.state(1)).wait();
    if (bmt::rank() == 0) {
      std::string meta = ck::read_file(dir / "ckpt_v/checkpoint.meta", 1 << 30);
      meta[8] = '9';
      ck::write_file_durable(dir / "ckpt_v/checkpoint.meta", meta);
    }
    bmt::synchronize();
    msg = load_error(dir / "ckpt_v", st);
    EXPECT_NE(msg.find("unknown checkpoint format version 9"), std::string::npos) << msg;
  });
}

// Damage found while the tensors are read into place (after the check) has already overwritten part of the model
// and optimizer: the error must say so, on every rank, so that nobody trains on from the half-loaded state.
TEST(ShardedCheckpoint, DamageFoundWhileLoadingInPlaceSaysTheStateIsPartlyOverwritten) {
  SharedDir dir("partly");
  bmt::testing::run_ranks(2, [&] {
    tiny::Dims d;
    d.dim = 64;
    d.ff = 256;  // fc1/fc2 weights of 64 KB: many 4 KB checksum blocks hold nothing but their bytes
    Trainer t(3, true, d);
    t.step(0);
    ck::SaveOptions o;
    o.checksum_block_nbytes = 4096;
    ck::save(dir / "ckpt", t.state(1), o).wait();
    bmt::synchronize();
    if (bmt::rank() == 0) {
      // The middle of the largest model tensor's first piece: read in the apply phase, not by the check.
      ck::CheckpointReader r(dir / "ckpt");
      const ck::EntryMeta* big = nullptr;
      for (const ck::EntryMeta& e : r.metadata().entries) {
        auto role = e.attrs.find("role");
        if (role == e.attrs.end() || role->second != "model" || e.pieces.empty() || e.dtype != "F32") continue;
        if (!big || e.pieces[0].elem_end - e.pieces[0].elem_begin > big->pieces[0].elem_end - big->pieces[0].elem_begin)
          big = &e;
      }
      ASSERT_NE(big, nullptr);
      const ck::Piece& p = big->pieces[0];
      ASSERT_GE((p.elem_end - p.elem_begin) * 4, 3 * 4096) << big->key << " is too small to hold its own blocks";
      const int64_t at = p.byte_offset + (p.elem_end - p.elem_begin) * 4 / 2;
      char name[32];
      std::snprintf(name, sizeof name, "rank-%05d.bin", p.file);
      std::fstream f(dir / ("ckpt/" + std::string(name)), std::ios::in | std::ios::out | std::ios::binary);
      char c = 0;
      f.seekg(at);
      f.get(c);
      f.seekp(at);
      f.put(static_cast<char>(c ^ 0x55));
    }
    bmt::synchronize();
    Trainer u(3, true, d);
    ck::TrainingState st = u.state(0);
    const std::string msg = load_error(dir / "ckpt", st);
    EXPECT_NE(msg.find("checksum mismatch in rank-0000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("partly overwritten: load a good checkpoint before training on"), std::string::npos) << msg;
  });
}
