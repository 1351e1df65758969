// The embedded default corpus: fixed-width decimal addition, a task a tiny model visibly learns in minutes.
//
// One example is "ab+cd=sss;" for digits = 2: both operands zero-padded to `digits` digits, the sum to
// digits + 1 (written least-significant digit first when reverse_sum, the order in which carries are
// computed, which small transformers learn much faster), then ';'. Vocabulary: '0'..'9' -> 0..9, '+' 10,
// '=' 11, ';' 12. Training rows are streams of random examples starting at an example boundary; a fixed 10% of
// all operand pairs (chosen by hash, independent of the seed) is held out and never trained on, so the task
// accuracy on them measures learned addition, not memorisation. Loss floor: the operands are uniformly random,
// so only the sum and separators are predictable (about 2·digits·ln(10) nats per example are irreducible).
#pragma once

#include "data/dataset.h"

namespace examples {

class SyntheticAddition : public Dataset {
 public:
  explicit SyntheticAddition(uint64_t seed, int digits = 2, bool reverse_sum = true);

  std::string describe() const override;
  int64_t vocab_size() const override { return 13; }
  at::Tensor train_batch(int64_t step, int rank, int64_t rows, int64_t seq) const override;
  at::Tensor eval_batch(int64_t index, int64_t rows, int64_t seq) const override;
  std::optional<TaskBatch> task_batch(int64_t rows) const override;
  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  std::vector<std::string> sample_prompts() const override;
  int64_t stop_token() const override { return kSeparator; }
  std::string annotate(const std::string& prompt, const std::string& completion) const override;

  static constexpr int64_t kPlus = 10, kEquals = 11, kSeparator = 12;
  int64_t example_len() const { return 3 * digits_ + 4; }
  bool is_held_out(int64_t a, int64_t b) const;
  // Tokens of "a+b=sum;" (sum reversed when reverse_sum).
  std::vector<int64_t> example(int64_t a, int64_t b) const;

 private:
  // Fills `rows` x (seq + 1) tokens with examples drawn from stream `stream`, held-out or training pairs.
  at::Tensor fill_rows(uint64_t stream, int64_t rows, int64_t seq, bool held_out) const;
  std::pair<int64_t, int64_t> draw_pair(uint64_t& state, bool held_out) const;

  uint64_t seed_;
  int digits_;
  bool reverse_sum_;
  int64_t operand_limit_;  // 10^digits
};

}  // namespace examples
