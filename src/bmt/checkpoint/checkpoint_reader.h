// CheckpointReader: reads a sharded checkpoint directory in one process (no communicator needed): each rank of a
// loading job, and bmt-ckpt, open one.
//
// Invariants:
//  * the directory read is resolve_checkpoint_dir(dir) (the committed checkpoint, or after a crash in the middle
//    of a commit the newest complete one left beside it);
//  * every byte returned was covered by a verified block checksum: reading [a, b) of a file reads and checks the
//    enclosing checksum blocks (a mismatch throws naming the file and the byte range); a verified block is not
//    checked again; reads go straight into the destination (bytes of a checksum block that no destination wants
//    into scratch), in tasks of whole blocks (~4 MiB) on the worker threads that read their part and checksum it
//    while it is in the cache (one pass over the bytes); a batch of spans (read_spans) is one set of tasks, so
//    small tensors do not wait for one another and a block shared by two spans is read once;
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

  // A batched read: file bytes [file_offset, file_offset + nbytes) of shard file `file` into dst.
  struct FileSpan {
    int file = 0;
    int64_t file_offset = 0, nbytes = 0;
    int64_t dst_offset = 0;  // spans_of: where the span's bytes go relative to the caller's buffer
    char* dst = nullptr;
  };
  // The spans of elements [begin, end) of e (dst_offset relative to element `begin`, dst unset); checked like
  // read_into.
  void spans_of(const EntryMeta& e, int64_t begin, int64_t end, std::vector<FileSpan>& out) const;
  // Reads spans on the worker threads, all at once; wait() (or the destructor, which drops errors) returns once
  // every task ended and throws the first problem (a checksum mismatch naming the file and the bytes). Several
  // batches may be in flight; a block read by two of them is verified by both.
  class Batch {
   public:
    ~Batch();
    void wait();
    struct Task;

   private:
    friend class CheckpointReader;
    CheckpointReader* reader_ = nullptr;
    std::vector<std::unique_ptr<Task>> tasks_;
    bool waited_ = false;
  };
  std::unique_ptr<Batch> start_spans(const std::vector<FileSpan>& spans);
  void read_spans(const std::vector<FileSpan>& spans) { start_spans(spans)->wait(); }

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
  void pread_counted(OpenFile& f, int64_t offset, int64_t nbytes, char* dst);

  std::string path_;
  CheckpointMetadata meta_;
  std::unordered_map<std::string, size_t> index_;
  std::unordered_map<int, OpenFile> files_;
  int64_t bytes_read_ = 0;
};

}  // namespace bmt::checkpoint
