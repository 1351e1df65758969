#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/core/kernels/fp8_delayed_scale_internal.h"
#include "bmt/nn/fp8_format_internal.h"
#include "bmt/nn/gemm_epilogue_args_internal.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace bmt::nn {
namespace {

namespace k = core::kernels;

struct ScaleHandle : torch::CustomClassHolder {
  explicit ScaleHandle(Fp8DelayedScale s) : scale(std::move(s)) {}
  Fp8DelayedScale scale;
};

EnvChoice<Fp8Recipe, 2> g_recipe("BMT_FP8_RECIPE",
                                 {{{"current", Fp8Recipe::kCurrent}, {"delayed", Fp8Recipe::kDelayed}}});
bool recipe_delayed() { return g_recipe.get() == Fp8Recipe::kDelayed; }

// One delayed scaling's switch: its variable wins where set ("0" off, else on); unset, it follows the recipe.
class RecipeSwitch {
 public:
  explicit constexpr RecipeSwitch(const char* variable) : env_(variable) {}
  bool enabled() { return env_.enabled(recipe_delayed()); }
  void set(bool on) { env_.set(on); }

 private:
  EnvSwitch env_;  // (its own default is never asked: enabled() passes the recipe's)
};
RecipeSwitch g_delayed_gelu("BMT_FP8_DELAYED_GELU");
RecipeSwitch g_delayed_inputs("BMT_FP8_DELAYED_INPUTS");
RecipeSwitch g_delayed_grads("BMT_FP8_DELAYED_GRADS");

}  // namespace

Fp8Recipe fp8_recipe() { return g_recipe.get(); }
void set_fp8_recipe(Fp8Recipe recipe) {
  g_recipe.set(recipe);
  const bool on = recipe == Fp8Recipe::kDelayed;
  g_delayed_gelu.set(on), g_delayed_inputs.set(on), g_delayed_grads.set(on);
}
Fp8Recipe fp8_recipe_from_name(const std::string& name, const char* who) {
  if (name == "current") return Fp8Recipe::kCurrent;
  if (name == "delayed") return Fp8Recipe::kDelayed;
  BMT_ERROR(who, ": FP8 recipe '", name, "' is not 'current' or 'delayed'");
}
const char* fp8_recipe_name(Fp8Recipe recipe) { return recipe == Fp8Recipe::kDelayed ? "delayed" : "current"; }
bool fp8_delayed_gelu_enabled() { return g_delayed_gelu.enabled(); }
void set_fp8_delayed_gelu_enabled(bool enabled) { g_delayed_gelu.set(enabled); }
bool fp8_delayed_inputs_enabled() { return g_delayed_inputs.enabled(); }
void set_fp8_delayed_inputs_enabled(bool enabled) { g_delayed_inputs.set(enabled); }
bool fp8_delayed_grads_enabled() { return g_delayed_grads.enabled(); }
void set_fp8_delayed_grads_enabled(bool enabled) { g_delayed_grads.set(enabled); }

Fp8DelayedScale::Fp8DelayedScale(int64_t history_len, Fp8Format format)
    : s_(std::make_shared<State>(history_len, format)) {
  BMT_CHECK(history_len >= 1, "nn::Fp8DelayedScale: history_len must be at least 1, got ", history_len);
}

Fp8DelayedScale::Fp8DelayedScale(const Fp8DelayedScale& other)
    : s_(std::make_shared<State>(other.s_->len, other.s_->format)) {}

Fp8DelayedScale& Fp8DelayedScale::operator=(const Fp8DelayedScale& other) {
  if (this != &other) s_ = std::make_shared<State>(other.s_->len, other.s_->format);
  return *this;
}

Fp8DelayedScale Fp8DelayedScale::share() const { return Fp8DelayedScale(s_, Shared{}); }

const at::Tensor& Fp8DelayedScale::scale() const {
  BMT_CHECK(ready(), "nn::Fp8DelayedScale: no scale before the first record (cast dynamically, then record_amax)");
  return s_->scale;
}

const at::Tensor& Fp8DelayedScale::amax() const {
  BMT_CHECK(ready(), "nn::Fp8DelayedScale: no amax buffer before the first record");
  return s_->amax;
}

void Fp8DelayedScale::allocate(const at::Tensor& like) {
  const auto opts = like.options().dtype(at::kFloat);
  s_->history = at::zeros({s_->len}, opts);
  s_->scale = at::ones({}, opts);
  s_->inv = at::ones({}, opts);
  s_->amax = at::zeros({}, opts);
}

at::Tensor Fp8DelayedScale::record() {
  State& st = *s_;
  BMT_CHECK(st.amax.defined(), "nn::Fp8DelayedScale::record: nothing to record before record_amax");
  const at::Tensor call_inv = at::empty({}, st.inv.options());
  k::Fp8DelayedState s;
  s.history = st.history.data_ptr<float>(), s.len = st.len, s.scale = st.scale.data_ptr<float>();
  s.inv = st.inv.data_ptr<float>(), s.amax = st.amax.data_ptr<float>();
  s.format = core_format(st.format);
  if (!st.history.is_cuda()) {
    k::fp8_delayed_record_cpu(s, call_inv.data_ptr<float>());
  } else {
#ifdef BMT_WITH_CUDA
    c10::cuda::CUDAGuard guard(st.history.device());
    k::fp8_delayed_record_cuda(s, call_inv.data_ptr<float>(), current_stream_handle(st.history));
#else
    BMT_ERROR("nn::Fp8DelayedScale: CUDA state, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
  }
  ++st.records;
  return call_inv;
}

void Fp8DelayedScale::record_amax(const at::Tensor& amax) {
  BMT_CHECK(amax.numel() == 1 && amax.scalar_type() == at::kFloat,
            "nn::Fp8DelayedScale::record_amax: expected one float32 amax, got ", amax.sizes(), " ", amax.scalar_type());
  if (!s_->amax.defined()) allocate(amax);
  BMT_CHECK(amax.device() == s_->amax.device(), "nn::Fp8DelayedScale::record_amax: the amax is on ", amax.device(),
            ", the state on ", s_->amax.device());
  s_->amax.copy_(amax.reshape({}));
  record();
}

bool fp8_gemm_epilogue_to_fp8(k::GemmEpilogue epilogue, const at::Tensor& a, Fp8Format a_format,
                              const at::Tensor& a_inv, const at::Tensor& b, Fp8Format b_format,
                              const at::Tensor& b_inv, bool fast_accum, const at::Tensor& out8,
                              Fp8DelayedScale& state, const at::Tensor& bias, const at::Tensor& aux) {
  BMT_CHECK(a.dim() == 2 && b.dim() == 2 && out8.dim() == 2 && a.size(1) == b.size(1) && out8.size(0) == a.size(0) &&
                out8.size(1) == b.size(0),
            "nn::fp8_gemm_epilogue_to_fp8: operands ", a.sizes(), " x ", b.sizes(), "^T do not make the output ",
            out8.sizes());
  BMT_CHECK(a_inv.dim() == 0 && b_inv.dim() == 0, "nn::fp8_gemm_epilogue_to_fp8: per-tensor scales only");
  BMT_CHECK(out8.scalar_type() == fp8_dtype(state.format()), "nn::fp8_gemm_epilogue_to_fp8: the output is ",
            out8.scalar_type(), ", the delayed scale's format ", fp8_dtype(state.format()));
  BMT_CHECK(bias.defined(), "nn::fp8_gemm_epilogue_to_fp8: needs the bias (its dtype is the epilogue's)");
  const at::Tensor& scale = state.scale();
  BMT_CHECK(scale.device() == out8.device(), "nn::fp8_gemm_epilogue_to_fp8: the delayed scale is on ", scale.device(),
            ", the output on ", out8.device());
  k::Fp8GemmOperands f8;
  f8.a_format = core_format(a_format), f8.b_format = core_format(b_format);
  f8.a_inv_scale = a_inv.data_ptr<float>(), f8.b_inv_scale = b_inv.data_ptr<float>();
  f8.fast_accum = fast_accum;
  f8.out_scale = scale.data_ptr<float>();
  f8.out_amax = state.amax().data_ptr<float>();
  f8.out_format = core_format(state.format());
  k::GemmEpilogueArgs g = gemm_epilogue_args(epilogue, a, b, /*b_transposed=*/true, out8, bias, aux, at::Tensor());
  g.fp8 = &f8;
  return run_gemm_epilogue(g, bias);
}

c10::IValue delayed_scale_capsule(const Fp8DelayedScale& state) {
  return c10::IValue::make_capsule(c10::make_intrusive<ScaleHandle>(state.share()));
}

Fp8DelayedScale& delayed_scale_of(const c10::IValue& capsule) {
  BMT_CHECK(capsule.isCapsule(), "nn::delayed_scale_of: not a delayed scale's capsule");
  return static_cast<ScaleHandle*>(capsule.toCapsule().get())->scale;
}

at::Tensor fp8_transpose(const at::Tensor& q) {
  BMT_CHECK(q.dim() == 2 && (q.scalar_type() == at::kFloat8_e4m3fn || q.scalar_type() == at::kFloat8_e5m2),
            "nn::fp8_transpose: expected a 2-D float8 tensor, got ", q.sizes(), " ", q.scalar_type());
  const at::Tensor m = q.contiguous();
  at::Tensor t = at::empty({m.size(1), m.size(0)}, m.options());
  const auto* src = static_cast<const uint8_t*>(m.data_ptr());
  auto* dst = static_cast<uint8_t*>(t.data_ptr());
  if (!m.is_cuda()) {
    k::fp8_transpose_cpu(src, m.size(0), m.size(1), dst);
    return t;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(m.device());
  k::fp8_transpose_cuda(src, m.size(0), m.size(1), dst, current_stream_handle(m));
  return t;
#else
  BMT_ERROR("nn::fp8_transpose: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

}  // namespace bmt::nn
