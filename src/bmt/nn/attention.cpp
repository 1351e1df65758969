#include "bmt/nn/attention.h"

#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include "bmt/core/error.h"
#include "bmt/engine/recompute_keep.h"

// cuDNN's attention ops took their present signatures (attn_bias, compute_log_sumexp) after torch 2.4.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define BMT_CUDNN_ATTENTION 1
#endif

namespace bmt::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// at::SDPBackend's values (its header moved between torch versions).
constexpr int64_t kSdpFlash = 1, kSdpCudnn = 3;

// Results of one fused forward, as the backward needs them.
struct AttentionForward {
  at::Tensor out, lse, seed, offset;
};

AttentionForward run_forward(AttentionKernel kernel, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.is_cpu()) {
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true);
    return {std::get<0>(r), std::get<1>(r), at::Tensor(), at::Tensor()};
  }
#ifdef BMT_CUDNN_ATTENTION
  if (kernel == AttentionKernel::kCudnn) {
    auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, /*attn_bias=*/std::nullopt, /*compute_log_sumexp=*/true,
                                                     /*dropout_p=*/0.0, /*is_causal=*/true);
    return {std::get<0>(r), std::get<1>(r), std::get<6>(r), std::get<7>(r)};
  }
#endif
  auto r = at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true);
  return {std::get<0>(r), std::get<1>(r), std::get<6>(r), std::get<7>(r)};
}

// The fused kernel as one autograd function. In a checkpointed Block's first run it keeps its forward's results
// (with the kernel's id: the recompute's backward must be that kernel's); the recompute takes them instead of
// running the forward again, and only rebuilds the graph node.
struct FusedAttentionFn : torch::autograd::Function<FusedAttentionFn> {
  // kept_ptr: the std::vector<at::Tensor> the first run kept (empty: compute), passed as an address so that
  // autograd does not take its tensors for inputs.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            int64_t kernel_id, int64_t kept_ptr) {
    const auto& kept = *reinterpret_cast<const std::vector<at::Tensor>*>(kept_ptr);
    AttentionForward f;
    if (!kept.empty()) {
      kernel_id = kept[4].item<int64_t>();
      f = {kept[0], kept[1], kept[2], kept[3]};
    } else {
      f = run_forward(static_cast<AttentionKernel>(kernel_id), q, k, v);
      if (recompute_phase() == RecomputePhase::kFirstRun)  // (not built for calls that keep nothing)
        keep_for_recompute({f.out, f.lse, f.seed, f.offset, at::scalar_tensor(kernel_id, at::kLong)});
    }
    ctx->saved_data["kernel"] = kernel_id;
    ctx->save_for_backward({q, k, v, f.out, f.lse, f.seed, f.offset});
    return f.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4], &seed = s[5], &offset = s[6];
    const auto kernel = static_cast<AttentionKernel>(ctx->saved_data["kernel"].toInt());
    const at::Tensor& dy = grad_outputs[0];
    std::tuple<at::Tensor, at::Tensor, at::Tensor> g;
    if (q.is_cpu()) {
      g = at::_scaled_dot_product_flash_attention_for_cpu_backward(dy, q, k, v, out, lse, 0.0, /*is_causal=*/true);
#ifdef BMT_CUDNN_ATTENTION
    } else if (kernel == AttentionKernel::kCudnn) {
      g = at::_scaled_dot_product_cudnn_attention_backward(dy, q, k, v, out, lse, seed, offset, /*attn_bias=*/{},
                                                           /*cum_seq_q=*/{}, /*cum_seq_k=*/{}, q.size(2), k.size(2),
                                                           0.0, /*is_causal=*/true);
#endif
    } else {
      g = at::_scaled_dot_product_flash_attention_backward(dy, q, k, v, out, lse, /*cum_seq_q=*/{}, /*cum_seq_k=*/{},
                                                           q.size(2), k.size(2), 0.0, /*is_causal=*/true, seed, offset);
    }
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

AttentionKernel causal_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes()) return AttentionKernel::kTorch;
  if (k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) return AttentionKernel::kTorch;
  if (k.device() != q.device() || v.device() != q.device()) return AttentionKernel::kTorch;
  if (q.size(1) != k.size(1) || q.size(2) != k.size(2) || q.size(3) != k.size(3)) return AttentionKernel::kTorch;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return AttentionKernel::kTorch;
  if (!q.is_cpu() && !q.is_cuda()) return AttentionKernel::kTorch;
  const int64_t choice = at::_fused_sdp_choice(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  if (choice == kSdpFlash) return AttentionKernel::kFlash;
#ifdef BMT_CUDNN_ATTENTION
  if (choice == kSdpCudnn && q.is_cuda()) return AttentionKernel::kCudnn;
#endif
  return AttentionKernel::kTorch;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  BMT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k and v must be (B, H, T, hd), got ",
            q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  BMT_CHECK(kv_heads > 0 && heads % kv_heads == 0 && v.size(1) == kv_heads, "causal_attention: ", heads,
            " query heads are not a multiple of ", kv_heads, " kv heads (v has ", v.size(1), ")");
  at::Tensor key = k, value = v;
  if (kv_heads != heads) {
    key = k.repeat_interleave(heads / kv_heads, 1);
    value = v.repeat_interleave(heads / kv_heads, 1);
  }
  // Every call takes one entry of the first run's list (an empty one where nothing was kept), so the two runs
  // stay aligned even if they chose different kernels.
  std::vector<at::Tensor> kept = take_kept();
  if (!kept.empty()) {
    BMT_CHECK(kept[0].sizes() == q.sizes() && kept[0].scalar_type() == q.scalar_type() &&
                  kept[0].device() == q.device(),
              "causal_attention: the recompute met a different attention than the first run (kept output ",
              kept[0].sizes(), ", query ", q.sizes(), "); a checkpointed Block's forward must call its ops in the same "
              "order both times, or set BlockOptions::keep_for_recompute = false");
    return FusedAttentionFn::apply(q, key, value, static_cast<int64_t>(AttentionKernel::kTorch),
                                   reinterpret_cast<int64_t>(&kept));
  }
  const AttentionKernel kernel = causal_attention_kernel(q, key, value);
  if (kernel != AttentionKernel::kTorch)
    return FusedAttentionFn::apply(q, key, value, static_cast<int64_t>(kernel), reinterpret_cast<int64_t>(&kept));
  keep_for_recompute({});  // an empty entry: this call's place in the list
  return at::scaled_dot_product_attention(q, key, value, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
}

}  // namespace bmt::nn
