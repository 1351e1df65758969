// Loading checkpoint tensors straight into place: the reads of many destination tensors go out as one set of
// verified block reads (CheckpointReader::start_spans), so nothing waits tensor by tensor and no byte is copied
// twice on the host.
//  * host destinations: the file bytes are read directly into the tensors' memory;
//  * CUDA destinations: read into a ring of pinned staging chunks (the save's, host_staging_internal.h), each
//    chunk copied to the device on a side stream while the next ones are read; the device's current stream then
//    waits for the copies, and load_in_place returns once the staging chunks are free again.
// A chunk is cut at a checksum-block boundary where a span crosses it, so consecutive chunks share no block.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"

namespace bmt::checkpoint {

// Elements [begin, end) of entry `entry` into `dst` (see can_load_in_place).
struct InPlaceLoad {
  const EntryMeta* entry = nullptr;
  int64_t begin = 0, end = 0;
  at::Tensor dst;
};

// dst is contiguous, of e's dtype, with end - begin elements, on the CPU or a CUDA device.
bool can_load_in_place(const EntryMeta& e, int64_t begin, int64_t end, const at::Tensor& dst);

// Fills every item's dst; throws the reader's errors (checksum mismatch naming the file) after every read ended.
void load_in_place(CheckpointReader& reader, const std::vector<InPlaceLoad>& items);

// The plan of a staged (CUDA) load, a pure function of the spans so that it is tested on CPUs
// (tests/checkpoint/test_load_plan.cpp). Items' spans (CheckpointReader::spans_of: dst_offset relative to the item)
// are laid into staging chunks of chunk_nbytes in order; a chunk that ends inside a span ends at a checksum-block
// boundary where the span crosses one (so consecutive chunks share no block, and each chunk's reads verify whole
// blocks of their own). Each chunk lists its file reads (dst_offset: offset in the chunk) and its host-to-device
// copies. Copies merge only within one item, when both the staging bytes and the item's bytes are contiguous: two
// items may be separate allocations that happen to be adjacent in address space, and one cudaMemcpyAsync must not
// span two allocations.
struct StagedCopy {
  int64_t staged_offset = 0;  // in the chunk
  size_t item = 0;            // index into the items
  int64_t dst_offset = 0;     // bytes into that item's destination
  int64_t nbytes = 0;
};
struct StagedChunk {
  std::vector<CheckpointReader::FileSpan> spans;
  std::vector<StagedCopy> copies;
};
std::vector<StagedChunk> plan_staged_load(const std::vector<std::vector<CheckpointReader::FileSpan>>& item_spans,
                                          int64_t chunk_nbytes, int64_t block_nbytes);

}  // namespace bmt::checkpoint
