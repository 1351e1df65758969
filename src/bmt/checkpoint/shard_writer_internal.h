// Writing one rank's shard file of a sharded checkpoint.
//
// The file holds, at the byte offsets the layout assigned (layout_shard_files), the raw bytes of every piece this
// rank was planned to write; gaps (alignment) are zeros. The file's bytes are staged in host chunks of
// stage_chunk_nbytes() (host_staging_internal.h): device pieces are copied to pinned memory on a side stream, host
// pieces by memcpy on worker threads, while the previous chunks are written (one write stream, large writes)
// and checksummed on the worker threads (parallel_crc_internal.h): CRC-32s of each checksum block and of the
// whole file. The file is fsynced once at the end and closed before its info is returned, so a returned
// ShardFileInfo always describes durable bytes.
//  * write_shard_file (sync save): a ring of kSyncRingChunks chunks: copies of chunk k+4 overlap the write of k.
//  * ShardSnapshot (async save): the constructor copies the whole file image and returns once the bytes are safe
//    from later training, then write() (on a background thread) writes them. Two ways:
//    - host: into host chunks for the whole file (pinned with CUDA; host pieces copied, device copies enqueued
//      with the compute stream ordered after them) when they are ready (cached from an earlier save or
//      prepare_async_save) or when the GPU has no room for the second way;
//    - device (the first async save of a process that did not prepare): the device pieces are copied into one
//      device buffer on the compute stream (milliseconds, against seconds to pin the whole file), and write()
//      stages them through a ring of pinned chunks like the sync path; the buffer is freed when the file is
//      written. Taken only when the GPU's free memory holds the copy on top of the peak of the steps so far.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/checkpoint/state_slices.h"

namespace bmt::checkpoint {

struct WriteItem {
  int64_t byte_offset = 0;
  at::Tensor src;  // holds elements [src_begin, src_end) of its flattened self to write
  int64_t src_begin = 0, src_end = 0;
  bool private_copy = false;  // LocalSlice::private_copy (informational: the snapshot copies every piece)
};

// Where a shard write's time went (seconds of the writing thread, except crc_busy_s: summed over workers).
struct WriteProfile {
  double wait_data_s = 0;  // waiting for a chunk's copies (device → host, memcpy)
  double write_s = 0;      // write system calls
  double crc_wait_s = 0;   // waiting for a chunk's checksums after its write
  double fsync_s = 0;      // the final fsync + close
  int64_t chunks = 0;
};

// The pieces of `rank` in layout order, taken from this rank's local slices.
std::vector<WriteItem> rank_write_items(const std::vector<PlannedEntry>& plan, const FileLayout& layout,
                                        const std::vector<LocalSlice>& mine, int rank);

ShardFileInfo write_shard_file(const std::string& path, const std::string& name, const std::vector<WriteItem>& items,
                               int64_t file_nbytes, int64_t block_nbytes, WriteProfile* profile = nullptr);

class ShardSnapshot {
 public:
  // Host way: the process's cached host chunks (allocated here when missing). Device way (above) when
  // `device_staging` and it applies. The items may be dropped after this returns.
  ShardSnapshot(const std::vector<WriteItem>& items, int64_t file_nbytes, bool device_staging = true);
  ~ShardSnapshot();
  ShardSnapshot(const ShardSnapshot&) = delete;
  ShardSnapshot& operator=(const ShardSnapshot&) = delete;
  ShardFileInfo write(const std::string& path, const std::string& name, int64_t block_nbytes,
                      WriteProfile* profile = nullptr);
  int64_t nbytes() const { return file_nbytes_; }
  // True when the snapshot took the device way.
  bool device_staged() const { return device_staged_; }

 private:
  int64_t file_nbytes_;
  bool device_staged_ = false;
  std::unique_ptr<ImageFiller> filler_;
  std::vector<HostChunk*> chunks_;
};

}  // namespace bmt::checkpoint
