// Reads and bounds a zip central directory (zip_directory_internal.h). Layouts: PKWARE APPNOTE 4.3.12 (central
// directory header), 4.3.14-4.3.16 (zip64 end of central directory record and locator, end of central directory
// record), 4.5.3 (zip64 extended information extra field).
#include "bmt/checkpoint/zip_directory_internal.h"

#include <algorithm>

#include "bmt/checkpoint/file_io.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint::detail {
namespace {

constexpr uint32_t kEndSig = 0x06054b50, kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50,
                   kEntrySig = 0x02014b50;
constexpr int64_t kEndNbytes = 22, kLocatorNbytes = 20, kZip64EndNbytes = 56, kEntryNbytes = 46,
                  kLocalHeaderNbytes = 30;
constexpr uint32_t kZip64Marker32 = 0xFFFFFFFFu;
// Deflate expands at most 1032:1 (a 258-byte match per ~2 bits); the slack covers tiny streams.
constexpr int64_t kDeflateMaxRatio = 1032, kDeflateSlackNbytes = 1024;

uint64_t le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

// The zip64 extra field's values, in the order the APPNOTE gives, for those 32-bit fields holding the marker.
struct Zip64Sizes {
  bool has_uncompressed = false, has_compressed = false, has_offset = false;
  uint64_t uncompressed = 0, compressed = 0, offset = 0;
};

Zip64Sizes zip64_extra(const uint8_t* extra, int64_t extra_nbytes, bool want_uncompressed, bool want_compressed,
                       bool want_offset) {
  Zip64Sizes z;
  for (int64_t at = 0; at + 4 <= extra_nbytes;) {
    const uint64_t id = le(extra + at, 2), n = le(extra + at + 2, 2);
    if (at + 4 + static_cast<int64_t>(n) > extra_nbytes) break;
    if (id == 1) {
      const uint8_t* p = extra + at + 4;
      int64_t left = static_cast<int64_t>(n);
      auto take = [&](bool want, bool& has, uint64_t& v) {
        if (!want || left < 8) return;
        v = le(p, 8);
        has = true;
        p += 8;
        left -= 8;
      };
      take(want_uncompressed, z.has_uncompressed, z.uncompressed);
      take(want_compressed, z.has_compressed, z.compressed);
      take(want_offset, z.has_offset, z.offset);
      break;
    }
    at += 4 + static_cast<int64_t>(n);
  }
  return z;
}

}  // namespace

std::vector<ZipEntry> read_zip_directory(const InFile& file) {
  const std::string& path = file.path();
  const int64_t size = file.size_nbytes();
  BMT_CHECK(size >= kEndNbytes, path, ": ", size, " bytes is too short for a zip archive (truncated?)");
  // The end record is the last thing in the file but for a comment of up to 65535 bytes: the last signature.
  const int64_t tail_nbytes = std::min<int64_t>(size, kEndNbytes + 0xFFFF);
  std::vector<uint8_t> tail(static_cast<size_t>(tail_nbytes));
  file.pread_exact(size - tail_nbytes, tail_nbytes, tail.data());
  int64_t end_in_tail = -1;
  for (int64_t i = tail_nbytes - kEndNbytes; i >= 0; --i) {
    if (le(&tail[static_cast<size_t>(i)], 4) == kEndSig) {
      end_in_tail = i;
      break;
    }
  }
  BMT_CHECK(end_in_tail >= 0, path, ": no zip end-of-central-directory record (not a zip archive, or truncated)");
  const uint8_t* end = &tail[static_cast<size_t>(end_in_tail)];
  const int64_t end_offset = size - tail_nbytes + end_in_tail;
  uint64_t count = le(end + 10, 2), cd_nbytes = le(end + 12, 4), cd_offset = le(end + 16, 4);
  if (end_offset >= kLocatorNbytes) {
    uint8_t loc[kLocatorNbytes];
    file.pread_exact(end_offset - kLocatorNbytes, kLocatorNbytes, loc);
    if (le(loc, 4) == kZip64LocatorSig) {
      const uint64_t z_offset = le(loc + 8, 8);
      BMT_CHECK(z_offset <= static_cast<uint64_t>(end_offset - kLocatorNbytes - kZip64EndNbytes), path,
                ": the zip64 end record's offset ", z_offset, " lies outside the file (corrupted)");
      uint8_t z[kZip64EndNbytes];
      file.pread_exact(static_cast<int64_t>(z_offset), kZip64EndNbytes, z);
      BMT_CHECK(le(z, 4) == kZip64EndSig, path, ": no zip64 end record where its locator points (corrupted)");
      count = le(z + 32, 8);
      cd_nbytes = le(z + 40, 8);
      cd_offset = le(z + 48, 8);
    }
  }
  BMT_CHECK(cd_offset <= static_cast<uint64_t>(size) && cd_nbytes <= static_cast<uint64_t>(size) - cd_offset &&
                count <= cd_nbytes / kEntryNbytes,
            path, ": the zip central directory (", count, " entries, ", cd_nbytes, " bytes at ", cd_offset,
            ") does not fit the file's ", size, " bytes (truncated or corrupted)");
  std::vector<uint8_t> cd(static_cast<size_t>(cd_nbytes));
  file.pread_exact(static_cast<int64_t>(cd_offset), static_cast<int64_t>(cd_nbytes), cd.data());

  std::vector<ZipEntry> entries;
  entries.reserve(static_cast<size_t>(count));
  int64_t at = 0;
  for (uint64_t k = 0; k < count; ++k) {
    BMT_CHECK(at + kEntryNbytes <= static_cast<int64_t>(cd_nbytes) && le(&cd[static_cast<size_t>(at)], 4) == kEntrySig,
              path, ": zip central directory entry ", k, " is malformed (corrupted)");
    const uint8_t* e = &cd[static_cast<size_t>(at)];
    const int64_t name_n = static_cast<int64_t>(le(e + 28, 2)), extra_n = static_cast<int64_t>(le(e + 30, 2)),
                  comment_n = static_cast<int64_t>(le(e + 32, 2));
    BMT_CHECK(at + kEntryNbytes + name_n + extra_n + comment_n <= static_cast<int64_t>(cd_nbytes), path,
              ": zip central directory entry ", k, " runs past the directory (corrupted)");
    ZipEntry z;
    z.name.assign(reinterpret_cast<const char*>(e + kEntryNbytes), static_cast<size_t>(name_n));
    z.method = static_cast<int>(le(e + 10, 2));
    uint64_t compressed = le(e + 20, 4), uncompressed = le(e + 24, 4), offset = le(e + 42, 4);
    const bool want_u = uncompressed == kZip64Marker32, want_c = compressed == kZip64Marker32,
               want_o = offset == kZip64Marker32;
    const Zip64Sizes z64 = zip64_extra(e + kEntryNbytes + name_n, extra_n, want_u, want_c, want_o);
    BMT_CHECK(want_u == z64.has_uncompressed && want_c == z64.has_compressed && want_o == z64.has_offset, path,
              ": zip entry ", z.name, " holds the zip64 size marker without a zip64 extra field (corrupted)");
    if (want_u) uncompressed = z64.uncompressed;
    if (want_c) compressed = z64.compressed;
    if (want_o) offset = z64.offset;
    const uint64_t room = static_cast<uint64_t>(size);
    BMT_CHECK(offset <= room && compressed <= room && offset + kLocalHeaderNbytes + compressed <= room, path,
              ": zip entry ", z.name, " claims ", compressed, " bytes at offset ", offset, ", past the end of the ",
              size, "-byte file (truncated or corrupted)");
    const bool stored_ok = z.method != 0 || uncompressed == compressed;
    const bool deflate_ok = z.method == 0 || uncompressed <= compressed * kDeflateMaxRatio + kDeflateSlackNbytes;
    BMT_CHECK(stored_ok && deflate_ok, path, ": zip entry ", z.name, " claims ", uncompressed, " bytes from ",
              compressed, " stored (method ", z.method, "): the sizes disagree (corrupted)");
    z.local_header_offset = static_cast<int64_t>(offset);
    z.compressed_nbytes = static_cast<int64_t>(compressed);
    z.uncompressed_nbytes = static_cast<int64_t>(uncompressed);
    entries.push_back(std::move(z));
    at += kEntryNbytes + name_n + extra_n + comment_n;
  }
  return entries;
}

}  // namespace bmt::checkpoint::detail
