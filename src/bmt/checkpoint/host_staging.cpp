#include "bmt/checkpoint/host_staging_internal.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>

#include "bmt/checkpoint/parallel_crc_internal.h"
#include "bmt/core/error.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bmt::checkpoint {
namespace {

// Never destroyed: an async save still writing from them at program end (its handle's destructor joins the
// writer during static destruction) must not see them freed.
std::mutex& g_chunks_mutex = *new std::mutex;
std::vector<std::unique_ptr<HostChunk>>& g_chunks = *new std::vector<std::unique_ptr<HostChunk>>;
int64_t g_chunk_nbytes = kDefaultStageChunkNbytes;

HostChunk make_chunk(bool pinned) { return allocate_host_buffer(g_chunk_nbytes, pinned); }

// The background preparation (prepare_host_chunks), if one was started and not yet waited for.
std::mutex& g_prepare_mutex = *new std::mutex;
std::shared_future<void>& g_prepared = *new std::shared_future<void>;
std::function<void(int64_t)>& g_prepare_hook = *new std::function<void(int64_t)>;

// Waits for the preparation in flight (none: returns at once). Its errors were dropped there: whoever needs the
// chunks allocates what is missing itself and reports that error in its own context.
void wait_prepared() {
  std::shared_future<void> f;
  {
    std::lock_guard<std::mutex> lock(g_prepare_mutex);
    f = g_prepared;
    g_prepared = std::shared_future<void>();
  }
  if (f.valid()) f.wait();
}

}  // namespace

void prepare_host_chunks(int64_t n, bool pinned) {
#ifndef BMT_WITH_CUDA
  pinned = false;
#endif
  wait_prepared();  // one preparation at a time
  std::lock_guard<std::mutex> lock(g_prepare_mutex);
  std::function<void(int64_t)> hook = g_prepare_hook;
  g_prepared = std::async(std::launch::async, [n, pinned, hook] {
                 try {
                   for (int64_t i = 0; i < n; ++i) {
                     int64_t nbytes = 0;
                     {
                       std::lock_guard<std::mutex> chunks_lock(g_chunks_mutex);
                       const size_t k = static_cast<size_t>(i);
                       if (k < g_chunks.size() && g_chunks[k]->pinned == pinned) continue;
                       nbytes = g_chunk_nbytes;
                     }
                     if (hook) hook(i);
                     // The slow part (pinning runs at a few GB/s), outside the lock.
                     auto chunk = std::make_unique<HostChunk>(allocate_host_buffer(nbytes, pinned));
                     std::lock_guard<std::mutex> chunks_lock(g_chunks_mutex);
                     const size_t k = static_cast<size_t>(i);
                     if (nbytes != g_chunk_nbytes || k > g_chunks.size()) return;  // resized meanwhile
                     if (k == g_chunks.size()) g_chunks.push_back(std::move(chunk));
                     else *g_chunks[k] = std::move(*chunk);
                   }
                 } catch (...) {  // out of pinned memory: borrow_host_chunks retries and reports it
                 }
               }).share();
}

bool host_chunks_prepared() {
  std::lock_guard<std::mutex> lock(g_prepare_mutex);
  return !g_prepared.valid() || g_prepared.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

bool host_chunks_ready(int64_t n, bool pinned) {
#ifndef BMT_WITH_CUDA
  pinned = false;
#endif
  if (!host_chunks_prepared()) return false;
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
  if (static_cast<int64_t>(g_chunks.size()) < n) return false;
  for (int64_t i = 0; i < n; ++i)
    if (g_chunks[static_cast<size_t>(i)]->pinned != pinned) return false;
  return true;
}

std::optional<std::vector<ImagePiece>> copy_pieces_for_device_staging(const std::vector<ImagePiece>& pieces) {
#ifdef BMT_WITH_CUDA
  int64_t device_nbytes = 0;
  int device = -1;
  for (const ImagePiece& p : pieces) {
    if (p.bytes.is_cpu()) continue;
    if (!p.bytes.is_cuda() || (device >= 0 && device != p.bytes.device().index())) return std::nullopt;
    device = p.bytes.device().index();
    device_nbytes += p.bytes.numel();
  }
  if (device < 0) return std::nullopt;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // Room: the copy stays allocated while later steps run, so it must fit beside their peak.
  size_t free_nbytes = 0, total_nbytes = 0;
  if (cudaMemGetInfo(&free_nbytes, &total_nbytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t allocated = stats.allocated_bytes[agg].current, peak = stats.allocated_bytes[agg].peak;
  const int64_t cached_unused = stats.reserved_bytes[agg].current - allocated;
  const int64_t available = static_cast<int64_t>(free_nbytes) + cached_unused - static_cast<int64_t>(total_nbytes / 20);
  if (device_nbytes + (peak - allocated) > available) return std::nullopt;
  at::Tensor buf;
  try {
    buf = at::empty({device_nbytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  } catch (const c10::OutOfMemoryError&) {
    return std::nullopt;
  }
  std::vector<ImagePiece> out;
  out.reserve(pieces.size());
  int64_t off = 0;
  for (const ImagePiece& p : pieces) {
    if (p.bytes.is_cpu()) {
      out.push_back({p.file_offset, p.bytes.clone()});
      continue;
    }
    at::Tensor dst = buf.narrow(0, off, p.bytes.numel());
    dst.copy_(p.bytes);  // on the current stream: ordered before the next training step's kernels
    off += p.bytes.numel();
    out.push_back({p.file_offset, dst});
  }
  return out;
#else
  (void)pieces;
  return std::nullopt;
#endif
}

void set_prepare_hook(std::function<void(int64_t)> hook) {
  std::lock_guard<std::mutex> lock(g_prepare_mutex);
  g_prepare_hook = std::move(hook);
}

int64_t host_chunk_count() {
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
  return static_cast<int64_t>(g_chunks.size());
}

HostChunk allocate_host_buffer(int64_t nbytes, bool pinned) {
  HostChunk c;
  c.pinned = pinned;
#ifdef BMT_WITH_CUDA
  if (pinned) {
    // cudaHostAlloc of exactly the size: torch's pinned allocator would round up and cache on its own.
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, static_cast<size_t>(nbytes), cudaHostAllocDefault);
    BMT_CHECK(err == cudaSuccess, "checkpoint I/O: cannot pin ", nbytes >> 20, " MiB of host memory for "
              "a staging buffer (", cudaGetErrorString(err), "); the host is out of memory or the lock limit (ulimit "
              "-l) is low. An async save needs its whole shard file in pinned memory: release_snapshot_buffers() "
              "frees it, or save synchronously");
    c.buf = at::from_blob(p, {nbytes}, [](void* q) { cudaFreeHost(q); }, at::TensorOptions().dtype(at::kByte));
    c.data = static_cast<char*>(p);
    return c;
  }
#endif
  c.pinned = false;
  void* p = nullptr;  // page-aligned: O_DIRECT writes (BMT_CKPT_DIRECT=1) need it
  BMT_CHECK(::posix_memalign(&p, 4096, static_cast<size_t>(nbytes)) == 0, "checkpoint I/O: cannot allocate ",
            nbytes >> 20, " MiB of host memory for a staging buffer");
  c.buf = at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
  c.data = static_cast<char*>(p);
  return c;
}

std::vector<HostChunk*> borrow_host_chunks(int64_t n, bool pinned) {
  wait_prepared();  // a save started before the background preparation ended takes its chunks, not new ones
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
#ifndef BMT_WITH_CUDA
  pinned = false;
#endif
  std::vector<HostChunk*> out;
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int64_t>(g_chunks.size()) <= i) g_chunks.push_back(std::make_unique<HostChunk>(make_chunk(pinned)));
    else if (g_chunks[static_cast<size_t>(i)]->pinned != pinned) *g_chunks[static_cast<size_t>(i)] = make_chunk(pinned);
    out.push_back(g_chunks[static_cast<size_t>(i)].get());
  }
  return out;
}

void free_host_chunks() {
  wait_prepared();
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
  g_chunks.clear();
}

int64_t stage_chunk_nbytes() {
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
  return g_chunk_nbytes;
}

void set_stage_chunk_nbytes(int64_t nbytes) {
  BMT_CHECK(nbytes > 0, "set_stage_chunk_nbytes: must be positive");
  wait_prepared();
  std::lock_guard<std::mutex> lock(g_chunks_mutex);
  g_chunks.clear();
  g_chunk_nbytes = nbytes;
}

struct ImageFiller::Device {
#ifdef BMT_WITH_CUDA
  explicit Device(int index)
      : stream(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(index))) {
    // The copies start after everything already issued on the compute stream (the last optimizer step).
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)));
    ready.block(stream);
  }
  c10::cuda::CUDAStream stream;
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> done;  // per chunk (null: no device copy)
#endif
};

ImageFiller::ImageFiller(std::vector<ImagePiece> pieces, int64_t file_nbytes)
    : pieces_(std::move(pieces)), file_nbytes_(file_nbytes), C_(stage_chunk_nbytes()) {
  for (const ImagePiece& p : pieces_) {
    BMT_ASSERT(ends_.empty() || p.file_offset >= ends_.back(), "image pieces out of order");
    ends_.push_back(p.file_offset + p.bytes.numel());
    BMT_ASSERT(ends_.back() <= file_nbytes_, "image piece past the end of the file");
    if (!p.bytes.is_cpu()) {
      BMT_CHECK(p.bytes.is_cuda(), "checkpoint save: tensors on ", p.bytes.device(), " are not supported (CPU or CUDA)");
      BMT_CHECK(device_index_ < 0 || device_index_ == p.bytes.device().index(),
                "checkpoint save: one rank's tensors are on several GPUs (", device_index_, " and ",
                p.bytes.device().index(), ")");
      device_index_ = p.bytes.device().index();
    }
  }
#ifdef BMT_WITH_CUDA
  if (device_index_ >= 0) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    dev_ = std::make_unique<Device>(device_index_);
  }
#endif
  host_done_.resize(static_cast<size_t>(num_chunks()));
}

ImageFiller::~ImageFiller() {
  for (auto& f : host_done_)
    if (f.valid()) f.wait();  // a worker may still be copying into a chunk
#ifdef BMT_WITH_CUDA
  // After a failed write: no copy may land in a chunk the next save uses. A CUDA error here (the device is already
  // broken) must not escape a destructor: the error that got us here is being reported.
  if (dev_) {
    try {
      dev_->stream.synchronize();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bmt::checkpoint: synchronizing the staging stream failed: %s\n", e.what());
    }
  }
#endif
}

int64_t ImageFiller::chunk_nbytes(int64_t k) const {
  return std::min(C_, file_nbytes_ - k * C_);
}

void ImageFiller::fill(int64_t k, char* dst) {
  const int64_t lo = k * C_, hi = lo + chunk_nbytes(k);
  struct HostCopy {
    char* dst;
    const char* src;  // nullptr: zeros
    int64_t nbytes;
  };
  std::vector<HostCopy> host;
  bool device_copy = false;
  int64_t pos = lo;
  const size_t first = static_cast<size_t>(std::upper_bound(ends_.begin(), ends_.end(), lo) - ends_.begin());
  for (size_t i = first; i < pieces_.size() && pieces_[i].file_offset < hi; ++i) {
    const ImagePiece& p = pieces_[i];
    const int64_t a = std::max(lo, p.file_offset), b = std::min(hi, ends_[i]);
    if (a > pos) host.push_back({dst + (pos - lo), nullptr, a - pos});
    if (b > a) {
      if (p.bytes.is_cpu()) {
        host.push_back({dst + (a - lo), static_cast<const char*>(p.bytes.data_ptr()) + (a - p.file_offset), b - a});
      } else {
#ifdef BMT_WITH_CUDA
        c10::cuda::CUDAStreamGuard guard(dev_->stream);
        at::Tensor src = p.bytes.narrow(0, a - p.file_offset, b - a);
        at::Tensor to = at::from_blob(dst + (a - lo), {b - a}, at::TensorOptions().dtype(at::kByte));
        to.copy_(src, /*non_blocking=*/true);  // pinned destination: asynchronous on the side stream
        // byte_view may have made a temporary: keep the allocator from reusing it before the side stream read it.
        c10::cuda::CUDACachingAllocator::recordStream(p.bytes.storage().data_ptr(), dev_->stream);
        device_copy = true;
#endif
      }
    }
    pos = std::max(pos, b);
  }
  if (hi > pos) host.push_back({dst + (pos - lo), nullptr, hi - pos});
#ifdef BMT_WITH_CUDA
  if (dev_) {
    if (static_cast<int64_t>(dev_->done.size()) <= k) dev_->done.resize(static_cast<size_t>(k + 1));
    dev_->done[static_cast<size_t>(k)].reset();
    if (device_copy) {
      dev_->done[static_cast<size_t>(k)] = std::make_unique<at::cuda::CUDAEvent>();
      dev_->done[static_cast<size_t>(k)]->record(dev_->stream);
    }
  }
#endif
  (void)device_copy;
  if (host.empty()) {
    host_done_[static_cast<size_t>(k)] = std::future<void>();
    return;
  }
  host_done_[static_cast<size_t>(k)] = crc_pool().submit([host = std::move(host)] {
    for (const HostCopy& c : host) {
      if (c.src) std::memcpy(c.dst, c.src, static_cast<size_t>(c.nbytes));
      else std::memset(c.dst, 0, static_cast<size_t>(c.nbytes));
    }
  });
}

void ImageFiller::wait(int64_t k) {
  auto& f = host_done_[static_cast<size_t>(k)];
  if (f.valid()) f.get();
#ifdef BMT_WITH_CUDA
  if (dev_ && k < static_cast<int64_t>(dev_->done.size()) && dev_->done[static_cast<size_t>(k)])
    dev_->done[static_cast<size_t>(k)]->synchronize();
#endif
}

void ImageFiller::wait_host_copies() {
  for (auto& f : host_done_)
    if (f.valid()) f.get();
}

void ImageFiller::order_current_stream_after_copies() {
#ifdef BMT_WITH_CUDA
  if (!dev_) return;
  at::cuda::CUDAEvent all;
  all.record(dev_->stream);
  all.block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)));
#endif
}

}  // namespace bmt::checkpoint
