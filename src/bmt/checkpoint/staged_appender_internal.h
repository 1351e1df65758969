// Rank 0's bytes of a consolidated file (bmt::save), staged in two host buffers of half a chunk each (pinned when
// the tensors are on a GPU, so device → host copies run at full speed): one is filled (copies, receives from the
// other ranks) while the other is written by a background thread, so fetching and writing overlap and rank 0
// still holds one chunk. The writer's append() runs on that thread, one call at a time, in order.
#pragma once

#include <ATen/ATen.h>

#include <future>

#include "bmt/checkpoint/host_staging_internal.h"
#include "bmt/checkpoint/tensor_file.h"

namespace bmt::checkpoint {

class StagedAppender {
 public:
  StagedAppender(TensorFileWriter& writer, int64_t chunk_nbytes, bool pinned);
  ~StagedAppender();  // waits for the write in flight (errors are finish()'s)
  StagedAppender(const StagedAppender&) = delete;
  StagedAppender& operator=(const StagedAppender&) = delete;

  int64_t buffer_nbytes() const { return half_; }
  // The next n (<= buffer_nbytes()) bytes of the file, to be filled before the next call; a full buffer goes to
  // the writer first.
  at::Tensor reserve(int64_t n);
  // The next bytes, from `bytes` (uint8, contiguous): copied when they fit a buffer, else written from `bytes`.
  void append(const at::Tensor& bytes);
  // Writes what is left and waits; throws the first write error.
  void finish();

 private:
  void submit(const char* data, int64_t nbytes, at::Tensor hold);
  void flush();

  TensorFileWriter& writer_;
  int64_t half_;
  HostChunk bufs_[2];
  std::shared_future<void> written_[2];  // the last write from each buffer
  std::shared_future<void> last_;        // the last write submitted
  int cur_ = 0;
  int64_t fill_ = 0;
};

}  // namespace bmt::checkpoint
