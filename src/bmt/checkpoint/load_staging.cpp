#include "bmt/checkpoint/load_staging_internal.h"

#include <algorithm>
#include <map>

#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/core/error.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bmt::checkpoint {
namespace {

using FileSpan = CheckpointReader::FileSpan;

#ifdef BMT_WITH_CUDA
std::string it_name(const InPlaceLoad* it) { return it ? it->entry->key : std::string("?"); }

// Staging ring slots: two chunks being read (one batch ahead) and two being copied to the device.
constexpr int kLoadRingChunks = 4;

void load_device(CheckpointReader& reader, int device, const std::vector<const InPlaceLoad*>& items) {
  const auto dev = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard guard(dev);
  const int64_t C = stage_chunk_nbytes(), B = reader.metadata().checksum_block_nbytes;
  std::vector<std::vector<FileSpan>> item_spans(items.size());
  for (size_t i = 0; i < items.size(); ++i)
    reader.spans_of(*items[i]->entry, items[i]->begin, items[i]->end, item_spans[i]);
  std::vector<StagedChunk> chunks = plan_staged_load(item_spans, C, B);
  const std::vector<HostChunk*> host = borrow_host_chunks(kLoadRingChunks, /*pinned=*/true);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, dev);
  {
    // The copies overwrite tensors that kernels already issued may still use.
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(dev));
    ready.block(side);
  }
  struct SideSync {  // no copy may still read a staging chunk when this function leaves, by error or not
    c10::cuda::CUDAStream& s;
    ~SideSync() { cudaStreamSynchronize(s.stream()); }
  } side_sync{side};
  std::vector<at::cuda::CUDAEvent> freed(kLoadRingChunks);
  std::vector<bool> slot_used(kLoadRingChunks, false);
  auto start = [&](size_t k) {
    const size_t slot = k % kLoadRingChunks;
    if (slot_used[slot]) freed[slot].synchronize();  // chunk k - kLoadRingChunks has reached the device
    for (FileSpan& s : chunks[k].spans) s.dst = host[slot]->data + s.dst_offset;
    return reader.start_spans(chunks[k].spans);
  };
  auto finish = [&](size_t k, CheckpointReader::Batch& batch) {
    batch.wait();
    const size_t slot = k % kLoadRingChunks;
    for (const StagedCopy& c : chunks[k].copies) {
      char* dst = static_cast<char*>(items[c.item]->dst.data_ptr()) + c.dst_offset;
      const cudaError_t err = cudaMemcpyAsync(dst, host[slot]->data + c.staged_offset, static_cast<size_t>(c.nbytes),
                                              cudaMemcpyHostToDevice, side.stream());
      if (err != cudaSuccess) {
        // Clear the runtime's last error, or torch's next launch check reports it instead of this message.
        (void)cudaGetLastError();
        BMT_CHECK(false, "checkpoint load: copying ", c.nbytes, " bytes to cuda:", device, " (",
                  it_name(items[c.item]), ") failed: ", cudaGetErrorString(err));
      }
    }
    freed[slot].record(side);
    slot_used[slot] = true;
  };
  std::unique_ptr<CheckpointReader::Batch> prev = start(0);
  for (size_t k = 1; k < chunks.size(); ++k) {
    std::unique_ptr<CheckpointReader::Batch> next = start(k);  // read ahead while chunk k - 1 is checked
    finish(k - 1, *prev);
    prev = std::move(next);
  }
  finish(chunks.size() - 1, *prev);
  at::cuda::CUDAEvent all;
  all.record(side);
  all.block(c10::cuda::getCurrentCUDAStream(dev));
}
#endif

}  // namespace

std::vector<StagedChunk> plan_staged_load(const std::vector<std::vector<FileSpan>>& item_spans,
                                          int64_t chunk_nbytes, int64_t block_nbytes) {
  BMT_CHECK(chunk_nbytes > 0 && block_nbytes > 0, "plan_staged_load: chunk and block sizes must be positive");
  const int64_t C = chunk_nbytes, B = block_nbytes;
  std::vector<StagedChunk> chunks(1);
  int64_t fill = 0;
  for (size_t item = 0; item < item_spans.size(); ++item) {
    for (const FileSpan& s : item_spans[item]) {
      int64_t off = s.file_offset, n = s.nbytes, rel = s.dst_offset;
      while (n > 0) {
        if (fill == C) {
          chunks.emplace_back();
          fill = 0;
        }
        int64_t take = std::min(n, C - fill);
        bool cut = false;
        if (take < n) {  // the chunk ends inside this span: end it at a block boundary when there is one
          const int64_t aligned = (off + take) / B * B - off;
          if (aligned > 0) take = aligned;
          cut = true;
        }
        StagedChunk& ch = chunks.back();
        ch.spans.push_back({s.file, off, take, fill, nullptr});
        StagedCopy* last = ch.copies.empty() ? nullptr : &ch.copies.back();
        if (last && last->item == item && last->staged_offset + last->nbytes == fill &&
            last->dst_offset + last->nbytes == rel)
          last->nbytes += take;
        else
          ch.copies.push_back({fill, item, rel, take});
        fill = cut ? C : fill + take;
        off += take;
        rel += take;
        n -= take;
      }
    }
  }
  return chunks;
}

bool can_load_in_place(const EntryMeta& e, int64_t begin, int64_t end, const at::Tensor& dst) {
  if (!dst.defined() || !dst.is_contiguous() || dst.numel() != end - begin) return false;
  if (dtype_name(dst.scalar_type()) != e.dtype) return false;
#ifdef BMT_WITH_CUDA
  if (dst.is_cuda()) return true;
#endif
  return dst.is_cpu();
}

void load_in_place(CheckpointReader& reader, const std::vector<InPlaceLoad>& items) {
  std::vector<FileSpan> host;
  std::map<int, std::vector<const InPlaceLoad*>> device;  // CUDA destinations by device index
  for (const InPlaceLoad& it : items) {
    BMT_ASSERT(can_load_in_place(*it.entry, it.begin, it.end, it.dst), "load_in_place: ", it.entry->key,
               " cannot be read into a tensor of ", it.dst.sizes(), " ", it.dst.scalar_type(), " on ", it.dst.device());
    if (it.dst.is_cpu()) {
      const size_t first = host.size();
      reader.spans_of(*it.entry, it.begin, it.end, host);
      for (size_t i = first; i < host.size(); ++i) host[i].dst = static_cast<char*>(it.dst.data_ptr()) + host[i].dst_offset;
    } else {
      device[it.dst.device().index()].push_back(&it);
    }
  }
  std::unique_ptr<CheckpointReader::Batch> host_batch = reader.start_spans(host);  // runs beside the device part
#ifdef BMT_WITH_CUDA
  for (const auto& [index, list] : device) load_device(reader, index, list);
#endif
  host_batch->wait();
}

}  // namespace bmt::checkpoint
