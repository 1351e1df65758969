// The .pt reader bmt::load uses (open_tensor_file) against damaged files, deterministically (the libFuzzer target
// tests/fuzz/fuzz_pt_reader.cpp explores further where clang's libFuzzer exists): every truncation, every byte
// flipped (all bits, and the lowest bit), and seeded random overwrites of real small .pt files — written by
// Python's torch.save (the fuzzer's seeds, tests/fuzz/seeds_pt) and by our own writer. Each damaged file must
// either load exactly the original tensors or raise bmt::core::Error (never an InternalError, a torch exception
// or a crash): the zip's CRC-32s are checked, so no flipped byte can change what is loaded.
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <fstream>
#include <random>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/zip_directory_internal.h"
#include "bmt/core/error.h"

using namespace bmt::checkpoint;

namespace {

struct Loaded {
  std::vector<std::string> names, dtypes;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::string> bytes;
  bool operator==(const Loaded& o) const {
    return names == o.names && dtypes == o.dtypes && shapes == o.shapes && bytes == o.bytes;
  }
};

// Opens `path` and reads every tensor in two uneven pieces, as bmt::load reads chunk by chunk.
Loaded load_all(const std::string& path) {
  auto r = open_tensor_file(path);
  Loaded out;
  for (size_t i = 0; i < r->tensors().size(); ++i) {
    const TensorInfo& t = r->tensors()[i];
    const int64_t nbytes = checked_nbytes(t.dtype, t.shape, t.name);
    // Larger than any seed's tensor: only a damaged pickle could claim it, which its CRC must have caught.
    if (nbytes > (int64_t{1} << 20)) throw std::runtime_error("implausible tensor " + t.name + " loaded");
    std::string b(static_cast<size_t>(nbytes), '\0');
    const int64_t first = nbytes / 3;
    r->read(i, 0, first, b.data());
    r->read(i, first, nbytes - first, b.data() + first);
    r->release(i);
    out.names.push_back(t.name);
    out.dtypes.push_back(t.dtype);
    out.shapes.push_back(t.shape);
    out.bytes.push_back(std::move(b));
  }
  return out;
}

std::string read_bytes(const std::string& path) { return read_file(path, int64_t{1} << 20); }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

struct Tally {
  int identical = 0, errors = 0;
  std::vector<std::string> bad;  // the cases that broke the rule
};

// One damaged file: loads the original tensors or throws bmt::core::Error.
void check_case(const std::string& path, const std::string& bytes, const Loaded& ref, const std::string& label,
                Tally& tally) {
  write_bytes(path, bytes);
  std::string problem;
  try {
    if (load_all(path) == ref) {
      ++tally.identical;
      return;
    }
    problem = "loaded different tensors";
  } catch (const bmt::core::InternalError& e) {
    problem = std::string("InternalError: ") + e.what();
  } catch (const bmt::core::Error&) {
    ++tally.errors;
    return;
  } catch (const std::exception& e) {
    problem = std::string("not a bmt::core::Error: ") + e.what();
  }
  if (tally.bad.size() < 10) tally.bad.push_back(label + ": " + problem);
  else if (tally.bad.size() == 10) tally.bad.push_back("...");
}

std::string temp_dir() {
  char tmpl[] = "/tmp/bmt_pt_corruption_XXXXXX";
  return mkdtemp(tmpl);
}

// The seeds written by torch.save plus one file of our own writer, each with its name.
std::vector<std::pair<std::string, std::string>> seed_files(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& name : list_directory(BMT_PT_SEEDS_DIR))
    out.emplace_back(name, read_bytes(std::string(BMT_PT_SEEDS_DIR) + "/" + name));
  const std::string ours = dir + "/ours.pt";
  std::vector<std::pair<std::string, at::Tensor>> ts = {{"w", at::arange(6, at::kFloat).reshape({2, 3}) - 2.5},
                                                        {"bf", (at::arange(5, at::kFloat) * 0.5).to(at::kBFloat16)},
                                                        {"ids", at::arange(4, at::kLong) * 1000},
                                                        {"none", at::zeros({0})}};
  std::vector<TensorInfo> infos;
  for (auto& kv : ts) infos.push_back({kv.first, dtype_name(kv.second.scalar_type()), kv.second.sizes().vec()});
  auto w = create_tensor_file(ours, infos);
  for (auto& kv : ts) w->append(kv.second.data_ptr(), static_cast<int64_t>(kv.second.nbytes()));
  w->commit();
  out.emplace_back("ours.pt", read_bytes(ours));
  return out;
}

// The reference a damaged file must reproduce: the undamaged file as our reader loads it, which must be what
// torch's own loader (torch::pickle_load) reads from the same bytes.
Loaded reference(const std::string& path, const std::string& bytes, const std::string& name) {
  write_bytes(path, bytes);
  Loaded ref = load_all(path);
  EXPECT_FALSE(ref.names.empty()) << name;
  c10::IValue loaded;
  try {
    loaded = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  } catch (const c10::Error& e) {  // torch's C++ unpickler lacks some of Python's (test_python_interop covers them)
    std::printf("[pt corruption] torch::pickle_load cannot read %s: %s\n", name.c_str(), e.what_without_backtrace());
    return ref;
  }
  auto dict = loaded.toGenericDict();
  EXPECT_EQ(dict.size(), ref.names.size()) << name;
  for (size_t i = 0; i < ref.names.size(); ++i) {
    at::Tensor t = dict.at(ref.names[i]).toTensor().contiguous();
    EXPECT_EQ(dtype_name(t.scalar_type()), ref.dtypes[i]) << name << " " << ref.names[i];
    EXPECT_EQ(t.sizes().vec(), ref.shapes[i]) << name << " " << ref.names[i];
    EXPECT_EQ(std::string(static_cast<const char*>(t.data_ptr()), t.nbytes()), ref.bytes[i])
        << name << " " << ref.names[i];
  }
  return ref;
}

}  // namespace

TEST(PtCorruption, EveryTruncationFlipAndOverwriteLoadsTheOriginalOrRaisesABmtError) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/case.pt";
  const auto seeds = seed_files(dir);
  ASSERT_GE(seeds.size(), 4u) << "seed corpus " << BMT_PT_SEEDS_DIR;
  for (size_t s = 0; s < seeds.size(); ++s) {
    const auto& [name, original] = seeds[s];
    const Loaded ref = reference(path, original, name);
    Tally tally;
    for (size_t n = 0; n < original.size(); ++n)
      check_case(path, original.substr(0, n), ref, name + " truncated to " + std::to_string(n), tally);
    for (size_t at = 0; at < original.size(); ++at) {
      for (unsigned char mask : {0xFF, 0x01}) {
        std::string b = original;
        b[at] = static_cast<char>(static_cast<unsigned char>(b[at]) ^ mask);
        check_case(path, b, ref, name + " byte " + std::to_string(at) + " xor " + std::to_string(mask), tally);
      }
    }
    std::mt19937 rng(static_cast<uint32_t>(1234 + s));
    for (int k = 0; k < 300; ++k) {
      std::string b = original;
      const int writes = 1 + static_cast<int>(rng() % 8);
      for (int j = 0; j < writes; ++j) b[rng() % b.size()] = static_cast<char>(rng() & 0xFF);
      check_case(path, b, ref, name + " random overwrite " + std::to_string(k), tally);
    }
    std::string report;
    for (const std::string& b : tally.bad) report += "\n  " + b;
    EXPECT_TRUE(tally.bad.empty()) << name << ": " << report;
    // Both outcomes occur: most damage is caught, and bytes nothing reads (alignment padding, the central
    // directory's copies of the CRCs) may change harmlessly.
    EXPECT_GT(tally.errors, static_cast<int>(original.size())) << name;
    EXPECT_GT(tally.identical, 0) << name;
    std::printf("[pt corruption] %s (%zu bytes): %d cases loaded the original, %d raised bmt::core::Error\n",
                name.c_str(), original.size(), tally.identical, tally.errors);
  }
  remove_tree(dir);
}

TEST(PtCorruption, AFlippedDataByteIsReportedAsACrcMismatch) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/x.pt";
  std::vector<float> v(64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  {
    auto w = create_tensor_file(path, {{"x", "F32", {64}}});
    w->append(v.data(), static_cast<int64_t>(v.size() * sizeof(float)));
    w->commit();
  }
  std::string bytes = read_bytes(path);
  // The tensor's bytes are the only place the file holds this pattern.
  const std::string needle(reinterpret_cast<const char*>(v.data() + 10), 16);
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  bytes[at + 3] ^= 0x40;
  write_bytes(path, bytes);
  auto r = open_tensor_file(path);  // the index is intact
  std::vector<float> got(64);
  try {
    r->read(0, 0, 256, got.data());
    FAIL() << "a flipped data byte loaded silently";
  } catch (const bmt::core::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("x.pt: record data/0 fails its CRC-32 check"), std::string::npos) << msg;
    EXPECT_NE(msg.find("corrupted"), std::string::npos) << msg;
  }
  remove_tree(dir);
}

namespace {

// Offsets of the central directory entries (signature PK\1\2) in a zip's bytes, with each entry's name.
std::vector<std::pair<size_t, std::string>> directory_entries(const std::string& b) {
  std::vector<std::pair<size_t, std::string>> out;
  auto u16 = [&](size_t at) { return static_cast<size_t>(static_cast<uint8_t>(b[at]) | static_cast<uint8_t>(b[at + 1]) << 8); };
  for (size_t at = b.find("PK\x01\x02"); at != std::string::npos; at = b.find("PK\x01\x02", at + 4))
    out.emplace_back(at, b.substr(at + 46, u16(at + 28)));
  return out;
}

// Little-endian fields appended to a byte string.
struct Bytes {
  std::string b;
  Bytes& u(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b += static_cast<char>(v >> (8 * i) & 0xFF);
    return *this;
  }
  Bytes& s(const std::string& t) {
    b += t;
    return *this;
  }
};

}  // namespace

// torch's zip reader allocates a record's claimed uncompressed size before extracting it: a damaged directory
// entry must be refused by our own directory check first, naming the entry (the libFuzzer target found a 2 KiB
// file whose entry claimed 4 GiB - 1 through the zip64 marker).
TEST(PtCorruption, ADirectoryEntryClaimingMoreThanTheFileIsRefusedBeforeTorchAllocatesIt) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/x.pt";
  const auto seeds = seed_files(dir);
  for (const auto& [name, original] : seeds) {
    {
      write_bytes(path, original);
      bmt::checkpoint::InFile f(path);
      const auto entries = bmt::checkpoint::detail::read_zip_directory(f);
      const auto found = directory_entries(original);
      ASSERT_EQ(entries.size(), found.size()) << name;
      for (size_t i = 0; i < entries.size(); ++i) {
        EXPECT_EQ(entries[i].name, found[i].second) << name;
        EXPECT_EQ(entries[i].method, 0) << name << " " << entries[i].name;  // torch.save stores, never deflates
        EXPECT_EQ(entries[i].compressed_nbytes, entries[i].uncompressed_nbytes) << name << " " << entries[i].name;
        EXPECT_LE(entries[i].local_header_offset + 30 + entries[i].compressed_nbytes, f.size_nbytes()) << name;
      }
    }
    struct Damage {
      size_t field;  // offset inside the directory entry
      uint32_t value;
      const char* expect;
    };
    const Damage damages[] = {{24, 0xFFFFFFFFu, "zip64 size marker without a zip64 extra field"},
                              {24, 0x7FFFFFF0u, "the sizes disagree"},
                              {20, 0x7FFFFFF0u, "past the end of the"},
                              {42, 0x7FFFFFF0u, "past the end of the"}};
    for (const auto& [at, entry] : directory_entries(original)) {
      for (const Damage& d : damages) {
        std::string b = original;
        b.replace(at + d.field, 4, Bytes().u(d.value, 4).b);
        write_bytes(path, b);
        const std::string label = name + " entry " + entry + " field " + std::to_string(d.field);
        try {
          (void)open_tensor_file(path);
          ADD_FAILURE() << label << ": opened";
        } catch (const bmt::core::InternalError& e) {
          ADD_FAILURE() << label << ": InternalError " << e.what();
        } catch (const bmt::core::Error& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find(path + ": zip entry " + entry), std::string::npos) << label << ": " << msg;
          EXPECT_NE(msg.find(d.expect), std::string::npos) << label << ": " << msg;
        }
      }
    }
  }
  remove_tree(dir);
}

namespace {

// A one-entry archive in zip64 form (APPNOTE 4.3.14-4.3.16, 4.5.3): the entry's two sizes and its offset are the
// 0xFFFFFFFF marker in the central directory and 64-bit values in its zip64 extra field (the first `z64_fields` of
// them), and the end record points to a zip64 end record through its locator - the layout torch.save writes for
// a file over 4 GiB, at a size a test can hold.
std::string zip64_archive(uint64_t uncompressed, int z64_fields) {
  const std::string name = "a/data/0", data = "hello";
  Bytes z;
  z.u(0x04034b50, 4).u(45, 2).u(0, 2).u(0, 2).u(0, 4).u(0, 4).u(0xFFFFFFFF, 4).u(0xFFFFFFFF, 4);
  z.u(name.size(), 2).u(0, 2).s(name).s(data);
  const uint64_t cd_offset = z.b.size();
  z.u(0x02014b50, 4).u(45, 2).u(45, 2).u(0, 2).u(0, 2).u(0, 4).u(0, 4).u(0xFFFFFFFF, 4).u(0xFFFFFFFF, 4);
  z.u(name.size(), 2).u(4 + 8 * z64_fields, 2).u(0, 2).u(0, 2).u(0, 2).u(0, 4).u(0xFFFFFFFF, 4).s(name);
  z.u(1, 2).u(8 * z64_fields, 2);
  const uint64_t values[3] = {uncompressed, data.size(), 0};
  for (int i = 0; i < z64_fields; ++i) z.u(values[i], 8);
  const uint64_t cd_nbytes = z.b.size() - cd_offset, z64_end = z.b.size();
  z.u(0x06064b50, 4).u(44, 8).u(45, 2).u(45, 2).u(0, 4).u(0, 4).u(1, 8).u(1, 8).u(cd_nbytes, 8).u(cd_offset, 8);
  z.u(0x07064b50, 4).u(0, 4).u(z64_end, 8).u(1, 4);
  z.u(0x06054b50, 4).u(0, 2).u(0, 2).u(0xFFFF, 2).u(0xFFFF, 2).u(0xFFFFFFFF, 4).u(0xFFFFFFFF, 4).u(0, 2);
  return z.b;
}

}  // namespace

// The directory check reads torch's zip64 layout (a consolidated checkpoint over 4 GiB): sizes and offset from the
// zip64 extra field, the directory from the zip64 end record. (Checked once against a 4.5 GB torch.save file
// with records past 4 GiB: the same entries Python's zipfile lists, and the tensors load.)
TEST(PtCorruption, TheDirectoryCheckReadsZip64SizesAndRefusesTheirDamage) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/z64.zip";
  write_bytes(path, zip64_archive(5, 3));
  {
    bmt::checkpoint::InFile f(path);
    const auto entries = bmt::checkpoint::detail::read_zip_directory(f);
    ASSERT_EQ(entries.size(), 1u);
    EXPECT_EQ(entries[0].name, "a/data/0");
    EXPECT_EQ(entries[0].local_header_offset, 0);
    EXPECT_EQ(entries[0].compressed_nbytes, 5);
    EXPECT_EQ(entries[0].uncompressed_nbytes, 5);
  }
  const struct {
    uint64_t uncompressed;
    int fields;
    const char* expect;
  } bad[] = {{6, 3, "claims 6 bytes from 5 stored"},
             {5, 2, "zip64 size marker without a zip64 extra field"},
             {uint64_t{1} << 40, 3, "the sizes disagree"}};
  for (const auto& c : bad) {
    write_bytes(path, zip64_archive(c.uncompressed, c.fields));
    bmt::checkpoint::InFile f(path);
    try {
      bmt::checkpoint::detail::read_zip_directory(f);
      ADD_FAILURE() << c.expect << ": accepted";
    } catch (const bmt::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("zip entry a/data/0"), std::string::npos) << e.what();
    }
  }
  remove_tree(dir);
}
