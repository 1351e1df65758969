// Checksumming a shard file's bytes on worker threads (torch-free).
//
// A checkpoint records a CRC-32 per checksum block of B bytes and one of the whole file. The blocks are
// independent, so the bytes of a buffer are cut into segments that never cross a block boundary, each segment is
// checksummed on a worker thread, and BlockCrcAccumulator joins the segment CRCs in file order (crc32_combine)
// into the block CRCs and the whole-file CRC. Every byte is read once, by one worker.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/metadata.h"

namespace bmt::checkpoint {

// A fixed set of threads running submitted tasks in order of submission.
class WorkerPool {
 public:
  explicit WorkerPool(int num_threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  std::future<void> submit(std::function<void()> task);
  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  std::vector<std::thread> threads_;
  std::deque<std::packaged_task<void()>> queue_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
};

// The process's checksum workers: min(8, max(1, hardware threads / 2)), or BMT_CKPT_CRC_THREADS.
WorkerPool& crc_pool();

struct CrcSegment {
  int64_t file_offset = 0, nbytes = 0;
  uint32_t crc = 0;
};

// Segments of [file_offset, file_offset + nbytes) cut at block boundaries (B bytes) and every max_nbytes.
std::vector<CrcSegment> cut_segments(int64_t file_offset, int64_t nbytes, int64_t block_nbytes, int64_t max_nbytes);

// Checksums the bytes data[0, nbytes) (file bytes [file_offset, ...)) on the pool; the future's segments are in
// file order. `data` must stay valid until the future is ready.
std::future<std::vector<CrcSegment>> checksum_async(WorkerPool& pool, const char* data, int64_t file_offset,
                                                    int64_t nbytes, int64_t block_nbytes);

// Joins segments given in file order (no gaps) into block CRCs and the whole-file CRC.
class BlockCrcAccumulator {
 public:
  explicit BlockCrcAccumulator(int64_t block_nbytes) : B_(block_nbytes), block_join_(block_nbytes) {}
  void add(const CrcSegment& s);
  void finish(ShardFileInfo& info);  // nbytes, crc32, block_crc32
  int64_t position_nbytes() const { return pos_; }

 private:
  void close_block(int64_t nbytes);
  const Crc32Combiner& combiner(int64_t nbytes);
  int64_t B_, pos_ = 0;
  uint32_t cur_ = 0, whole_ = 0;
  std::vector<uint32_t> blocks_;
  Crc32Combiner block_join_;
  std::map<int64_t, std::unique_ptr<Crc32Combiner>> segment_join_;
};

}  // namespace bmt::checkpoint
