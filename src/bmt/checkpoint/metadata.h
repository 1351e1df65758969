// The metadata file of a sharded checkpoint directory (written by rank 0, last, after every shard file is
// durable), torch-free. It is what makes a directory a checkpoint: a directory without a valid metadata file is an
// unfinished save.
//
// File layout: one ASCII line "BMTCKPT <format version> <crc32 of the JSON, 8 hex> <JSON nbytes>\n", then the JSON:
//   {"format_version": 1, "world_size": W, "step": S, "created_by": "...", "created_unix_ms": T,
//    "user_metadata": {str: str},
//    "checksum": {"algorithm": "crc32", "block_nbytes": B},
//    "files": [{"name": "rank-00000.bin", "nbytes": N, "crc32": C, "block_crc32": [c0, c1, ...]}, ...],
//    "entries": [{"key": "model/embed.weight", "dtype": "F32", "shape": [16, 8], "attrs": {str: str},
//                 "pieces": [[file index, byte offset, element begin, element end], ...]}, ...]}
// Entry data: the flattened (row-major) global tensor; a piece holds elements [begin, end) as raw little-endian
// bytes at `byte offset` of the file. block_crc32[i] is the CRC-32 of bytes [i*B, min((i+1)*B, N)) of the file, so a
// reader verifies exactly the blocks it touches; crc32 covers the whole file.
//
// parse_metadata validates everything a reader relies on (it is fuzzed): magic, version (an unknown version is a
// clear error), JSON checksum and length, safe unique file names, block CRC counts, known dtypes, shapes without
// overflow, unique keys, pieces inside the tensor and inside their file, sorted and non-overlapping. Pieces need
// not cover a tensor completely; readers report the missing range.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "bmt/checkpoint/tensor_info.h"

namespace bmt::checkpoint {

constexpr int kFormatVersion = 1;
constexpr const char* kMetadataFileName = "checkpoint.meta";
constexpr int64_t kDefaultChecksumBlockNbytes = int64_t{1} << 20;
constexpr int64_t kMaxMetadataNbytes = int64_t{1} << 30;

struct ShardFileInfo {
  std::string name;  // relative to the checkpoint directory, no '/'
  int64_t nbytes = 0;
  uint32_t crc32 = 0;
  std::vector<uint32_t> block_crc32;
};

struct Piece {
  int file = 0;
  int64_t byte_offset = 0;
  int64_t elem_begin = 0, elem_end = 0;
};

struct EntryMeta {
  std::string key;
  std::string dtype;
  std::vector<int64_t> shape;
  std::map<std::string, std::string> attrs;  // role, component, param, ... (interpreted by the state layer)
  std::vector<Piece> pieces;                 // sorted by elem_begin, disjoint
};

struct CheckpointMetadata {
  int format_version = kFormatVersion;
  int world_size = 1;
  int64_t step = 0;
  std::string created_by;
  int64_t created_unix_ms = 0;  // orders candidates when recovering from a crash during a commit
  std::map<std::string, std::string> user_metadata;
  int64_t checksum_block_nbytes = kDefaultChecksumBlockNbytes;
  std::vector<ShardFileInfo> files;
  std::vector<EntryMeta> entries;

  // Index of the entry with this key, or -1.
  int find_entry(const std::string& key) const;
};

std::string serialize_metadata(const CheckpointMetadata& meta);
// `what` names the file in error messages.
CheckpointMetadata parse_metadata(std::string_view bytes, const std::string& what);

// Number of checksum blocks of a file of nbytes bytes.
int64_t checksum_block_count(int64_t nbytes, int64_t block_nbytes);

}  // namespace bmt::checkpoint
