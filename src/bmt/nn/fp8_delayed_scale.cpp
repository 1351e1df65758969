#include "bmt/nn/fp8_delayed_scale.h"

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_delayed_scale_internal.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace bmt::nn {
namespace {

namespace k = core::kernels;

EnvSwitch g_delayed_gelu("BMT_FP8_DELAYED_GELU", false);

}  // namespace

bool fp8_delayed_gelu_enabled() { return g_delayed_gelu.enabled(); }
void set_fp8_delayed_gelu_enabled(bool enabled) { g_delayed_gelu.set(enabled); }

Fp8DelayedScale::Fp8DelayedScale(int64_t history_len, Fp8Format format) : len_(history_len), format_(format) {
  BMT_CHECK(history_len >= 1, "nn::Fp8DelayedScale: history_len must be at least 1, got ", history_len);
}

const at::Tensor& Fp8DelayedScale::scale() const {
  BMT_CHECK(ready(), "nn::Fp8DelayedScale: no scale before the first record (cast dynamically, then record_amax)");
  return scale_;
}

const at::Tensor& Fp8DelayedScale::amax() const {
  BMT_CHECK(ready(), "nn::Fp8DelayedScale: no amax buffer before the first record");
  return amax_;
}

void Fp8DelayedScale::allocate(const at::Tensor& like) {
  const auto opts = like.options().dtype(at::kFloat);
  history_ = at::zeros({len_}, opts);
  scale_ = at::ones({}, opts);
  inv_ = at::ones({}, opts);
  amax_ = at::zeros({}, opts);
}

at::Tensor Fp8DelayedScale::record() {
  BMT_CHECK(amax_.defined(), "nn::Fp8DelayedScale::record: nothing to record before record_amax");
  const at::Tensor call_inv = at::empty({}, inv_.options());
  k::Fp8DelayedState s;
  s.history = history_.data_ptr<float>(), s.len = len_, s.scale = scale_.data_ptr<float>();
  s.inv = inv_.data_ptr<float>(), s.amax = amax_.data_ptr<float>();
  s.format = format_ == Fp8Format::kE4M3 ? k::Fp8Format::kE4M3 : k::Fp8Format::kE5M2;
  if (!history_.is_cuda()) {
    k::fp8_delayed_record_cpu(s, call_inv.data_ptr<float>());
  } else {
#ifdef BMT_WITH_CUDA
    c10::cuda::CUDAGuard guard(history_.device());
    k::fp8_delayed_record_cuda(s, call_inv.data_ptr<float>(), current_stream_handle(history_));
#else
    BMT_ERROR("nn::Fp8DelayedScale: CUDA state, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
  }
  ++records_;
  return call_inv;
}

void Fp8DelayedScale::record_amax(const at::Tensor& amax) {
  BMT_CHECK(amax.numel() == 1 && amax.scalar_type() == at::kFloat,
            "nn::Fp8DelayedScale::record_amax: expected one float32 amax, got ", amax.sizes(), " ", amax.scalar_type());
  if (!amax_.defined()) allocate(amax);
  BMT_CHECK(amax.device() == amax_.device(), "nn::Fp8DelayedScale::record_amax: the amax is on ", amax.device(),
            ", the state on ", amax_.device());
  amax_.copy_(amax.reshape({}));
  record();
}

}  // namespace bmt::nn
