#include "bmt/checkpoint/shard_writer_internal.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <unordered_map>

#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/parallel_crc_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<ImagePiece> image_pieces(const std::vector<WriteItem>& items) {
  std::vector<ImagePiece> pieces;
  for (const WriteItem& it : items)
    if (it.src_end > it.src_begin) pieces.push_back({it.byte_offset, detail::byte_view(it.src, it.src_begin, it.src_end)});
  return pieces;
}

// Writes the image chunk by chunk: wait for chunk k's bytes, checksum it on the workers while this thread writes
// it, collect chunk k-1's checksums after chunk k's write (the workers never hold the writer up), then
// `release(k - 1)` (its buffer may be refilled). One fsync at the end.
ShardFileInfo write_image(const std::string& path, const std::string& name, ImageFiller& filler,
                          const std::function<char*(int64_t)>& chunk_data, const std::function<void(int64_t)>& release,
                          int64_t file_nbytes, int64_t block_nbytes, WriteProfile* profile) {
  WriteProfile prof;
  ShardFileInfo info;
  info.name = name;
  BlockCrcAccumulator crc(block_nbytes);
  OutFile out(path, direct_writes_requested());
  const int64_t n = filler.num_chunks();
  std::future<std::vector<CrcSegment>> pending;
  int64_t pending_k = -1;
  auto collect = [&] {
    if (pending_k < 0) return;
    const auto t = Clock::now();
    for (const CrcSegment& seg : pending.get()) crc.add(seg);
    prof.crc_wait_s += seconds_since(t);
    release(pending_k);
    pending_k = -1;
  };
  try {
    for (int64_t k = 0; k < n; ++k) {
      auto t = Clock::now();
      filler.wait(k);
      prof.wait_data_s += seconds_since(t);
      const char* data = chunk_data(k);
      const int64_t len = filler.chunk_nbytes(k);
      auto sums = checksum_async(crc_pool(), data, filler.chunk_offset(k), len, block_nbytes);
      t = Clock::now();
      try {
        out.write(data, len);
        out.start_writeback(filler.chunk_offset(k), len);
      } catch (...) {
        sums.wait();
        throw;
      }
      prof.write_s += seconds_since(t);
      collect();
      pending = std::move(sums);
      pending_k = k;
      ++prof.chunks;
    }
    collect();
  } catch (...) {
    if (pending.valid()) pending.wait();  // the workers must be done with the buffers before they go
    throw;
  }
  BMT_ASSERT(out.position_nbytes() == file_nbytes, "wrote ", out.position_nbytes(), " bytes to ", path, ", planned ",
             file_nbytes);
  const auto t = Clock::now();
  out.sync();
  out.close();
  prof.fsync_s = seconds_since(t);
  crc.finish(info);
  if (profile) *profile = prof;
  return info;
}

// Writes the image through a ring of kSyncRingChunks host chunks: copies of chunk k + ring overlap the write of k.
ShardFileInfo write_through_ring(const std::string& path, const std::string& name, ImageFiller& filler,
                                 int64_t file_nbytes, int64_t block_nbytes, WriteProfile* profile) {
  const int64_t n = filler.num_chunks(), ring = std::min<int64_t>(kSyncRingChunks, n);
  std::vector<HostChunk*> slots = borrow_host_chunks(ring, filler.has_device_pieces());
  auto slot = [&](int64_t k) { return slots[static_cast<size_t>(k % ring)]->data; };
  for (int64_t k = 0; k < ring; ++k) filler.fill(k, slot(k));
  return write_image(path, name, filler, slot,
                     [&](int64_t k) {
                       if (k + ring < n) filler.fill(k + ring, slot(k + ring));
                     },
                     file_nbytes, block_nbytes, profile);
}

}  // namespace

std::vector<WriteItem> rank_write_items(const std::vector<PlannedEntry>& plan, const FileLayout& layout,
                                        const std::vector<LocalSlice>& mine, int rank) {
  std::unordered_map<std::string, const LocalSlice*> by_key;
  for (const LocalSlice& s : mine) by_key.emplace(s.decl.key, &s);
  std::vector<WriteItem> items;
  for (size_t i = 0; i < plan.size(); ++i) {
    for (const Piece& p : layout.entries[i].pieces) {
      if (p.file != rank) continue;
      auto it = by_key.find(plan[i].info.key);
      BMT_ASSERT(it != by_key.end(), "rank ", rank, " was planned to write ", plan[i].info.key, " which it lacks");
      const LocalSlice& s = *it->second;
      BMT_ASSERT(s.decl.begin <= p.elem_begin && p.elem_end <= s.decl.end, "planned piece outside the local slice");
      items.push_back(
          WriteItem{p.byte_offset, s.data, p.elem_begin - s.decl.begin, p.elem_end - s.decl.begin, s.private_copy});
    }
  }
  std::sort(items.begin(), items.end(), [](const WriteItem& a, const WriteItem& b) { return a.byte_offset < b.byte_offset; });
  return items;
}

ShardFileInfo write_shard_file(const std::string& path, const std::string& name, const std::vector<WriteItem>& items,
                               int64_t file_nbytes, int64_t block_nbytes, WriteProfile* profile) {
  ImageFiller filler(image_pieces(items), file_nbytes);
  return write_through_ring(path, name, filler, file_nbytes, block_nbytes, profile);
}

ShardSnapshot::ShardSnapshot(const std::vector<WriteItem>& items, int64_t file_nbytes, bool device_staging)
    : file_nbytes_(file_nbytes) {
  std::vector<ImagePiece> pieces = image_pieces(items);
  const int64_t n = (file_nbytes + stage_chunk_nbytes() - 1) / stage_chunk_nbytes();
  bool on_device = false;
  for (const ImagePiece& p : pieces) on_device |= !p.bytes.is_cpu();
  if (device_staging && on_device && !host_chunks_ready(n, /*pinned=*/true)) {
    if (auto copies = copy_pieces_for_device_staging(pieces)) {
      // The filler's side stream starts after the copies just issued on the compute stream; write() fills.
      filler_ = std::make_unique<ImageFiller>(std::move(*copies), file_nbytes);
      device_staged_ = true;
      return;
    }
  }
  filler_ = std::make_unique<ImageFiller>(std::move(pieces), file_nbytes);
  chunks_ = borrow_host_chunks(filler_->num_chunks(), filler_->has_device_pieces());
  for (int64_t k = 0; k < filler_->num_chunks(); ++k) filler_->fill(k, chunks_[static_cast<size_t>(k)]->data);
  // Host pieces: copied before returning (training may modify them next). Device pieces: the compute stream
  // waits for their copies, the host does not.
  filler_->order_current_stream_after_copies();
  filler_->wait_host_copies();
}

ShardSnapshot::~ShardSnapshot() = default;

ShardFileInfo ShardSnapshot::write(const std::string& path, const std::string& name, int64_t block_nbytes,
                                   WriteProfile* profile) {
  if (device_staged_) {
    ShardFileInfo info = write_through_ring(path, name, *filler_, file_nbytes_, block_nbytes, profile);
    filler_.reset();  // frees the device copy (its reads on the side stream are recorded with the allocator)
    return info;
  }
  return write_image(path, name, *filler_, [&](int64_t k) { return chunks_[static_cast<size_t>(k)]->data; },
                     [](int64_t) {}, file_nbytes_, block_nbytes, profile);
}

}  // namespace bmt::checkpoint
