// Torch-free checkpoint formats: CRC-32, JSON, safetensors header, sharded metadata, slice planning.
// Every parser error case checks that the message names the problem.
#include <gtest/gtest.h>

#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/json_internal.h"
#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/pt_pickle_internal.h"
#include "bmt/checkpoint/safetensors_format_internal.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/core/error.h"
#include "error_of.h"

using namespace bmt::checkpoint;

namespace {

using bmt::testing::error_of;

#define EXPECT_ERROR_HAS(stmt, text) EXPECT_NE(error_of([&] { stmt; }).find(text), std::string::npos) << error_of([&] { stmt; })

}  // namespace

TEST(Crc32, KnownValueAndStreaming) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32(s.data(), s.size()), 0xCBF43926u);
  EXPECT_EQ(crc32_hex(0xCBF43926u), "cbf43926");
  std::string big(100003, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
  uint32_t c = 0;
  for (size_t pos = 0; pos < big.size(); pos += 997) c = crc32_update(c, big.data() + pos, std::min<size_t>(997, big.size() - pos));
  EXPECT_EQ(c, crc32(big.data(), big.size()));
  EXPECT_EQ(crc32(nullptr, 0), 0u);
}

TEST(Crc32, CombineEqualsTheChecksumOfTheConcatenation) {
  EXPECT_EQ(crc32_combine(crc32("12345", 5), crc32("6789", 4), 4), 0xCBF43926u);
  std::string big(70001, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 29 + (i >> 7));
  for (size_t split : {size_t{0}, size_t{1}, size_t{4096}, size_t{65536}, big.size() - 1, big.size()}) {
    const uint32_t a = crc32(big.data(), split), b = crc32(big.data() + split, big.size() - split);
    EXPECT_EQ(crc32_combine(a, b, static_cast<int64_t>(big.size() - split)), crc32(big.data(), big.size()))
        << "split at " << split;
  }
}

TEST(Json, RoundTripAndExactIntegers) {
  const std::string text = R"({"a":[1,-2,4611686018427387904,-9223372036854775808,1.5,true,false,null],"b":{"c":"x\"y\\z\n\u00e9\ud83d\ude00"}})";
  Json j = Json::parse(text, "t");
  EXPECT_EQ(j.at("a", "t").as_array("a")[2].as_int("a2"), int64_t{1} << 62);
  EXPECT_EQ(j.at("a", "t").as_array("a")[3].as_int("a3"), INT64_MIN);
  EXPECT_EQ(j.at("b", "t").at("c", "b").as_string("c"), "x\"y\\z\n\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(Json::parse(j.dump(), "again").dump(), j.dump());
  EXPECT_FALSE(Json::parse("18446744073709551616", "big").is_int());  // past int64: a double
}

TEST(Json, RejectsMalformedInput) {
  EXPECT_ERROR_HAS(Json::parse(R"({"a":1,"a":2})", "dup"), "duplicate key");
  EXPECT_ERROR_HAS(Json::parse(std::string(200, '[') + std::string(200, ']'), "deep"), "nesting deeper");
  EXPECT_ERROR_HAS(Json::parse("{} x", "trail"), "trailing");
  EXPECT_ERROR_HAS(Json::parse(R"("\q")", "esc"), "invalid escape");
  EXPECT_ERROR_HAS(Json::parse(R"("\ud800")", "sur"), "surrogate");
  EXPECT_ERROR_HAS(Json::parse("\"abc", "unterminated"), "unterminated");
  EXPECT_ERROR_HAS(Json::parse("-", "num"), "without digits");
  EXPECT_ERROR_HAS(Json::parse("", "empty"), "unexpected end");
  EXPECT_ERROR_HAS(Json::parse("[1,]", "comma"), "unexpected character");
  EXPECT_ERROR_HAS(Json::parse("{\"a\":1}", "typed").at("a", "ctx").as_string("ctx.a"), "ctx.a: expected a string");
}

TEST(SafetensorsHeader, BuildParseRoundTrip) {
  std::vector<TensorInfo> t = {{"w", "F32", {2, 3}}, {"b", "BF16", {3}}, {"s", "I64", {}}, {"e", "U8", {0, 4}}};
  std::string h = build_safetensors_header(t, {{"format", "pt"}});
  EXPECT_EQ((h.size() - 8) % 8, 0u);
  const int64_t data = 24 + 6 + 8 + 0;
  std::string file = h + std::string(static_cast<size_t>(data), '\0');
  SafetensorsHeader p = parse_safetensors_prefix(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                                 static_cast<int64_t>(file.size()), "f");
  ASSERT_EQ(p.tensors.size(), 4u);
  EXPECT_EQ(p.tensors[0].name, "w");
  EXPECT_EQ(p.tensors[1].shape, std::vector<int64_t>{3});
  EXPECT_EQ(p.data_offsets[2], 30);
  EXPECT_EQ(p.metadata.at("format"), "pt");
  EXPECT_EQ(p.data_start_nbytes, static_cast<int64_t>(h.size()));
}

TEST(SafetensorsHeader, RejectsInconsistentHeaders) {
  auto parse = [](const std::string& json, int64_t data_nbytes) {
    std::string file(8, '\0');
    uint64_t n = json.size();
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
    file += json + std::string(static_cast<size_t>(data_nbytes), '\0');
    return parse_safetensors_prefix(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                    static_cast<int64_t>(file.size()), "x.safetensors");
  };
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "outside");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4), "needs 8 bytes");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})", 8),
                   "overlapping or non-contiguous");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8), "trailing garbage");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", 4), "unknown dtype");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "negative dimension");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4), "overflows");
  EXPECT_ERROR_HAS(parse(R"({"a":{"dtype":"F32","shape":[1]}})", 4), "data_offsets");
  EXPECT_ERROR_HAS(parse(R"({"__metadata__":{"k":1}})", 0), "expected a string");
  std::string huge(8, '\xff');
  EXPECT_ERROR_HAS(parse_safetensors_prefix(reinterpret_cast<const uint8_t*>(huge.data()), 8, 8, "h"), "larger than the limit");
  std::string shorter(8, '\0');
  shorter[0] = 100;
  EXPECT_ERROR_HAS(parse_safetensors_prefix(reinterpret_cast<const uint8_t*>(shorter.data()), 8, 8, "s"), "past the end");
}

namespace {
CheckpointMetadata sample_metadata() {
  CheckpointMetadata m;
  m.world_size = 2;
  m.step = 42;
  m.created_by = "test";
  m.created_unix_ms = 1234;
  m.user_metadata = {{"run", "a b"}};
  m.checksum_block_nbytes = 16;
  m.files = {{"rank-00000.bin", 40, 7, {1, 2, 3}}, {"rank-00001.bin", 0, 0, {}}};
  m.entries = {{"model/w", "F32", {2, 5}, {{"role", "model"}}, {{0, 0, 0, 6}, {0, 24, 6, 10}}}};
  return m;
}
}  // namespace

TEST(Metadata, RoundTrip) {
  CheckpointMetadata m = sample_metadata();
  CheckpointMetadata p = parse_metadata(serialize_metadata(m), "meta");
  EXPECT_EQ(p.step, 42);
  EXPECT_EQ(p.user_metadata.at("run"), "a b");
  ASSERT_EQ(p.entries.size(), 1u);
  EXPECT_EQ(p.entries[0].pieces[1].byte_offset, 24);
  EXPECT_EQ(p.files[0].block_crc32, (std::vector<uint32_t>{1, 2, 3}));
  EXPECT_EQ(serialize_metadata(p), serialize_metadata(m));
}

TEST(Metadata, ClearErrors) {
  const std::string good = serialize_metadata(sample_metadata());
  std::string v2 = good;
  v2.replace(0, 9, "BMTCKPT 2");
  EXPECT_ERROR_HAS(parse_metadata(v2, "meta"), "unknown checkpoint format version 2");
  std::string flipped = good;
  flipped[flipped.size() - 5] ^= 1;
  EXPECT_ERROR_HAS(parse_metadata(flipped, "meta"), "checksum mismatch");
  EXPECT_ERROR_HAS(parse_metadata(good.substr(0, good.size() - 3), "meta"), "truncated");
  EXPECT_ERROR_HAS(parse_metadata("hello\n{}", "meta"), "not a bmtrain checkpoint");
  CheckpointMetadata bad = sample_metadata();
  bad.entries[0].pieces[1].elem_begin = 5;  // overlaps the first piece
  EXPECT_ERROR_HAS(parse_metadata(serialize_metadata(bad), "meta"), "overlaps");
  bad = sample_metadata();
  bad.entries[0].pieces[1].byte_offset = 30;  // 16 bytes at 30 > 40
  EXPECT_ERROR_HAS(parse_metadata(serialize_metadata(bad), "meta"), "lies outside rank-00000.bin");
  bad = sample_metadata();
  bad.files[1].name = "../evil";
  EXPECT_ERROR_HAS(parse_metadata(serialize_metadata(bad), "meta"), "unsafe file name");
  bad = sample_metadata();
  bad.files[0].block_crc32.pop_back();
  EXPECT_ERROR_HAS(parse_metadata(serialize_metadata(bad), "meta"), "block checksums");
  bad = sample_metadata();
  bad.step = -5;  // checksum-valid (serialize computes it) but impossible
  EXPECT_ERROR_HAS(parse_metadata(serialize_metadata(bad), "meta"), "bad step -5");
}

TEST(SlicePlan, EachElementWrittenOnceByLowestHolder) {
  auto decl = [](const std::string& k, int64_t b, int64_t e) { return SliceDecl{k, "F32", {10}, {}, b, e}; };
  // Rank 0 and 1 both hold the replicated "r"; "s" is sharded 0..4, 4..8, 8..10 over 3 ranks, with rank 2 also
  // holding an overlapping copy [3, 10).
  std::vector<std::vector<SliceDecl>> per_rank = {
      {decl("r", 0, 10), decl("s", 0, 4)}, {decl("r", 0, 10), decl("s", 4, 8)}, {decl("s", 3, 10)}};
  auto plan = plan_pieces(per_rank);
  ASSERT_EQ(plan.size(), 2u);
  ASSERT_EQ(plan[0].pieces.size(), 1u);
  EXPECT_EQ(plan[0].pieces[0].rank, 0);
  ASSERT_EQ(plan[1].pieces.size(), 3u);
  EXPECT_EQ(plan[1].pieces[2].rank, 2);
  EXPECT_EQ(plan[1].pieces[2].begin, 8);
  FileLayout layout = layout_shard_files(plan, 3);
  EXPECT_EQ(layout.file_nbytes[0], 64 + 16);  // r (40 bytes) padded to 64, then s[0,4)
  EXPECT_EQ(layout.entries[1].pieces[2].byte_offset, 0);
  EXPECT_EQ(decode_decls(encode_decls(per_rank[0]))[1].end, 4);
  per_rank[1][0].shape = {11};
  EXPECT_ERROR_HAS(plan_pieces(per_rank), "ranks disagree");
}

template <size_t N>
std::string bin(const char (&s)[N]) {
  return std::string(s, N - 1);  // keeps embedded NUL bytes
}

TEST(TorchPickle, ExecutesNothingAndRejectsMalformedInput) {
  // {"a": os.system("ls")}: never called, reported as a non-tensor value.
  const std::string evil = bin("\x80\x02}(X\x01\x00\x00\x00" "a" "cos\nsystem\n" "X\x02\x00\x00\x00" "ls" "\x85R" "u.");
  EXPECT_ERROR_HAS(parse_torch_pickle(evil, "evil.pt"), "value of \"a\" is not a tensor (os.system)");
  EXPECT_ERROR_HAS(parse_torch_pickle(evil.substr(0, 8), "cut.pt"), "unexpected end");
  EXPECT_ERROR_HAS(parse_torch_pickle("\x80\x02\xff", "op.pt"), "unsupported pickle opcode 0xff");
  EXPECT_ERROR_HAS(parse_torch_pickle(bin("\x80\x02h\x05."), "memo.pt"), "never stored");
  // A list appended to itself through the memo (a cycle) must neither leak nor recurse.
  EXPECT_ERROR_HAS(parse_torch_pickle(bin("]q\x00h\x00" "a."), "cycle.pt"), "expected a dict");
}
