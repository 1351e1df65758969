// CheckpointReader: reads a sharded checkpoint directory in one process (no communicator needed): each rank of a
// loading job, and bmt-ckpt, open one.
//
// Invariants:
//  * the directory read is resolve_checkpoint_dir(dir) (the committed checkpoint, or after a crash in the middle
//    of a commit the newest complete one left beside it);
//  * every byte returned was covered by a verified block checksum: reading [a, b) of a file reads and checks the
//    enclosing checksum blocks (a mismatch throws naming the file and the byte range); a verified block is not
//    checked again; runs of whole blocks are read straight into the destination in large reads and verified on
//    worker threads while the next part is read (one pass over the bytes);
//  * a shard file that is missing or whose size differs from the metadata throws naming the file;
//  * requesting elements that no piece holds throws naming the entry and the range.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/metadata.h"

namespace bmt::checkpoint {

class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);

  const CheckpointMetadata& metadata() const { return meta_; }
  const std::string& path() const { return path_; }
  const EntryMeta* find(const std::string& key) const;

  // Elements [begin, end) of the flattened entry, written to dst (end - begin elements of the entry's dtype).
  void read_into(const EntryMeta& e, int64_t begin, int64_t end, void* dst);
  // The same as a 1-D CPU tensor of the entry's dtype.
  at::Tensor read(const EntryMeta& e, int64_t begin, int64_t end);
  // The whole entry in its shape.
  at::Tensor read_full(const EntryMeta& e);

  // Reads every file completely: sizes, block checksums and whole-file checksums. Returns the problems found.
  std::vector<std::string> verify_all();

  // Bytes read from the shard files so far (what a resharding load costs: the ranges a rank needs, rounded out
  // to whole checksum blocks).
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct OpenFile {
    std::unique_ptr<InFile> file;
    std::set<int64_t> verified_blocks;
  };
  OpenFile& open_file(int index);
  void read_file_range(int index, int64_t offset, int64_t nbytes, char* dst);
  // Whole checksum blocks [offset, offset + nbytes) straight into dst, verified on the checksum workers while the
  // next part is read.
  void read_whole_blocks(int index, int64_t offset, int64_t nbytes, char* dst);
  void pread_counted(OpenFile& f, int64_t offset, int64_t nbytes, char* dst);

  std::string path_;
  CheckpointMetadata meta_;
  std::unordered_map<std::string, size_t> index_;
  std::unordered_map<int, OpenFile> files_;
  std::vector<char> block_buf_;
  int64_t bytes_read_ = 0;
};

}  // namespace bmt::checkpoint
