#include "bmt/checkpoint/staged_appender_internal.h"

#include <algorithm>
#include <cstring>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

StagedAppender::StagedAppender(TensorFileWriter& writer, int64_t chunk_nbytes, bool pinned)
    : writer_(writer), half_(std::max<int64_t>(1, chunk_nbytes / 2)) {
  for (HostChunk& b : bufs_) b = allocate_host_buffer(half_, pinned);
}

StagedAppender::~StagedAppender() {
  if (last_.valid()) last_.wait();
}

void StagedAppender::submit(const char* data, int64_t nbytes, at::Tensor hold) {
  std::shared_future<void> prev = last_;
  TensorFileWriter* w = &writer_;
  last_ = std::async(std::launch::async, [prev, w, data, nbytes, hold = std::move(hold)] {
            if (prev.valid()) prev.get();  // in order; an earlier failure stops the rest
            w->append(data, nbytes);
          }).share();
}

void StagedAppender::flush() {
  if (fill_ == 0) return;
  submit(bufs_[cur_].data, fill_, at::Tensor());
  written_[cur_] = last_;
  cur_ ^= 1;
  fill_ = 0;
  if (written_[cur_].valid()) written_[cur_].wait();  // the other buffer is free again
}

at::Tensor StagedAppender::reserve(int64_t n) {
  BMT_ASSERT(n >= 0 && n <= half_, "StagedAppender::reserve of ", n, " bytes, buffers hold ", half_);
  if (fill_ + n > half_) flush();
  at::Tensor t = bufs_[cur_].buf.narrow(0, fill_, n);
  fill_ += n;
  return t;
}

void StagedAppender::append(const at::Tensor& bytes) {
  const int64_t n = bytes.numel();
  if (n <= half_) {
    at::Tensor dst = reserve(n);
    std::memcpy(dst.data_ptr(), bytes.data_ptr(), static_cast<size_t>(n));
    return;
  }
  flush();
  submit(static_cast<const char*>(bytes.data_ptr()), n, bytes);
}

void StagedAppender::finish() {
  flush();
  if (last_.valid()) last_.get();
}

}  // namespace bmt::checkpoint
