// The central directory of a zip archive (a torch.save .pt file), read and bounded before torch's zip reader
// sees the file: torch's reader allocates each record's claimed uncompressed size before it extracts it, so a
// damaged directory entry claiming 4 GiB in a 2 KiB file would cost a 4 GiB allocation before any error.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bmt::checkpoint {

class InFile;

namespace detail {

struct ZipEntry {
  std::string name;
  int64_t local_header_offset = 0;
  int64_t compressed_nbytes = 0, uncompressed_nbytes = 0;
  int method = 0;  // 0 stored, 8 deflate
};

// Every entry of the archive's central directory (the last end-of-central-directory record, its zip64 form where
// present, and each entry's zip64 extra field where a 32-bit field holds the zip64 marker). Raises bmt::core::Error,
// naming the file and the entry, when the directory is malformed or an entry's sizes do not fit the file: its
// data would run past the end, a stored entry's two sizes differ, a deflated one claims more than deflate can
// expand to, or a size is the zip64 marker without the zip64 field that should replace it.
std::vector<ZipEntry> read_zip_directory(const InFile& file);

}  // namespace detail
}  // namespace bmt::checkpoint
