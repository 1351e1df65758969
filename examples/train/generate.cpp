#include "train/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"

namespace examples {

std::vector<int64_t> generate(LanguageModel& model, const std::vector<int64_t>& prompt, const GenerateOptions& o) {
  BMT_CHECK(!prompt.empty(), "generate: empty prompt");
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<int64_t> context = prompt, out;
  const int64_t max_len = model.config().max_seq_len;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t begin = std::max<int64_t>(0, static_cast<int64_t>(context.size()) - max_len);
    at::Tensor ids = at::tensor(std::vector<int64_t>(context.begin() + begin, context.end()), at::kLong)
                         .unsqueeze(0)
                         .to(bmt::config().device);
    // The last position only; with tensor parallelism its vocabulary slices are all-gathered over tp.
    at::Tensor logits = model.full_vocab_logits(model.forward(ids).select(1, -1).squeeze(0)).to(at::kFloat).cpu();
    if (o.vocab_size > 0 && o.vocab_size < logits.size(0)) logits = logits.narrow(0, 0, o.vocab_size);  // (V,)
    int64_t next;
    if (o.top_k <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      auto [values, indices] = logits.topk(std::min<int64_t>(o.top_k, logits.size(0)));
      at::Tensor probs = at::softmax(values / o.temperature, 0);
      next = indices[at::multinomial(probs, 1, false, gen).item<int64_t>()].item<int64_t>();
    }
    context.push_back(next);
    out.push_back(next);
    if (next == o.stop_token) break;
  }
  return out;
}

}  // namespace examples
