#include "bmt/engine/cuda_graph_step.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <sstream>
#include <utility>

#include "bmt/engine/block.h"
#include "bmt/engine/block_internal.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/pending_update.h"
#include "bmt/runtime/stream_sync.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bmt {
namespace {

void notice(const std::string& msg) {
  const int rank = is_initialized() ? config().rank : 0;
  std::fprintf(stderr, "[bmt rank %d] CudaGraphStep: %s\n", rank, msg.c_str());
  std::fflush(stderr);
}

c10::Device step_device(const std::vector<at::Tensor>& inputs) {
  if (is_initialized()) return config().device;
  for (const at::Tensor& t : inputs)
    if (t.defined()) return t.device();
  return c10::Device(c10::kCPU);
}

}  // namespace

#ifdef BMT_WITH_CUDA
namespace {

std::string signature_of(const std::vector<at::Tensor>& inputs, double key) {
  std::ostringstream s;
  s.precision(17);
  s << "key " << key;
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) {
      s << " | undefined";
      continue;
    }
    s << " | " << c10::toString(t.scalar_type()) << " " << t.device() << " " << t.sizes();
  }
  return s.str();
}

std::string cuda_error_text(cudaError_t e) {
  return core::concat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Waits for `stream` and raises a CUDA error (sticky or not) as bmt::core::Error naming `what`.
void check_stream(const c10::cuda::CUDAStream& stream, const std::string& what) {
  const cudaError_t sync = cudaStreamSynchronize(stream.stream());
  const cudaError_t last = cudaGetLastError();
  BMT_CHECK(sync == cudaSuccess && last == cudaSuccess, "CudaGraphStep: CUDA error after ", what, ": ",
            cuda_error_text(sync != cudaSuccess ? sync : last));
}

// The ZeRO and tensor-parallel communication streams: forked into a capture at its start (so that a wait on them
// inside the capture waits on captured work) and joined back at its end (a capture must end on every stream it
// reached).
std::vector<c10::Stream> comm_streams() {
  std::vector<c10::Stream> out;
  if (!is_initialized()) return out;
  const Config& cfg = config();
  for (const auto& s : {cfg.load_stream, cfg.tp_comm_stream})
    if (s) out.push_back(*s);
  return out;
}

// Runs on `side` for the scope: `side` waits for the caller's current stream first, the caller's stream waits
// for `side` at the end.
class SideStreamScope {
 public:
  explicit SideStreamScope(const c10::cuda::CUDAStream& side)
      : caller_(c10::cuda::getCurrentCUDAStream(side.device_index())), side_(side), guard_(side) {
    at::cuda::CUDAEvent e;
    e.record(caller_);
    e.block(side_);
  }
  ~SideStreamScope() {
    try {
      at::cuda::CUDAEvent e;
      e.record(side_);
      e.block(caller_);
    } catch (...) {
    }
  }
  const c10::cuda::CUDAStream& caller() const { return caller_; }
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;

 private:
  c10::cuda::CUDAStream caller_, side_;
  c10::cuda::CUDAStreamGuard guard_;
};

}  // namespace

struct CudaGraphStep::Impl {
  explicit Impl(c10::Device device)
      : device(device), side(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  c10::Device device;
  c10::cuda::CUDAStream side;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  std::vector<at::Tensor> static_inputs, static_outputs;
};
#else
struct CudaGraphStep::Impl {};
#endif

CudaGraphStep::CudaGraphStep(GraphStepFn fn, CudaGraphOptions options) : fn_(std::move(fn)), options_(options) {
  BMT_CHECK(fn_ != nullptr, "CudaGraphStep: the step function is empty");
  if (const char* env = std::getenv("BMT_CUDA_GRAPHS_CHECK"); env && std::string(env) == "1")
    options_.check_errors = true;
  BMT_CHECK(options_.warmup_steps >= 1, "CudaGraphStep: warmup_steps must be >= 1 (lazily allocated buffers must "
            "exist before the capture), got ", options_.warmup_steps);
}

CudaGraphStep::~CudaGraphStep() = default;

bool CudaGraphStep::captured() const {
#ifdef BMT_WITH_CUDA
  return impl_ && impl_->graph != nullptr;
#else
  return false;
#endif
}

void CudaGraphStep::reset() {
#ifdef BMT_WITH_CUDA
  if (impl_) {
    impl_->graph.reset();
    impl_->static_inputs.clear();
    impl_->static_outputs.clear();
  }
#endif
  signature_.clear();
  eager_with_signature_ = 0;
}

void CudaGraphStep::disable(const std::string& why) {
  if (!disabled_reason_.empty()) return;
  disabled_reason_ = why;
  notice("CUDA graphs off, every step runs eagerly: " + why);
}

std::vector<at::Tensor> CudaGraphStep::run_eager(const std::vector<at::Tensor>& inputs) {
  ++num_eager_;
  last_mode_ = "eager";
  return fn_(inputs);
}

#ifndef BMT_WITH_CUDA
std::vector<at::Tensor> CudaGraphStep::operator()(const std::vector<at::Tensor>& inputs, double) {
  if (disabled_reason_.empty()) {
    const c10::Device dev = step_device(inputs);
    disable(dev.is_cuda() ? "this build of bmtrain has no CUDA (configure with -DBMT_WITH_CUDA=ON)"
                          : "the device is " + dev.str() + ", not CUDA");
  }
  return run_eager(inputs);
}
#else
std::vector<at::Tensor> CudaGraphStep::operator()(const std::vector<at::Tensor>& inputs, double key) {
  if (!disabled_reason_.empty()) return run_eager(inputs);
  const c10::Device dev = step_device(inputs);
  if (!dev.is_cuda()) {
    disable("the device is " + dev.str() + ", not CUDA");
    return run_eager(inputs);
  }
  for (size_t i = 0; i < inputs.size(); ++i)
    BMT_CHECK(inputs[i].defined() && inputs[i].device() == dev, "CudaGraphStep: input ", i, " is ",
              inputs[i].defined() ? "on " + inputs[i].device().str() : std::string("undefined"), ", expected a tensor "
              "on ", dev.str(), " (a replayed graph reads a device copy of every input: move the inputs there first)");
  if (!impl_) impl_ = std::make_unique<Impl>(dev);
  Impl& im = *impl_;

  // Steps whose host work differs from a normal step: eager, without touching the graph.
  if (!grad_sync_enabled() || num_pending_updates() > 0) {
    if (options_.verbose)
      notice(!grad_sync_enabled() ? "eager step: gradient reduction is deferred (GradSyncGuard)"
                                  : "eager step: an asynchronous optimizer update is still pending");
    return run_eager(inputs);
  }

  const std::string sig = signature_of(inputs, key);
  if (sig != signature_) {
    if (im.graph && options_.verbose) notice("signature changed (" + signature_ + " -> " + sig + "): graph dropped");
    reset();
    signature_ = sig;
  }

  // A replayed graph launches its collectives without asking the communicators: ask them here (a peer that died
  // aborted them; replaying on an aborted communicator would run on freed NCCL state).
  if (is_initialized()) check_communicators_alive(config(), "CudaGraphStep");

  if (im.graph) {  // replay
    SideStreamScope scope(im.side);
    for (size_t i = 0; i < inputs.size(); ++i) im.static_inputs[i].copy_(inputs[i]);
    im.graph->replay();
    if (options_.check_errors) check_stream(im.side, core::concat("replay ", num_replays_ + 1));
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : im.static_outputs) {
      at::Tensor c = t.defined() ? t.clone() : t;
      if (c.defined()) c.record_stream(scope.caller());
      out.push_back(c);
    }
    ++num_replays_;
    last_mode_ = "graph";
    return out;
  }

  if (eager_with_signature_ < options_.warmup_steps) {  // warm-up on the side stream, as the capture will run
    ++eager_with_signature_;
    at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(dev.index());
    const uint64_t rng_before = gen.get<at::CUDAGeneratorImpl>()->philox_offset_per_thread();
    const int64_t recomputes_before = detail::block_recompute_count();
    std::vector<at::Tensor> out;
    {
      SideStreamScope scope(im.side);
      out = fn_(inputs);
      for (const at::Tensor& t : out)
        if (t.defined() && t.is_cuda()) t.record_stream(scope.caller());
    }
    ++num_eager_;
    last_mode_ = "eager";
    const bool rng_used = gen.get<at::CUDAGeneratorImpl>()->philox_offset_per_thread() != rng_before;
    if (rng_used && detail::block_recompute_count() != recomputes_before)
      disable("the step draws random numbers on the device (dropout?) and Blocks recompute their forward "
              "(checkpointing): the recompute would not see the same numbers in a graph. Set dropout to 0 or "
              "turn checkpointing off to use CUDA graphs");
    return out;
  }

  // Capture, then replay once (nothing runs while capturing).
  const char* stage = "allocating the static inputs";
  const auto pool = at::cuda::graph_pool_handle();  // our id: a failed capture can close it
  bool pool_open = false;
  std::vector<at::Tensor> result;
  std::string failure;
  {
    SideStreamScope scope(im.side);
    try {
      im.static_inputs.clear();
      for (const at::Tensor& t : inputs) im.static_inputs.push_back(t.clone());
      // The warm-up's freed activations go back to the device: the graph's private pool allocates its own.
      c10::cuda::CUDACachingAllocator::emptyCache();
      im.graph = std::make_unique<at::cuda::CUDAGraph>();
      stage = "capture_begin";
      im.graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      pool_open = true;
      stage = "forking the communication streams into the capture";
      const auto calc = calc_stream();
      for (const c10::Stream& s : comm_streams()) stream_wait(s, calc);
      stage = "the step function (forward and backward) under capture";
      std::vector<at::Tensor> outs = fn_(im.static_inputs);
      stage = "joining the communication streams";
      for (const c10::Stream& s : comm_streams()) stream_wait(calc, s);
      stage = "capture_end (the capture is invalid or a stream was not joined)";
      im.graph->capture_end();
      pool_open = false;
      im.static_outputs = outs;
      stage = "the first replay";
      im.graph->replay();
      if (options_.check_errors) check_stream(im.side, "the capture and its first replay");
      for (const at::Tensor& t : outs) {
        at::Tensor c = t.defined() ? t.clone() : t;
        if (c.defined()) c.record_stream(scope.caller());
        result.push_back(c);
      }
    } catch (const c10::Error& e) {
      failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (!failure.empty()) {  // end the capture here, before the scope joins the side stream back
      const cudaError_t last = cudaGetLastError();
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      const cudaError_t q = cudaStreamIsCapturing(im.side.stream(), &status);
      std::string cleanup;
      if (q == cudaSuccess && status != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(im.side.stream(), &g);
        if (g) cudaGraphDestroy(g);
        cleanup += core::concat("; capture ended by hand: ", cuda_error_text(ended));
      }
      if (pool_open) {  // capture_end may have thrown before closing it
        try {
          c10::cuda::CUDACachingAllocator::endAllocateToPool(dev.index(), pool);
        } catch (...) {
        }
      }
      (void)cudaGetLastError();
      (void)im.graph.release();  // leaked on purpose: its destructor would tidy up a capture that never ended
      im.static_inputs.clear();
      im.static_outputs.clear();
      result.clear();
      if (failure.size() > 3000) failure = failure.substr(0, 3000) + " ...";
      notice(core::concat("capture FAILED at stage '", stage, "': ", failure, "\n  last CUDA error: ",
                          cuda_error_text(last), cleanup,
                          "\n  (a device generator that was capturing may stay in capture mode: device RNG after "
                          "this point is not trustworthy)"));
    }
  }
  if (!failure.empty()) {
    disable(core::concat("the capture failed at stage '", stage, "'"));
    return run_eager(inputs);
  }
  ++num_captures_;
  last_mode_ = "capture";
  if (options_.verbose) notice(core::concat("captured (", sig, ")"));
  return result;
}
#endif

}  // namespace bmt
