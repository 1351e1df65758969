// Suite cross_entropy: bmt::loss::fused_cross_entropy (forward + backward, in place as the example models run it)
// against at::cross_entropy_loss on the same bf16 logits, at the GPT presets' (tokens, vocabulary) shapes.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>

#include "bench_kernels.h"
#include "bmt/loss/fused_cross_entropy.h"

namespace bench {

void bench_cross_entropy(const KernelTimer& timer) {
  struct Shape {
    int64_t rows, vocab;
  };
  for (const Shape s : {Shape{16384, 50304}, Shape{8192, 50304}, Shape{16384, 32000}}) {
    const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::Tensor base = at::randn({s.rows, s.vocab}, opts) * 3;
    at::Tensor target = at::randint(0, s.vocab, {s.rows}, opts.dtype(at::kLong));
    at::Tensor work = at::empty_like(base);
    bmt::loss::FusedCrossEntropyOptions fo;
    fo.inplace = true;
    auto ours = [&] {
      work.copy_(base);  // in place overwrites the logits with their gradient
      at::Tensor logits = work.detach().requires_grad_(true);
      bmt::loss::fused_cross_entropy(logits, target, fo).backward();
    };
    auto copy_only = [&] { work.copy_(base); };
    auto theirs = [&] {
      at::Tensor logits = base.detach().requires_grad_(true);
      at::cross_entropy_loss(logits, target).backward();
    };
    // Difference of the gradients (ours is written into `work`).
    at::Tensor ref_logits = base.detach().requires_grad_(true);
    at::cross_entropy_loss(ref_logits.to(at::kFloat), target).backward();
    ours();
    const double diff = (work.to(at::kFloat) - ref_logits.grad().to(at::kFloat)).abs().max().item<double>();
    const double copy_ms = timer.time_ms(copy_only);
    const double ours_ms = timer.time_ms(ours) - copy_ms;
    const double torch_ms = timer.time_ms(theirs);
    // Forward reads the logits once, backward reads and writes them: 3 passes of rows x vocab x 2 bytes.
    const double nbytes = 3.0 * static_cast<double>(s.rows * s.vocab) * 2.0;
    report_kernel("cross_entropy", std::to_string(s.rows) + "x" + std::to_string(s.vocab) + " bf16", ours_ms,
                  torch_ms, nbytes, diff);
  }
}

}  // namespace bench
