#include "bmt/optim/grad_utils.h"

#include <ATen/core/grad_mode.h>
#include <cmath>

#include "bmt/core/error.h"
#include "bmt/core/kernels/has_inf_nan_internal.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace bmt::optim {
namespace {

// Where a one-element reduction buffer for `comm` must live.
at::Device reduction_device(core::Communicator* comm) {
  if (comm != nullptr && comm->device_kind() == core::DeviceKind::kCUDA) {
    BMT_CHECK(is_initialized() && config().device.is_cuda(), "a CUDA communicator needs bmt::config().device on CUDA");
    return config().device;
  }
  return at::Device(at::kCPU);
}

void all_reduce_in_place(at::Tensor& t, core::ReduceOp op, core::Communicator* comm) {
  if (comm == nullptr || comm->size() == 1) return;
  comm->all_reduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), to_core_dtype(t.scalar_type()), op,
                   current_stream_handle(t));
}

}  // namespace

bool grads_have_inf_nan(const std::vector<at::Tensor>& params, core::Communicator* comm) {
  return grads_have_inf_nan(params, std::vector<core::Communicator*>{comm});
}

bool accumulate_inf_nan_flag(const std::vector<at::Tensor>& params, at::Tensor& device_flag) {
  at::NoGradGuard no_grad;
  bool host_found = false;
  for (const auto& p : params) {
    at::Tensor g = main_grad(p);
    if (!g.defined() || g.numel() == 0) continue;
    g = g.contiguous();
    if (g.is_cpu()) {
      if (!host_found)
        host_found = core::kernels::has_inf_nan_cpu(g.data_ptr(), g.numel(), to_core_dtype(g.scalar_type()));
      continue;
    }
#ifdef BMT_WITH_CUDA
    BMT_CHECK(g.is_cuda(), "grads_have_inf_nan: gradients on ", g.device(), " are not supported");
    if (!device_flag.defined()) device_flag = at::zeros({1}, g.options().dtype(at::kInt));
    BMT_CHECK(g.device() == device_flag.device(), "grads_have_inf_nan: gradients on several devices");
    c10::cuda::CUDAGuard guard(g.device().index());
    core::kernels::has_inf_nan_cuda(g.data_ptr(), g.numel(), to_core_dtype(g.scalar_type()),
                                    device_flag.data_ptr<int>(), current_stream_handle(g));
#else
    BMT_ERROR("grads_have_inf_nan: gradient on ", g.device(), " in a build without CUDA");
#endif
  }
  return host_found;
}

at::Tensor inf_nan_flag(const std::vector<at::Tensor>& params, const std::vector<core::Communicator*>& comms,
                        bool local_found) {
  core::Communicator* first = nullptr;
  for (core::Communicator* c : comms)
    if (c != nullptr && first == nullptr) first = c;
  if (is_initialized()) wait_for_gradient_reduction();
  at::NoGradGuard no_grad;
  at::Tensor device_flag;  // int32 on the CUDA device of the gradients, written by has_inf_nan_cuda
  const bool host_found = accumulate_inf_nan_flag(params, device_flag) || local_found;
  at::Tensor flag = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(reduction_device(first)));
  if (device_flag.defined()) flag.copy_(device_flag.to(at::kFloat).to(flag.device()));
  if (host_found) flag.fill_(1.0);
  for (core::Communicator* c : comms) {
    BMT_CHECK(c == nullptr || reduction_device(c) == flag.device(), "grads_have_inf_nan: communicators '",
              first->name(), "' and '", c->name(), "' live on different device kinds");
    all_reduce_in_place(flag, core::ReduceOp::kMax, c);
  }
  return flag;
}

bool grads_have_inf_nan(const std::vector<at::Tensor>& params, const std::vector<core::Communicator*>& comms,
                        bool local_found) {
  return inf_nan_flag(params, comms, local_found).item<float>() != 0.0f;
}

double global_grad_norm(const std::vector<at::Tensor>& params, double norm_type, core::Communicator* comm) {
  if (is_initialized()) wait_for_gradient_reduction();
  const bool inf_norm = std::isinf(norm_type) && norm_type > 0;
  BMT_CHECK(inf_norm || (std::isfinite(norm_type) && norm_type >= 1), "grad norm: norm_type must be >= 1 or inf, got ",
            norm_type);
  at::NoGradGuard no_grad;
  const at::Device dev = reduction_device(comm);
  at::Tensor acc = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(dev));
  for (const auto& p : params) {
    at::Tensor g = main_grad(p);
    if (!g.defined() || g.numel() == 0) continue;
    at::Tensor local;
    if (inf_norm) {
      local = g.abs().max().to(at::kDouble).reshape({1});
      acc = at::maximum(acc, local.to(dev));
    } else {
      local = at::linalg_vector_norm(g, norm_type, c10::nullopt, false,
                                     g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).to(at::kDouble);
      local = local.pow(norm_type).reshape({1}) / static_cast<double>(replication(p));
      acc = acc + local.to(dev);
    }
  }
  all_reduce_in_place(acc, inf_norm ? core::ReduceOp::kMax : core::ReduceOp::kSum, comm);
  double total = acc.item<double>();
  return inf_norm ? total : std::pow(total, 1.0 / norm_type);
}

void scale_grads(const std::vector<at::Tensor>& params, double factor) {
  at::NoGradGuard no_grad;
  for (const auto& p : params) {
    at::Tensor g = main_grad(p);
    if (g.defined() && g.numel() > 0) g.mul_(factor);
  }
}

}  // namespace bmt::optim
