// Host staging for shard writes: the bytes of a rank's shard file ("the file image") in fixed-size host chunks
// (64 MiB),
// filled from the pieces' tensors (device → pinned host on a side stream ordered by CUDA events; host tensors
// by memcpy on the checksum workers), then written and checksummed chunk by chunk.
//
// The chunks are kept by the process and reused by the next save (pinned allocation runs at a few GB/s, more
// than a save's stall budget): a sync save uses kSyncRingChunks of them as a ring, an async save one per chunk of
// its file (its snapshot) until free_host_chunks() (release_snapshot_buffers()). Only one save uses them at a time (saves are
// serialised: save() waits for the previous async save).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <vector>

namespace bmt::checkpoint {

constexpr int64_t kDefaultStageChunkNbytes = int64_t{64} << 20;
constexpr int kSyncRingChunks = 4;
int64_t stage_chunk_nbytes();
// Tests: small chunks exercise the chunk boundaries (frees the cached chunks; no save may be in flight).
void set_stage_chunk_nbytes(int64_t nbytes);

struct HostChunk {
  at::Tensor buf;  // owns the memory
  char* data = nullptr;
  bool pinned = false;
};

// One page-aligned host buffer of nbytes (pinned when `pinned` and built with CUDA), freed with its `buf`.
HostChunk allocate_host_buffer(int64_t nbytes, bool pinned);

// The process's chunks [0, n), allocated on first use (pinned when `pinned`: CUDA pieces need it to copy
// asynchronously; chunks of the other kind are replaced).
std::vector<HostChunk*> borrow_host_chunks(int64_t n, bool pinned);
// Frees every cached chunk (call while no save is in flight).
void free_host_chunks();

// Starts allocating chunks [0, n) (pinned as above) on a background thread and returns at once, so that the first
// async save finds its buffers ready instead of pinning them inside its stall (pinning runs at a few GB/s: 7 s for
// gpt-1.3b's 18.4 GB). Call while no save is in flight. borrow_host_chunks, free_host_chunks and
// set_stage_chunk_nbytes wait for it first; a failed allocation stops it quietly (borrow_host_chunks then
// allocates the rest itself and reports the error).
void prepare_host_chunks(int64_t n, bool pinned);
// True when no preparation is running.
bool host_chunks_prepared();
// True when no preparation is running and chunks [0, n) of that kind are cached (a save borrowing them allocates
// nothing).
bool host_chunks_ready(int64_t n, bool pinned);
// Tests: called on the preparing thread before chunk i is allocated (e.g. to hold it); empty clears it.
void set_prepare_hook(std::function<void(int64_t)> hook);
// How many chunks the process holds.
int64_t host_chunk_count();

// A byte piece of the image: file bytes [file_offset, file_offset + nbytes) come from `bytes` (uint8, contiguous).
struct ImagePiece {
  int64_t file_offset = 0;
  at::Tensor bytes;
};

// The device way of an async snapshot (shard_writer_internal.h): the pieces with every CUDA piece copied into one
// new device buffer on the current stream and every host piece cloned, or nothing (no CUDA piece, a build without
// CUDA, or no room: the copy plus the growth of the caching allocator's peak over its current use must fit in the
// device's free memory plus the allocator's unused cache, with 5% of the device left over).
std::optional<std::vector<ImagePiece>> copy_pieces_for_device_staging(const std::vector<ImagePiece>& pieces);

// Fills chunk k of the image (file bytes [k*C, min((k+1)*C, file_nbytes))) into host memory: enqueues device
// copies on a side stream and host copies + zero gaps on the checksum workers. wait(k) returns when chunk k is
// complete. Chunks must be filled in increasing order.
class ImageFiller {
 public:
  ImageFiller(std::vector<ImagePiece> pieces, int64_t file_nbytes);
  ~ImageFiller();
  int64_t num_chunks() const { return (file_nbytes_ + C_ - 1) / C_; }
  int64_t chunk_offset(int64_t k) const { return k * C_; }
  int64_t chunk_nbytes(int64_t k) const;
  bool has_device_pieces() const { return device_index_ >= 0; }
  void fill(int64_t k, char* dst);
  void wait(int64_t k);
  // Waits for the host copies of every chunk filled so far (not the device copies).
  void wait_host_copies();
  // The device's current stream waits for every copy enqueued so far: kernels issued later (the next training
  // step) cannot modify the source tensors before they are copied. The host does not wait.
  void order_current_stream_after_copies();

 private:
  struct Device;
  std::vector<ImagePiece> pieces_;
  std::vector<int64_t> ends_;  // file_offset + nbytes of each piece (increasing)
  int64_t file_nbytes_;
  int64_t C_;  // chunk size
  int device_index_ = -1;
  std::unique_ptr<Device> dev_;
  std::vector<std::future<void>> host_done_;
};

}  // namespace bmt::checkpoint
