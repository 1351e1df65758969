#include "bmt/optim/adam_offload.h"

#include <ATen/core/grad_mode.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>

#include "bmt/core/error.h"
#include "bmt/optim/torch_adam.h"
#include "bmt/params/parameter.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bmt::optim {

using core::kernels::AdamTensorArgs;
using core::kernels::ThreadPool;

#ifdef BMT_WITH_CUDA
namespace {
// Pinned host memory of exactly the tensor's size. torch's pinned allocator rounds every buffer up to a power of
// two and caches it: for llama-7b that is ~12 GiB of locked host memory that no one uses.
at::Tensor pinned_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const size_t nbytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  void* ptr = nullptr;
  cudaError_t err = cudaHostAlloc(&ptr, nbytes, cudaHostAllocDefault);
  BMT_CHECK(err == cudaSuccess, "AdamOffloadOptimizer: cannot pin ", nbytes, " bytes of host memory for a staging "
            "buffer (", cudaGetErrorString(err), "); the host is out of memory or the lock limit (ulimit -l) is low");
  return at::from_blob(ptr, sizes, [](void* q) { cudaFreeHost(q); }, at::TensorOptions().dtype(dtype));
}
}  // namespace
#endif

struct AdamOffloadOptimizer::Staging {
  at::Tensor grad_host;   // pinned, gradient dtype
  at::Tensor param_host;  // pinned, parameter dtype: the kernel's output, copied back to the device
#ifdef BMT_WITH_CUDA
  at::cuda::CUDAEvent d2h_done;
#endif
};

struct AdamOffloadOptimizer::CudaStreams {
#ifdef BMT_WITH_CUDA
  std::map<int, c10::cuda::CUDAStream> copy;  // one copy stream per device, created on first use
  c10::cuda::CUDAStream copy_stream(int device) {
    auto it = copy.find(device);
    if (it == copy.end())
      it = copy.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                                             static_cast<c10::DeviceIndex>(device)))
               .first;
    return it->second;
  }
#endif
};

AdamOffloadOptimizer::AdamOffloadOptimizer(std::vector<at::Tensor> params, const AdamOptions& defaults)
    : AdamOffloadOptimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                           defaults) {}

AdamOffloadOptimizer::AdamOffloadOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                                           const AdamOptions& defaults)
    : AdamBase(param_groups, defaults), pool_(&ThreadPool::global()), cuda_(std::make_unique<CudaStreams>()) {}

AdamOffloadOptimizer::AdamOffloadOptimizer(const std::vector<ParamGroupSpec>& param_groups,
                                           const AdamOptions& defaults)
    : AdamOffloadOptimizer(make_param_groups(param_groups, defaults), defaults) {}

AdamOffloadOptimizer::~AdamOffloadOptimizer() {
  try {
    wait();
  } catch (...) {
  }
}

AdamState AdamOffloadOptimizer::new_state(const at::Tensor& p, bool uninitialized) const {
  AdamState s;
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
  s.exp_avg = uninitialized ? at::empty(p.sizes(), f32) : at::zeros(p.sizes(), f32);
  s.exp_avg_sq = uninitialized ? at::empty(p.sizes(), f32) : at::zeros(p.sizes(), f32);
  if (p.scalar_type() != at::kFloat)
    s.master = uninitialized ? at::empty(p.sizes(), f32) : p.detach().to(f32, /*non_blocking=*/false, /*copy=*/true);
  return s;
}

void AdamOffloadOptimizer::submit_chunks(PendingUpdate& update, const AdamTensorArgs& args, float inv_scale,
                                         std::function<void()> before, std::function<void()> after) {
  const int64_t chunk = core::kernels::kAdamCpuChunkElems;
  int64_t num_chunks = (args.numel + chunk - 1) / chunk;
  if (num_chunks == 0) {
    if (after) update.run(std::move(after));
    return;
  }
  auto remaining = std::make_shared<std::atomic<int64_t>>(num_chunks);
  auto before_fn = std::make_shared<std::function<void()>>(std::move(before));
  auto after_fn = std::make_shared<std::function<void()>>(std::move(after));
  const core::kernels::CpuIsa isa = core::kernels::adam_cpu_best_isa();
  for (int64_t b = 0; b < args.numel; b += chunk) {
    int64_t e = std::min(args.numel, b + chunk);
    update.run([=] {
      if (*before_fn) (*before_fn)();
      core::kernels::adam_cpu_range_isa(args, inv_scale, b, e, isa);
      if (remaining->fetch_sub(1) == 1 && *after_fn) (*after_fn)();
    });
  }
}

void AdamOffloadOptimizer::submit_fp32(PendingUpdate& update, const at::Tensor& param_data, const at::Tensor& grad,
                                       const AdamState& s, const AdamOptions& o, double lr, double loss_scale,
                                       std::function<void()> before, std::function<void()> after) {
  detail::TorchAdamScalars sc{lr, std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                              o.decoupled_weight_decay(), loss_scale};
  update.run([param_data, grad, m = s.exp_avg, v = s.exp_avg_sq, step = s.step, sc, before = std::move(before),
              after = std::move(after)] {
    if (before) before();
    detail::torch_adam_single(param_data, grad, m, v, step, sc);
    if (after) after();
  });
}

std::exception_ptr AdamOffloadOptimizer::finish(InFlight& f) {
  try {
    // A registered update: wait and drop the registration (a no-op when a Block already did). Then every update
    // (for a registered one a cheap repeat: the host part is done, the current stream waits once more).
    if (f.registered) wait_pending_update(f.param);
    f.update->wait();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr AdamOffloadOptimizer::finish_where(const std::function<bool(const InFlight&)>& which) {
  std::exception_ptr first;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (!which(it->second)) {
      ++it;
      continue;
    }
    std::exception_ptr err = finish(it->second);
    if (err && !first) first = err;
    it = in_flight_.erase(it);
  }
  return first;
}

void AdamOffloadOptimizer::start_one(const at::Tensor& p, const AdamOptions& o, double loss_scale) {
  BMT_CHECK(started_.count(p.unsafeGetTensorImpl()) == 0, "AdamOffloadOptimizer: a parameter of shape ", p.sizes(),
            " was already started in this iteration; call step() or zero_grad() to end the iteration first");
  at::Tensor grad = usable_grad(p);
  if (!grad.defined()) return;
  const void* key = p.unsafeGetTensorImpl();
  // The previous iteration's update may still run (asynchronous step): it uses the state and staging buffers too.
  if (auto prev = in_flight_.find(key); prev != in_flight_.end()) {
    std::exception_ptr err = finish(prev->second);
    in_flight_.erase(prev);
    if (err) std::rethrow_exception(err);
  }
  started_.insert(key);
  AdamState& s = state_for(p);
  s.step += 1;
  auto update = std::make_shared<PendingUpdate>(*pool_);
  InFlight& flight = in_flight_[key];
  flight.param = p;
  flight.update = update;
  flight.keep_alive = {grad, p};
  if (p.is_cpu() && p.scalar_type() == at::kFloat) {
    submit_fp32(*update, p.detach(), grad, s, o, effective_lr(p, s, o), loss_scale, nullptr, nullptr);
  } else if (p.is_cpu()) {
    AdamTensorArgs a = kernel_args(p.data_ptr(), p, grad, s, o);
    core::kernels::adam_check_args(a, "parameter");
    submit_chunks(*update, a, static_cast<float>(1.0 / loss_scale), nullptr, nullptr);
  } else {
    start_on_device(p, grad, s, o, loss_scale, *update);
  }
  // Asynchronous step: a Block parameter's update may outlive step(); the Block waits for it before gathering.
  // Registered once every task is queued, so a registered update is complete once its tasks are.
  if (async_step_ && in_block(p)) {
    set_pending_update(p, update);
    flight.registered = true;
  }
}

void AdamOffloadOptimizer::start_on_device(const at::Tensor& p, at::Tensor grad, AdamState& s, const AdamOptions& o,
                                           double loss_scale, PendingUpdate& update) {
#ifdef BMT_WITH_CUDA
  BMT_CHECK(p.is_cuda(), "AdamOffloadOptimizer: parameters on ", p.device(), " are not supported (CPU or CUDA)");
  const c10::DeviceIndex device = p.device().index();
  c10::cuda::CUDAGuard guard(device);
  // Rounded on the compute stream, before the event below. A temporary: record_stream (below) keeps the allocator
  // from reusing it before the copy stream read it.
  if (grad_transfer_dtype_ && grad.scalar_type() != *grad_transfer_dtype_) grad = grad.to(*grad_transfer_dtype_);
  auto& slot = staging_[p.unsafeGetTensorImpl()];
  if (!slot || slot->grad_host.scalar_type() != grad.scalar_type()) {
    slot = std::make_unique<Staging>();
    slot->grad_host = pinned_empty(p.sizes(), grad.scalar_type());
    slot->param_host = pinned_empty(p.sizes(), p.scalar_type());
  }
  Staging* st = slot.get();
  c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device);
  c10::cuda::CUDAStream copy = cuda_->copy_stream(device);
  if (grad_transfer_dtype_) grad.record_stream(copy);  // a temporary read by the copy stream
  at::cuda::CUDAEvent grads_ready;
  grads_ready.record(compute);
  grads_ready.block(copy);
  {
    c10::cuda::CUDAStreamGuard on_copy(copy);
    st->grad_host.copy_(grad.view(p.sizes()), /*non_blocking=*/true);
    if (p.scalar_type() == at::kFloat) st->param_host.copy_(p.detach(), /*non_blocking=*/true);
    st->d2h_done.record(copy);
  }
  copies_queued_ = true;
  // The storage p points at now: a Block re-points p (set_data) while it runs, the copy back must reach the shard.
  at::Tensor target = p.detach();
  PendingUpdate* done = &update;  // outlives its tasks (its destructor waits for them)
  auto before = [st] { st->d2h_done.synchronize(); };
  auto after = [st, target, device, copy, done] {
    at::NoGradGuard no_grad;
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::CUDAStreamGuard on_copy(copy);
    target.copy_(st->param_host, /*non_blocking=*/true);
    done->record_copy_back(copy.unwrap());
  };
  if (p.scalar_type() == at::kFloat) {
    submit_fp32(update, st->param_host, st->grad_host, s, o, effective_lr(p, s, o), loss_scale, before, after);
    return;
  }
  AdamTensorArgs a = kernel_args(st->param_host.data_ptr(), p, st->grad_host, s, o);
  core::kernels::adam_check_args(a, "parameter");
  submit_chunks(update, a, static_cast<float>(1.0 / loss_scale), before, after);
#else
  (void)grad, (void)s, (void)o, (void)loss_scale, (void)update;
  BMT_ERROR("AdamOffloadOptimizer: parameters on ", p.device(),
            " need a bmtrain build with CUDA (BMT_WITH_CUDA); this build handles CPU parameters only");
#endif
}

void AdamOffloadOptimizer::set_grad_transfer_dtype(std::optional<at::ScalarType> dtype) {
  BMT_CHECK(!dtype || *dtype == at::kFloat || *dtype == at::kBFloat16 || *dtype == at::kHalf,
            "AdamOffloadOptimizer::set_grad_transfer_dtype: ", c10::toString(*dtype),
            " is not supported; use kFloat, kBFloat16 or kHalf (or nullopt for the gradient's own dtype)");
  BMT_CHECK(started_.empty(), "AdamOffloadOptimizer::set_grad_transfer_dtype: updates of this iteration are "
            "running; call it before the backward or after step()");
  grad_transfer_dtype_ = dtype;
}

void AdamOffloadOptimizer::set_async_step(bool on) {
  if (!on) wait();  // nothing stays registered on the parameters
  async_step_ = on;
}

void AdamOffloadOptimizer::set_thread_pool(ThreadPool& pool) {
  wait();  // running updates belong to the old pool
  pool_ = &pool;
}

void AdamOffloadOptimizer::step_params(const std::vector<size_t>& flat_indices, double loss_scale) {
  BMT_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "step_params: loss_scale must be finite and > 0, got ",
            loss_scale);
  validate_groups();
  std::vector<std::pair<size_t, size_t>> where;  // flat index -> (group, position)
  for (size_t g = 0; g < param_groups_.size(); ++g)
    for (size_t i = 0; i < param_groups_[g].params().size(); ++i) where.emplace_back(g, i);
  at::NoGradGuard no_grad;
  for (size_t idx : flat_indices) {
    BMT_CHECK(idx < where.size(), "step_params: flat index ", idx, " out of range (", where.size(), " parameters)");
    auto [g, i] = where[idx];
    start_one(param_groups_[g].params()[i], group_options(g), loss_scale);
  }
}

void AdamOffloadOptimizer::step_params(const std::vector<at::Tensor>& params, double loss_scale) {
  std::unordered_map<const void*, size_t> index;
  std::vector<at::Tensor> flat = flat_params();
  for (size_t k = 0; k < flat.size(); ++k) index[flat[k].unsafeGetTensorImpl()] = k;
  std::vector<size_t> indices;
  for (const auto& p : params) {
    auto it = index.find(p.unsafeGetTensorImpl());
    BMT_CHECK(it != index.end(), "step_params: a tensor of shape ", p.sizes(), " is not a parameter of this optimizer");
    indices.push_back(it->second);
  }
  step_params(indices, loss_scale);
}

void AdamOffloadOptimizer::wait() {
  std::exception_ptr err = finish_where([](const InFlight&) { return true; });
#ifdef BMT_WITH_CUDA
  // Each update's wait ordered the current stream after its copy back; this also covers updates that failed
  // before queuing theirs (their gradient copies may still be running).
  if (copies_queued_) {
    for (auto& [device, copy] : cuda_->copy) {
      at::cuda::CUDAEvent copies_done;
      copies_done.record(copy);
      copies_done.block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
    }
    copies_queued_ = false;
  }
#endif
  if (err) std::rethrow_exception(err);
}

void AdamOffloadOptimizer::wait_for_running_updates() const {
  // Logically const: waiting changes no state, it only lets running updates finish writing it.
  const_cast<AdamOffloadOptimizer*>(this)->wait();
}

void AdamOffloadOptimizer::end_iteration() {
  std::exception_ptr err;
  if (async_step_) {
    // Only the updates outside Blocks; a Block waits for its own before it gathers.
    err = finish_where([](const InFlight& f) { return !f.registered; });
  } else {
    try {
      wait();
    } catch (...) {
      err = std::current_exception();
    }
  }
  started_.clear();
  if (err) std::rethrow_exception(err);
}

void AdamOffloadOptimizer::do_step(double loss_scale) {
  std::vector<size_t> rest;
  std::vector<at::Tensor> flat = flat_params();
  for (size_t k = 0; k < flat.size(); ++k)
    if (!started_.count(flat[k].unsafeGetTensorImpl())) rest.push_back(k);
  try {
    step_params(rest, loss_scale);
  } catch (...) {
    try {
      end_iteration();
    } catch (...) {
    }
    throw;
  }
  end_iteration();
}

void AdamOffloadOptimizer::before_zero_grad() {
  if (!async_step_) return end_iteration();
  // The gradients are about to be zeroed. CPU parameters' kernels read them: wait on the host. CUDA parameters'
  // kernels read pinned copies: the zeroing (on the current stream) only has to follow the copies queued so far.
  std::exception_ptr err = finish_where([](const InFlight& f) { return !f.registered || f.param.is_cpu(); });
#ifdef BMT_WITH_CUDA
  for (auto& [device, copy] : cuda_->copy) {
    at::cuda::CUDAEvent grads_copied;
    grads_copied.record(copy);
    grads_copied.block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
  }
#endif
  started_.clear();
  if (err) std::rethrow_exception(err);
}

void AdamOffloadOptimizer::load_state_dict(const StateDict& sd) {
  wait();
  started_.clear();
  AdamBase::load_state_dict(sd);
}

}  // namespace bmt::optim
