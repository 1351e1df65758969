#include "bmt/checkpoint/shard_writer_internal.h"

#include <algorithm>
#include <future>
#include <unordered_map>

#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace {

// CRC-32 per block of B bytes and of the whole stream, fed sequentially. Each byte is checksummed once: the
// whole-stream CRC is combined from the block CRCs (crc32_combine).
class BlockCrc {
 public:
  explicit BlockCrc(int64_t block_nbytes) : B_(block_nbytes) {}
  void feed(const char* p, int64_t n) {
    while (n > 0) {
      const int64_t take = std::min(n, B_ - pos_ % B_);
      cur_ = crc32_update(cur_, p, static_cast<size_t>(take));
      pos_ += take;
      p += take;
      n -= take;
      if (pos_ % B_ == 0) close_block(B_);
    }
  }
  void finish(ShardFileInfo& info) {
    if (pos_ % B_ != 0) close_block(pos_ % B_);
    info.nbytes = pos_;
    info.crc32 = whole_;
    info.block_crc32 = std::move(blocks_);
  }

 private:
  void close_block(int64_t nbytes) {
    blocks_.push_back(cur_);
    whole_ = crc32_combine(whole_, cur_, nbytes);
    cur_ = 0;
  }
  int64_t B_, pos_ = 0;
  uint32_t cur_ = 0, whole_ = 0;
  std::vector<uint32_t> blocks_;
};

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

int64_t snapshot_to_host(std::vector<WriteItem>& items) {
  int64_t nbytes = 0;
  for (WriteItem& it : items) {
    if (it.private_copy && it.src.is_cpu()) {  // already a host copy of its own (e.g. an optimizer state dict)
      nbytes += (it.src_end - it.src_begin) * static_cast<int64_t>(it.src.element_size());
      continue;
    }
    at::Tensor piece = it.src.reshape({-1}).narrow(0, it.src_begin, it.src_end - it.src_begin);
    at::TensorOptions opts = piece.options().device(at::kCPU);
    if (piece.is_cuda()) opts = opts.pinned_memory(true);
    at::Tensor host = at::empty({piece.numel()}, opts);
    host.copy_(piece);  // blocking: the buffers are complete before another thread reads them
    it.src = host;
    it.src_end -= it.src_begin;
    it.src_begin = 0;
    nbytes += host.nbytes();
  }
  return nbytes;
}

ShardFileInfo write_shard_file(const std::string& path, const std::string& name, const std::vector<WriteItem>& items,
                               int64_t file_nbytes, int64_t block_nbytes) {
  ShardFileInfo info;
  info.name = name;
  BlockCrc crc(block_nbytes);
  OutFile out(path);
  std::vector<char> zeros;
  for (const WriteItem& it : items) {
    const int64_t gap = it.byte_offset - out.position_nbytes();
    BMT_ASSERT(gap >= 0, "write items out of order in ", path);
    if (gap > 0) {
      zeros.assign(static_cast<size_t>(gap), 0);
      crc.feed(zeros.data(), gap);
      out.write(zeros.data(), gap);
    }
    const int64_t elem = static_cast<int64_t>(it.src.element_size());
    const int64_t chunk_numel = std::max<int64_t>(1, kCopyChunkNbytes / elem);
    for (int64_t a = it.src_begin; a < it.src_end; a += chunk_numel) {
      const int64_t b = std::min(it.src_end, a + chunk_numel);
      at::Tensor bytes = detail::byte_view(it.src, a, b);
      if (!bytes.is_cpu()) bytes = bytes.to(at::kCPU);
      const char* p = static_cast<const char*>(bytes.data_ptr());
      // Checksum on a second thread while this one writes the same bytes (CRC and disk each ~1-2 GB/s).
      std::future<void> summed = std::async(std::launch::async, [&crc, p, n = bytes.numel()] { crc.feed(p, n); });
      try {
        out.write(p, bytes.numel());
      } catch (...) {
        summed.wait();
        throw;
      }
      summed.get();
    }
  }
  BMT_ASSERT(out.position_nbytes() == file_nbytes, "wrote ", out.position_nbytes(), " bytes to ", path, ", planned ",
             file_nbytes);
  out.sync();
  out.close();
  crc.finish(info);
  return info;
}

}  // namespace bmt::checkpoint
