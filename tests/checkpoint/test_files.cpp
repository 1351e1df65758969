// Files on disk, single process: consolidated tensor files (.safetensors / .pt) round trips, the atomic directory
// commit and crash recovery, and the sharded reader's detection of missing, truncated and corrupted files.
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/shard_writer_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/core/error.h"
#include "error_of.h"

using namespace bmt::checkpoint;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/bmt_ckpt_unit_XXXXXX";
  return mkdtemp(tmpl);
}

using bmt::testing::error_of;

std::vector<std::pair<std::string, at::Tensor>> sample_tensors() {
  return {{"w", at::arange(12, at::kFloat).reshape({3, 4}) * 0.25 - 1},
          {"half", at::arange(5, at::kFloat).to(at::kHalf)},
          {"bf", (at::arange(7, at::kFloat) * 1.5).to(at::kBFloat16)},
          {"i64", at::arange(3, at::kLong) - (int64_t{1} << 40)},
          {"flag", at::tensor({1, 0, 1}).to(at::kBool)},
          {"scalar", at::tensor(3.5, at::kDouble)},
          {"empty", at::zeros({0, 3})},
          {"bytes", at::arange(200, at::kInt).to(at::kByte)}};
}

void write_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& ts) {
  std::vector<TensorInfo> infos;
  for (auto& kv : ts) infos.push_back({kv.first, dtype_name(kv.second.scalar_type()), kv.second.sizes().vec()});
  auto w = create_tensor_file(path, infos, {{"format", "pt"}});
  for (auto& kv : ts) {
    at::Tensor c = kv.second.contiguous();
    // In uneven pieces, as a distributed writer would.
    const char* p = static_cast<const char*>(c.data_ptr());
    int64_t n = static_cast<int64_t>(c.nbytes()), pos = 0;
    while (pos < n) {
      int64_t take = std::min<int64_t>(n - pos, 3);
      w->append(p + pos, take);
      pos += take;
    }
  }
  w->commit();
}

// A one-entry, one-rank checkpoint directory built with the low-level pieces (no communicator).
void write_checkpoint_dir(const std::string& dir, float value, int64_t created_ms) {
  make_directory(dir);
  at::Tensor t = at::full({1000}, value);
  std::vector<WriteItem> items{{0, t, 0, 1000}};
  CheckpointMetadata m;
  m.files = {write_shard_file(join_path(dir, shard_file_name(0)), shard_file_name(0), items, 4000, 1024)};
  m.checksum_block_nbytes = 1024;
  m.step = static_cast<int64_t>(value);
  m.created_unix_ms = created_ms;
  m.entries = {{"model/w", "F32", {1000}, {{"role", "model"}}, {{0, 0, 0, 1000}}}};
  write_file_durable(join_path(dir, kMetadataFileName), serialize_metadata(m));
}

float value_of(const std::string& dir) {
  CheckpointReader r(dir);
  at::Tensor t = r.read_full(*r.find("model/w"));
  EXPECT_TRUE(at::equal(t, at::full({1000}, t[0].item<float>())));
  return t[0].item<float>();
}

}  // namespace

TEST(TensorFile, RoundTripBothFormats) {
  const std::string dir = temp_dir();
  auto ts = sample_tensors();
  for (const char* name : {"a.safetensors", "a.pt"}) {
    const std::string path = join_path(dir, name);
    write_tensors(path, ts);
    auto r = open_tensor_file(path);
    ASSERT_EQ(r->tensors().size(), ts.size()) << name;
    for (size_t i = 0; i < ts.size(); ++i) {
      const TensorInfo& info = r->tensors()[i];
      EXPECT_EQ(info.name, ts[i].first);
      EXPECT_EQ(info.shape, ts[i].second.sizes().vec());
      at::Tensor back = at::empty(info.shape, at::TensorOptions().dtype(scalar_type_of(info.dtype)));
      r->read(i, 0, static_cast<int64_t>(back.nbytes()), back.data_ptr());
      EXPECT_TRUE(at::equal(back, ts[i].second)) << name << " " << info.name;
      r->release(i);
    }
    EXPECT_EQ(list_directory(dir).size(), name[2] == 's' ? 1u : 2u) << "temporary file left behind";
  }
  // The .pt file is also what torch's own loader understands.
  std::ifstream in(join_path(dir, "a.pt"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto dict = torch::pickle_load(bytes).toGenericDict();
  EXPECT_TRUE(at::equal(dict.at("w").toTensor(), ts[0].second));
  EXPECT_TRUE(at::equal(dict.at("bf").toTensor(), ts[2].second));
  remove_tree(dir);
}

TEST(TensorFile, UncommittedWriterLeavesTargetUntouched) {
  const std::string dir = temp_dir();
  for (const char* name : {"b.safetensors", "b.pt"}) {
    const std::string path = join_path(dir, name);
    write_file_durable(path, "previous");
    {
      auto w = create_tensor_file(path, {{"x", "F32", {4}}});
      float v[2] = {1, 2};
      w->append(v, sizeof v);
    }  // destroyed without commit
    EXPECT_EQ(read_file(path, 100), "previous");
  }
  EXPECT_EQ(list_directory(dir).size(), 2u);
  // Any other extension is torch.save's format (BMTrain's save writes torch.save whatever the name).
  EXPECT_EQ(tensor_file_format(join_path(dir, "c.ckpt")), TensorFileFormat::kTorchPickle);
  EXPECT_EQ(tensor_file_format(join_path(dir, "c.bin")), TensorFileFormat::kTorchPickle);
  EXPECT_EQ(tensor_file_format(join_path(dir, "c.pt")), TensorFileFormat::kTorchPickle);
  EXPECT_EQ(tensor_file_format(join_path(dir, "c.safetensors")), TensorFileFormat::kSafetensors);
  EXPECT_NE(error_of([&] { open_tensor_file(join_path(dir, "nope.pt")); }).find("no such file"), std::string::npos);
  write_file_durable(join_path(dir, "junk.safetensors"), "short");
  EXPECT_NE(error_of([&] { open_tensor_file(join_path(dir, "junk.safetensors")); }).find("not a safetensors file"),
            std::string::npos);
  write_file_durable(join_path(dir, "junk.pt"), "definitely not a zip");
  EXPECT_NE(error_of([&] { open_tensor_file(join_path(dir, "junk.pt")); }).find("junk.pt"), std::string::npos);
  remove_tree(dir);
}

// In a death test's child: writes `tensors` to `path` with writes past `limit` bytes failing (EFBIG), and exits 0
// when that raised a bmt error naming the file and the file-size limit (the message goes to stderr).
[[noreturn]] static void write_under_file_size_limit(const std::string& path, int64_t limit,
                                                     const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim {};
  lim.rlim_cur = static_cast<rlim_t>(limit);
  lim.rlim_max = RLIM_INFINITY;
  if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) std::_Exit(3);
  const std::string err = error_of([&] { write_tensors(path, tensors); });
  std::fprintf(stderr, "%s\n", err.c_str());
  const bool names_file = err.find(path) != std::string::npos;
  std::_Exit(names_file && err.find("ulimit -f") != std::string::npos ? 0 : 1);
}

// A full disk while writing a .pt file (simulated with a file-size limit: EFBIG, SIGXFSZ ignored as train_gpt and
// Python do): a clean error naming the path, no temporary file left, the previous file intact. torch's zip writer
// used to throw from its destructor here ("unexpected pos"), which ended the process with SIGABRT; so each case
// runs in a child process (a death test's fork) that must exit normally. Limits: 600 bytes (fails while the
// archive or the header starts), 64 KiB (fails inside a tensor's record), and 100 bytes short of the whole file (fails while
// the archive's central directory is written, in commit()).
TEST(TensorFile, FullDiskWhileWritingIsACleanErrorWithoutTemporaryFile) {
  const std::string dir = temp_dir();
  const at::Tensor big = at::arange(1 << 18, at::kFloat);  // 1 MiB
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {{"small", at::ones({3})}, {"big", big}};
  for (const char* name : {"whole.pt", "whole.safetensors"}) write_tensors(join_path(dir, name), tensors);
  for (const char* ext : {".pt", ".safetensors"}) {
    const int64_t whole = InFile(join_path(dir, std::string("whole") + ext)).size_nbytes();
    // (Not 0 bytes: the death test's own capture of the child's stderr is a file under the same limit.)
    for (const int64_t limit : {int64_t{600}, int64_t{64} << 10, whole - 100}) {
      const std::string path = join_path(dir, "target" + std::string(ext));
      write_file_durable(path, "previous");
      EXPECT_EXIT(write_under_file_size_limit(path, limit, tensors), ::testing::ExitedWithCode(0), "File too large")
          << ext << " with a " << limit << "-byte limit";
      EXPECT_EQ(read_file(path, 100), "previous") << ext << " limit " << limit;
      EXPECT_EQ(list_directory(dir), (std::vector<std::string>{"target" + std::string(ext), "whole.pt",
                                                                "whole.safetensors"}))
          << "a temporary file was left (" << ext << ", limit " << limit << ")";
      ::unlink(path.c_str());
    }
  }
  remove_tree(dir);
}

TEST(AtomicDir, CommitReplaceAndRecoverFromCrashWindow) {
  const std::string root = temp_dir(), ckpt = join_path(root, "ckpt");
  for (bool exchange : {true, false}) {
    std::string t1 = make_temp_dir(ckpt);
    remove_tree(t1);
    write_checkpoint_dir(t1, 1, 100);
    commit_directory(t1, ckpt, exchange);
    EXPECT_EQ(value_of(ckpt), 1);
    std::string t2 = make_temp_dir(ckpt);
    remove_tree(t2);
    write_checkpoint_dir(t2, 2, 200);
    commit_directory(t2, ckpt, exchange);
    EXPECT_EQ(value_of(ckpt), 2);
    EXPECT_EQ(list_directory(root), std::vector<std::string>{"ckpt"}) << "leftovers after commit";
    remove_tree(ckpt);
  }
  // The state a crash between "rename old away" and "rename new in" leaves: no ckpt, old + complete new.
  write_checkpoint_dir(ckpt + ".old-1", 1, 100);
  write_checkpoint_dir(ckpt + ".tmp-2", 2, 200);
  make_directory(ckpt + ".tmp-3");  // an unfinished save: no metadata
  EXPECT_EQ(resolve_checkpoint_dir(ckpt), ckpt + ".tmp-2");
  EXPECT_EQ(value_of(ckpt), 2);
  repair_and_clean(ckpt);
  EXPECT_EQ(list_directory(root), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(value_of(ckpt), 2);
  remove_tree(ckpt);
  EXPECT_NE(error_of([&] { resolve_checkpoint_dir(ckpt); }).find("no such directory"), std::string::npos);
  make_directory(ckpt);
  EXPECT_NE(error_of([&] { resolve_checkpoint_dir(ckpt); }).find("unfinished save"), std::string::npos);
  remove_tree(root);
}

TEST(CheckpointReader, DetectsMissingTruncatedAndCorruptedFiles) {
  const std::string root = temp_dir(), ckpt = join_path(root, "ckpt");
  write_checkpoint_dir(ckpt, 5, 1);
  const std::string shard = join_path(ckpt, shard_file_name(0));
  {
    CheckpointReader r(ckpt);
    EXPECT_TRUE(r.verify_all().empty());
    at::Tensor part = r.read(*r.find("model/w"), 500, 510);
    EXPECT_TRUE(at::equal(part, at::full({10}, 5.0f)));
  }
  // Flip one byte in the second checksum block.
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1500);
    f.put('\x7f');
  }
  {
    CheckpointReader r(ckpt);
    EXPECT_NO_THROW(r.read(*r.find("model/w"), 0, 200));  // block 0 is intact
    std::string e = error_of([&] { r.read(*r.find("model/w"), 300, 400); });
    EXPECT_NE(e.find("checksum mismatch in rank-00000.bin"), std::string::npos) << e;
    EXPECT_EQ(r.verify_all().size(), 2u);  // the block and the whole file
  }
  // Truncated and missing shard files.
  write_file_durable(shard, std::string(100, '\0'));
  std::string e = error_of([&] { CheckpointReader r(ckpt); });
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  remove_tree(shard);
  e = error_of([&] { CheckpointReader r(ckpt); });
  EXPECT_NE(e.find("missing shard file"), std::string::npos) << e;
  remove_tree(root);
}
