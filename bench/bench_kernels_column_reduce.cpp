// Suites column_sum and layer_norm_grads: our column reductions (nn::column_sum: a Linear's bias gradient;
// LayerNorm's weight and bias gradients) against what torch runs for them in training (dy.sum(0) as addmm's
// backward does, and native_layer_norm_backward's gamma/beta part), at the GPT-2 124M / 1.3B block shapes, bf16.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "bench_kernels.h"
#include "bmt/nn/fused_reductions.h"

namespace bench {
namespace {

struct Shape {
  int64_t rows, cols;
};
constexpr Shape kShapes[] = {{16384, 768}, {16384, 2304}, {16384, 3072}, {16384, 2048}, {16384, 8192}};

std::string shape_name(const Shape& s) { return std::to_string(s.rows) + "x" + std::to_string(s.cols) + " bf16"; }

}  // namespace

void bench_column_sum(const KernelTimer& timer) {
  for (const Shape& s : kShapes) {
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::Tensor dy = at::randn({s.rows, s.cols}, opts);
    at::Tensor ours_out = bmt::nn::column_sum(dy, at::kBFloat16);
    at::Tensor ref = dy.to(at::kFloat).sum(0);
    const double diff = (ours_out.to(at::kFloat) - ref).abs().max().item<double>();
    const double ours_ms = timer.time_ms([&] { (void)bmt::nn::column_sum(dy, at::kBFloat16); });
    const double torch_ms = timer.time_ms([&] { (void)dy.sum(0); });
    report_kernel("column_sum", shape_name(s), ours_ms, torch_ms, static_cast<double>(s.rows * s.cols) * 2.0, diff);
  }
}

void bench_layer_norm_grads(const KernelTimer& timer) {
  for (const Shape& s : kShapes) {
    if (s.cols != 768 && s.cols != 2048) continue;  // LayerNorms run at the model width
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::Tensor x = at::randn({s.rows, s.cols}, opts), dy = at::randn({s.rows, s.cols}, opts);
    at::Tensor w = at::randn({s.cols}, opts), b = at::randn({s.cols}, opts);
    // Ours: the whole backward through the autograd path (torch's input gradient + our parameter gradients).
    at::Tensor xo = x.detach().requires_grad_(true), wo = w.detach().requires_grad_(true),
               bo = b.detach().requires_grad_(true);
    auto ours = [&] {
      at::Tensor y = bmt::nn::layer_norm_reduced_param_grads(xo, s.cols, wo, bo, 1e-5);
      y.backward(dy);
    };
    auto theirs = [&] {
      at::Tensor y = at::layer_norm(xo, {s.cols}, wo, bo, 1e-5);
      y.backward(dy);
    };
    const auto clear = [&] { xo.mutable_grad().reset(); wo.mutable_grad().reset(); bo.mutable_grad().reset(); };
    clear();
    ours();
    at::Tensor gw = wo.grad().clone(), gb = bo.grad().clone();
    clear();
    theirs();
    const double diff = std::max((gw.to(at::kFloat) - wo.grad().to(at::kFloat)).abs().max().item<double>(),
                                 (gb.to(at::kFloat) - bo.grad().to(at::kFloat)).abs().max().item<double>());
    const double ours_ms = timer.time_ms([&] { clear(); ours(); });
    const double torch_ms = timer.time_ms([&] { clear(); theirs(); });
    // Forward (read x, write y) + backward (read x, dy; write dx) at the least: 5 passes of rows x cols x 2 bytes.
    report_kernel("layer_norm_grads", shape_name(s) + " fwd+bwd", ours_ms, torch_ms,
                  5.0 * static_cast<double>(s.rows * s.cols) * 2.0, diff);
  }
}

}  // namespace bench
