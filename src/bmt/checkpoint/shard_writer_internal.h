// Writing one rank's shard file of a sharded checkpoint.
//
// The file holds, at the byte offsets the layout assigned (layout_shard_files), the raw bytes of every piece this
// rank was planned to write; gaps (alignment) are zeros. CRC-32s of each checksum block and of the whole file are
// computed while writing; the file is fsynced and closed before its info is returned, so a returned
// ShardFileInfo always describes durable bytes.
// Device tensors are copied to the host in chunks of at most kCopyChunkNbytes (bounded host memory); with
// snapshot_to_host the pieces are first copied to host memory (pinned for CUDA tensors) so that training may
// modify the live tensors while a background thread writes.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/checkpoint/state_slices.h"

namespace bmt::checkpoint {

constexpr int64_t kCopyChunkNbytes = int64_t{64} << 20;

struct WriteItem {
  int64_t byte_offset = 0;
  at::Tensor src;  // holds elements [src_begin, src_end) of its flattened self to write
  int64_t src_begin = 0, src_end = 0;
  bool private_copy = false;  // LocalSlice::private_copy: a host tensor needs no snapshot copy
};

// The pieces of `rank` in layout order, taken from this rank's local slices.
std::vector<WriteItem> rank_write_items(const std::vector<PlannedEntry>& plan, const FileLayout& layout,
                                        const std::vector<LocalSlice>& mine, int rank);
// Copies every item's bytes to host memory (the returned items own their copies). Returns the bytes copied.
int64_t snapshot_to_host(std::vector<WriteItem>& items);

ShardFileInfo write_shard_file(const std::string& path, const std::string& name, const std::vector<WriteItem>& items,
                               int64_t file_nbytes, int64_t block_nbytes);

}  // namespace bmt::checkpoint
