// Who writes what (torch-free). Every rank declares the slices it holds: for each checkpoint entry (key, dtype,
// global shape, attrs) the element range [begin, end) of the flattened global tensor that lives on this rank
// (a ZeRO shard, a whole replicated tensor, a per-rank RNG state...). After the declarations are exchanged, every
// rank computes the same plan:
//  * entries are ordered by first declaration (rank 0's in its order, then keys first declared by rank 1, ...);
//  * every element is written exactly once, by the lowest rank that holds it (replicated tensors: rank 0;
//    ZeRO shards: their owner), so pieces of an entry are disjoint and sorted by begin;
//  * a key declared with different dtype, shape or attrs by two ranks is an error listing every conflict.
// layout_shard_files then gives each piece its byte offset in its rank's file (64-byte aligned, in plan order).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "bmt/checkpoint/metadata.h"

namespace bmt::checkpoint {

struct SliceDecl {
  std::string key;
  std::string dtype;
  std::vector<int64_t> shape;
  std::map<std::string, std::string> attrs;
  int64_t begin = 0, end = 0;  // elements of the flattened global tensor held here
};

struct PlannedPiece {
  int rank = 0;
  int64_t begin = 0, end = 0;
};

struct PlannedEntry {
  SliceDecl info;  // key, dtype, shape, attrs (begin/end unused)
  int64_t numel = 0;
  std::vector<PlannedPiece> pieces;  // disjoint, sorted by begin
};

std::string encode_decls(const std::vector<SliceDecl>& decls);
std::vector<SliceDecl> decode_decls(const std::string& bytes);

std::vector<PlannedEntry> plan_pieces(const std::vector<std::vector<SliceDecl>>& per_rank);

// Metadata entries (with pieces pointing into file index = rank) and, per rank, the file size.
struct FileLayout {
  std::vector<EntryMeta> entries;
  std::vector<int64_t> file_nbytes;  // per rank
};
constexpr int64_t kPieceAlignNbytes = 64;
FileLayout layout_shard_files(const std::vector<PlannedEntry>& plan, int world_size);

// "rank-00003.bin"
std::string shard_file_name(int rank);

}  // namespace bmt::checkpoint
