// Data loaders (examples/data): synthetic arithmetic determinism, held-out split and task format; byte-level
// text windows; uint16 token files in llm.c and nanoGPT layouts, including bad magic / size errors.
// Also the small formats next to them: metrics JSON lines, safetensors headers, train_gpt options.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bmt/core/error.h"
#include "data/file_dataset.h"
#include "data/synthetic_addition.h"
#include "error_of.h"
#include "export/safetensors.h"
#include "train/metrics_log.h"
#include "train/train_args.h"

namespace fs = std::filesystem;

namespace {

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("bmt_examples_" + std::to_string(::getpid()) + "_" + name)).string();
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint8_t> le_u16(const std::vector<uint16_t>& tokens) {
  std::vector<uint8_t> out;
  for (uint16_t t : tokens) out.push_back(static_cast<uint8_t>(t)), out.push_back(static_cast<uint8_t>(t >> 8));
  return out;
}

std::vector<uint8_t> llmc_file(const std::vector<uint16_t>& tokens, int32_t magic = 20240520, int32_t version = 1,
                               int32_t count = -1) {
  std::vector<uint8_t> out(1024, 0);
  const int32_t header[3] = {magic, version, count < 0 ? static_cast<int32_t>(tokens.size()) : count};
  std::memcpy(out.data(), header, sizeof header);  // little-endian host
  auto body = le_u16(tokens);
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

using bmt::testing::error_of;

}  // namespace

TEST(SyntheticData, DeterministicPerStepAndRank) {
  examples::SyntheticAddition a(42), b(42), c(43);
  EXPECT_TRUE(at::equal(a.train_batch(5, 1, 4, 30), b.train_batch(5, 1, 4, 30)));
  EXPECT_FALSE(at::equal(a.train_batch(5, 1, 4, 30), a.train_batch(5, 0, 4, 30))) << "ranks must differ";
  EXPECT_FALSE(at::equal(a.train_batch(5, 1, 4, 30), a.train_batch(6, 1, 4, 30))) << "steps must differ";
  EXPECT_FALSE(at::equal(a.train_batch(5, 1, 4, 30), c.train_batch(5, 1, 4, 30))) << "seeds must differ";
  EXPECT_TRUE(at::equal(a.eval_batch(2, 3, 30), c.eval_batch(2, 3, 30))) << "the held-out set ignores the seed";
  at::Tensor t = a.train_batch(0, 0, 2, 40);
  EXPECT_EQ(t.sizes(), at::IntArrayRef({2, 41}));
  EXPECT_GE(t.min().item<int64_t>(), 0);
  EXPECT_LT(t.max().item<int64_t>(), a.vocab_size());
}

TEST(SyntheticData, ExamplesHeldOutSplitAndTask) {
  examples::SyntheticAddition d(1);
  EXPECT_EQ(d.decode(d.example(7, 45)), "07+45=250;");  // 52 with the least significant digit first
  examples::SyntheticAddition plain(1, 3, false);
  EXPECT_EQ(plain.decode(plain.example(999, 1)), "999+001=1000;");
  EXPECT_EQ(d.decode(d.encode("12+34=640;")), "12+34=640;");
  EXPECT_THROW(d.encode("1 + 2"), bmt::core::Error);
  // Training rows never contain a held-out pair; eval rows only held-out pairs.
  auto pairs_in = [&](const at::Tensor& rows) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t r = 0; r < rows.size(0); ++r) {
      auto ids = std::vector<int64_t>(rows[r].data_ptr<int64_t>(), rows[r].data_ptr<int64_t>() + rows.size(1));
      std::string s = d.decode(ids);
      for (size_t p = 0; p + 10 <= s.size(); p += 10) out.emplace_back(std::stoi(s.substr(p, 2)), std::stoi(s.substr(p + 3, 2)));
    }
    return out;
  };
  for (auto [a, b] : pairs_in(d.train_batch(3, 0, 64, 99))) EXPECT_FALSE(d.is_held_out(a, b)) << a << "+" << b;
  for (auto [a, b] : pairs_in(d.eval_batch(0, 16, 99))) EXPECT_TRUE(d.is_held_out(a, b)) << a << "+" << b;
  auto task = d.task_batch(8);
  ASSERT_TRUE(task.has_value());
  EXPECT_EQ(task->tokens.sizes(), at::IntArrayRef({8, 10}));
  EXPECT_EQ(task->answer_begin, 6);
  EXPECT_EQ(task->answer_len, 3);
  EXPECT_EQ(d.sample_prompts().size(), 4u);
  EXPECT_EQ(d.annotate("07+45=", "250;"), "(sum 052, correct)");
  EXPECT_EQ(d.annotate("07+45=", "150;"), "(sum 052, model says 051)");
}

TEST(FileData, ByteLevelText) {
  const std::string path = temp_path("text.txt");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
  examples::FileDataset d(examples::open_byte_file(path), 3, 0.1);
  EXPECT_EQ(d.vocab_size(), 256);
  EXPECT_EQ(d.train_tokens() + d.eval_tokens(), static_cast<int64_t>(text.size()));
  at::Tensor rows = d.train_batch(0, 0, 4, 16);
  for (int64_t r = 0; r < 4; ++r) {
    std::vector<int64_t> ids(rows[r].data_ptr<int64_t>(), rows[r].data_ptr<int64_t>() + 17);
    std::string window = d.decode(ids);
    EXPECT_NE(text.find(window), std::string::npos) << "row is not a window of the file: " << window;
    EXPECT_LE(text.find(window) + 17, static_cast<size_t>(d.train_tokens()));
  }
  at::Tensor ev = d.eval_batch(0, 2, 16);
  std::vector<int64_t> ids(ev[0].data_ptr<int64_t>(), ev[0].data_ptr<int64_t>() + 17);
  EXPECT_GE(text.rfind(d.decode(ids)), static_cast<size_t>(d.train_tokens())) << "eval rows come from the tail";
  EXPECT_TRUE(at::equal(d.train_batch(9, 1, 4, 16), d.train_batch(9, 1, 4, 16)));
  EXPECT_FALSE(at::equal(d.train_batch(9, 1, 4, 16), d.train_batch(9, 0, 4, 16)));
  EXPECT_EQ(d.encode("ab"), (std::vector<int64_t>{97, 98}));
  EXPECT_THROW(d.train_batch(0, 0, 1, 100000), bmt::core::Error);
  fs::remove(path);
}

TEST(FileData, TokenBinBothLayouts) {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 500; ++i) tokens.push_back(static_cast<uint16_t>((i * 7919) % 50257));
  const std::string llmc = temp_path("llmc.bin"), raw = temp_path("nanogpt.bin");
  write_bytes(llmc, llmc_file(tokens));
  write_bytes(raw, le_u16(tokens));
  auto a = examples::open_token_bin(llmc), b = examples::open_token_bin(raw);
  EXPECT_EQ(a.layout, "llm.c");
  EXPECT_EQ(b.layout, "nanoGPT");
  ASSERT_EQ(a.num_tokens, 500);
  ASSERT_EQ(b.num_tokens, 500);
  for (int64_t i = 0; i < 500; ++i) {
    ASSERT_EQ(a.token(i), tokens[static_cast<size_t>(i)]);
    ASSERT_EQ(b.token(i), tokens[static_cast<size_t>(i)]);
  }
  examples::FileDataset da(a, 1, 0.1), db(b, 1, 0.1);
  EXPECT_EQ(da.vocab_size(), 50304);
  EXPECT_TRUE(at::equal(da.train_batch(4, 1, 3, 20), db.train_batch(4, 1, 3, 20))) << "same tokens, same batches";
  EXPECT_EQ(da.decode({1, 2}), "[1 2]");
  EXPECT_EQ(da.encode("[1 2]"), (std::vector<int64_t>{1, 2}));
  // Token ids beyond GPT-2's vocabulary grow the vocabulary to a multiple of 64.
  write_bytes(raw, le_u16({1, 2, 60000, 3}));
  EXPECT_EQ(examples::FileDataset(examples::open_token_bin(raw), 1, 0.5).vocab_size(), 60032);
  fs::remove(llmc);
  fs::remove(raw);
}

TEST(FileData, TokenBinErrors) {
  const std::string path = temp_path("bad.bin");
  std::vector<uint16_t> tokens(100, 5);
  write_bytes(path, le_u16(tokens));  // a raw file forced through the llm.c reader
  EXPECT_NE(error_of([&] { examples::open_token_bin(path, "llm.c"); }).find("bad magic"), std::string::npos);
  write_bytes(path, llmc_file(tokens, 20240326));  // an llm.c model checkpoint, not tokens
  std::string msg = error_of([&] { examples::open_token_bin(path); });
  EXPECT_NE(msg.find("bad magic 20240326"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << "errors name the file: " << msg;
  write_bytes(path, llmc_file(tokens, 20240520, 2));
  EXPECT_NE(error_of([&] { examples::open_token_bin(path); }).find("version 2"), std::string::npos);
  write_bytes(path, llmc_file(tokens, 20240520, 1, 99));
  EXPECT_NE(error_of([&] { examples::open_token_bin(path); }).find("header says 99 tokens"), std::string::npos);
  write_bytes(path, {1, 2, 3});
  EXPECT_NE(error_of([&] { examples::open_token_bin(path); }).find("whole number of uint16"), std::string::npos);
  fs::remove(path);
  EXPECT_NE(error_of([&] { examples::open_token_bin(path); }).find("cannot open"), std::string::npos);
  EXPECT_NE(error_of([&] { examples::open_token_bin(path, "gguf"); }).find("layout must be"), std::string::npos);
}

TEST(SmallFormats, MetricsJsonLine) {
  examples::MetricFields f = {{"step", 3.0}, {"loss", 1.25}, {"eval_loss", std::nullopt}, {"x", std::nan("")}};
  EXPECT_EQ(examples::to_json_line(f), R"({"step": 3, "loss": 1.25, "eval_loss": null, "x": null})");
}

TEST(SmallFormats, SafetensorsHeaderAndFile) {
  examples::NamedTensors t = {{"a", at::arange(6, at::kFloat).reshape({2, 3})}, {"b\"q", at::ones({4}, at::kBFloat16)}};
  EXPECT_EQ(examples::safetensors_header(t, {{"format", "pt"}}),
            R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
            R"("b\"q":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]}})");
  const std::string path = temp_path("t.safetensors");
  examples::write_safetensors(path, t);
  std::ifstream f(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 32);
  float third;
  std::memcpy(&third, &bytes[8 + n + 8], 4);
  EXPECT_EQ(third, 2.0f);
  EXPECT_THROW(examples::write_safetensors(path, {{"a", at::ones({1})}, {"a", at::ones({1})}}), bmt::core::Error);
  fs::remove(path);
}

TEST(SmallFormats, TrainArgs) {
  const char* argv[] = {"train_gpt", "--steps", "10", "--lr=0.01", "--checkpointing", "--zero", "2", "--model", "llama",
                        "--tp", "2"};
  auto a = examples::parse_train_args(11, argv);
  EXPECT_EQ(a.tp, 2);
  EXPECT_EQ(a.steps, 10);
  EXPECT_DOUBLE_EQ(a.lr, 0.01);
  EXPECT_TRUE(a.checkpointing);
  EXPECT_EQ(a.zero, 2);
  EXPECT_EQ(a.model, "llama");
  const char* bad1[] = {"train_gpt", "--zero", "1"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(3, bad1); }).find("--zero"), std::string::npos);
  const char* bad2[] = {"train_gpt", "--steps", "ten"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(3, bad2); }).find("expected an integer"), std::string::npos);
  const char* bad3[] = {"train_gpt", "--stpes", "1"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(3, bad3); }).find("unknown option '--stpes'"), std::string::npos);
  const char* bad5[] = {"train_gpt", "--tp", "0"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(3, bad5); }).find("--tp must be >= 1"), std::string::npos);
  const char* bad4[] = {"train_gpt", "--steps"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(2, bad4); }).find("needs a value"), std::string::npos);
  const char* graphs[] = {"train_gpt", "--cuda-graphs"};
  EXPECT_TRUE(examples::parse_train_args(2, graphs).cuda_graphs);
  EXPECT_FALSE(a.cuda_graphs);
  const char* no_graphs[] = {"train_gpt", "--no-cuda-graphs"};
  EXPECT_TRUE(examples::parse_train_args(2, no_graphs).no_cuda_graphs);
  EXPECT_FALSE(a.no_cuda_graphs);
  const char* both[] = {"train_gpt", "--cuda-graphs", "--no-cuda-graphs"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(3, both); }).find("contradict"), std::string::npos);
  const char* bad6[] = {"train_gpt", "--cuda-graphs", "--pp", "2"};
  EXPECT_NE(error_of([&] { examples::parse_train_args(4, bad6); }).find("--cuda-graphs cannot be combined with --pp"),
            std::string::npos);
}
