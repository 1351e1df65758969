#include "bmt/checkpoint/parallel_crc_internal.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

WorkerPool::WorkerPool(int num_threads) {
  for (int i = 0; i < std::max(1, num_threads); ++i) {
    threads_.emplace_back([this] {
      for (;;) {
        std::packaged_task<void()> task;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
          if (queue_.empty()) return;  // stop_ and nothing left
          task = std::move(queue_.front());
          queue_.pop_front();
        }
        task();  // exceptions land in the task's future
      }
    });
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

std::future<void> WorkerPool::submit(std::function<void()> task) {
  std::packaged_task<void()> pt(std::move(task));
  std::future<void> f = pt.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(pt));
  }
  cv_.notify_one();
  return f;
}

WorkerPool& crc_pool() {
  // Never destroyed: a background save may still use it while static destructors run at exit. A forked child
  // has none of the parent's threads: it gets its own pool.
  static std::mutex* m = new std::mutex;
  static WorkerPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(*m);
  if (pool == nullptr || owner != ::getpid()) {
    int n = std::min(8, std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2));
    if (const char* s = std::getenv("BMT_CKPT_CRC_THREADS"); s && std::atoi(s) > 0) n = std::atoi(s);
    pool = new WorkerPool(n);
    owner = ::getpid();
  }
  return *pool;
}

std::vector<CrcSegment> cut_segments(int64_t file_offset, int64_t nbytes, int64_t B, int64_t max_nbytes) {
  BMT_ASSERT(B > 0 && max_nbytes > 0 && nbytes >= 0, "bad checksum segment arguments");
  std::vector<CrcSegment> out;
  int64_t pos = file_offset;
  const int64_t end = file_offset + nbytes;
  while (pos < end) {
    const int64_t block_end = (pos / B + 1) * B;
    const int64_t stop = std::min({end, block_end, pos + max_nbytes});
    out.push_back({pos, stop - pos, 0});
    pos = stop;
  }
  return out;
}

std::future<std::vector<CrcSegment>> checksum_async(WorkerPool& pool, const char* data, int64_t file_offset,
                                                    int64_t nbytes, int64_t block_nbytes) {
  constexpr int64_t kTaskNbytes = int64_t{4} << 20;  // enough tasks per chunk to keep every worker busy
  auto segs = std::make_shared<std::vector<CrcSegment>>(cut_segments(file_offset, nbytes, block_nbytes, kTaskNbytes));
  auto parts = std::make_shared<std::vector<std::future<void>>>();
  // Segments grouped into tasks of about kTaskNbytes each.
  size_t first = 0;
  while (first < segs->size()) {
    size_t last = first;
    int64_t sum = 0;
    while (last < segs->size() && (last == first || sum + (*segs)[last].nbytes <= kTaskNbytes)) sum += (*segs)[last++].nbytes;
    parts->push_back(pool.submit([segs, first, last, data, file_offset] {
      for (size_t i = first; i < last; ++i) {
        CrcSegment& s = (*segs)[i];
        s.crc = crc32(data + (s.file_offset - file_offset), static_cast<size_t>(s.nbytes));
      }
    }));
    first = last;
  }
  return std::async(std::launch::deferred, [segs, parts] {
    for (auto& p : *parts) p.get();
    return std::move(*segs);
  });
}

const Crc32Combiner& BlockCrcAccumulator::combiner(int64_t nbytes) {
  auto& c = segment_join_[nbytes];
  if (!c) {
    if (segment_join_.size() > 64) {  // odd sizes (block tails): do not keep them all
      segment_join_.clear();
      auto& d = segment_join_[nbytes];
      d = std::make_unique<Crc32Combiner>(nbytes);
      return *d;
    }
    c = std::make_unique<Crc32Combiner>(nbytes);
  }
  return *c;
}

void BlockCrcAccumulator::add(const CrcSegment& s) {
  BMT_ASSERT(s.file_offset == pos_, "checksum segments out of order: at ", pos_, ", got ", s.file_offset);
  BMT_ASSERT(s.nbytes > 0 && (pos_ % B_) + s.nbytes <= B_, "checksum segment crosses a block boundary");
  cur_ = pos_ % B_ == 0 ? s.crc : combiner(s.nbytes).combine(cur_, s.crc);
  pos_ += s.nbytes;
  if (pos_ % B_ == 0) close_block(B_);
}

void BlockCrcAccumulator::close_block(int64_t nbytes) {
  blocks_.push_back(cur_);
  whole_ = nbytes == B_ ? block_join_.combine(whole_, cur_) : crc32_combine(whole_, cur_, nbytes);
  cur_ = 0;
}

void BlockCrcAccumulator::finish(ShardFileInfo& info) {
  if (pos_ % B_ != 0) close_block(pos_ % B_);
  info.nbytes = pos_;
  info.crc32 = whole_;
  info.block_crc32 = std::move(blocks_);
}

}  // namespace bmt::checkpoint
