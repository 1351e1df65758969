#include "data/synthetic_addition.h"

#include <algorithm>
#include <set>

#include "bmt/core/error.h"

namespace examples {

SyntheticAddition::SyntheticAddition(uint64_t seed, int digits, bool reverse_sum)
    : seed_(seed), digits_(digits), reverse_sum_(reverse_sum), operand_limit_(1) {
  BMT_CHECK(digits >= 1 && digits <= 6, "synthetic addition: digits must be in [1, 6], got ", digits);
  for (int i = 0; i < digits; ++i) operand_limit_ *= 10;
}

std::string SyntheticAddition::describe() const {
  return "synthetic " + std::to_string(digits_) + "-digit addition" + (reverse_sum_ ? " (sum reversed)" : "") +
         ", vocab 13, " + std::to_string(example_len()) + " tokens per example, 10% of pairs held out";
}

bool SyntheticAddition::is_held_out(int64_t a, int64_t b) const {
  return mix64(0x5eed5eedULL, static_cast<uint64_t>(a), static_cast<uint64_t>(b)) % 10 == 0;
}

std::vector<int64_t> SyntheticAddition::example(int64_t a, int64_t b) const {
  std::vector<int64_t> out;
  auto put_digits = [&](int64_t v, int width, bool reversed) {
    std::vector<int64_t> d(width);
    for (int i = width - 1; i >= 0; --i, v /= 10) d[i] = v % 10;
    if (reversed) std::reverse(d.begin(), d.end());
    out.insert(out.end(), d.begin(), d.end());
  };
  put_digits(a, digits_, false);
  out.push_back(kPlus);
  put_digits(b, digits_, false);
  out.push_back(kEquals);
  put_digits(a + b, digits_ + 1, reverse_sum_);
  out.push_back(kSeparator);
  return out;
}

std::pair<int64_t, int64_t> SyntheticAddition::draw_pair(uint64_t& state, bool held_out) const {
  for (;;) {
    uint64_t r = mix64(state++);
    int64_t a = static_cast<int64_t>(r % static_cast<uint64_t>(operand_limit_));
    int64_t b = static_cast<int64_t>((r >> 32) % static_cast<uint64_t>(operand_limit_));
    if (is_held_out(a, b) == held_out) return {a, b};
  }
}

at::Tensor SyntheticAddition::fill_rows(uint64_t stream, int64_t rows, int64_t seq, bool held_out) const {
  at::Tensor out = at::empty({rows, seq + 1}, at::TensorOptions().dtype(at::kLong));
  auto acc = out.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t state = mix64(stream, static_cast<uint64_t>(r));
    int64_t filled = 0;
    while (filled < seq + 1) {
      auto [a, b] = draw_pair(state, held_out);
      for (int64_t t : example(a, b)) {
        if (filled == seq + 1) break;
        acc[r][filled++] = t;
      }
    }
  }
  return out;
}

at::Tensor SyntheticAddition::train_batch(int64_t step, int rank, int64_t rows, int64_t seq) const {
  return fill_rows(mix64(seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(rank), 1), rows, seq, false);
}

at::Tensor SyntheticAddition::eval_batch(int64_t index, int64_t rows, int64_t seq) const {
  return fill_rows(mix64(0xe7a1, static_cast<uint64_t>(index), 0, 2), rows, seq, true);
}

std::optional<TaskBatch> SyntheticAddition::task_batch(int64_t rows) const {
  TaskBatch batch;
  batch.answer_begin = 2 * digits_ + 2;
  batch.answer_len = digits_ + 1;
  batch.tokens = at::empty({rows, example_len()}, at::TensorOptions().dtype(at::kLong));
  auto acc = batch.tokens.accessor<int64_t, 2>();
  std::set<std::pair<int64_t, int64_t>> seen;  // distinct pairs while there are enough of them
  const int64_t held_out_pairs = operand_limit_ * operand_limit_ / 10;
  uint64_t state = mix64(0x7a5c);
  for (int64_t r = 0; r < rows; ++r) {
    std::pair<int64_t, int64_t> ab;
    do ab = draw_pair(state, true);
    while (static_cast<int64_t>(seen.size()) < held_out_pairs / 2 && !seen.insert(ab).second);
    std::vector<int64_t> ex = example(ab.first, ab.second);
    for (int64_t t = 0; t < example_len(); ++t) acc[r][t] = ex[t];
  }
  return batch;
}

std::vector<int64_t> SyntheticAddition::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  for (char c : text) {
    if (c >= '0' && c <= '9') ids.push_back(c - '0');
    else if (c == '+') ids.push_back(kPlus);
    else if (c == '=') ids.push_back(kEquals);
    else if (c == ';') ids.push_back(kSeparator);
    else BMT_ERROR("synthetic addition: cannot encode character '", std::string(1, c), "' (vocabulary: 0-9 + = ;)");
  }
  return ids;
}

std::string SyntheticAddition::decode(const std::vector<int64_t>& ids) const {
  static const char kChars[] = "0123456789+=;";
  std::string s;
  for (int64_t t : ids) s += (t >= 0 && t < 13) ? kChars[t] : '?';
  return s;
}

std::string SyntheticAddition::annotate(const std::string& prompt, const std::string& completion) const {
  const size_t plus = prompt.find('+'), eq = prompt.find('=');
  if (plus == std::string::npos || eq == std::string::npos || eq + 1 != prompt.size()) return "";
  const int64_t sum = std::stoll(prompt.substr(0, plus)) + std::stoll(prompt.substr(plus + 1, eq - plus - 1));
  std::string expected = std::to_string(sum);
  expected.insert(0, static_cast<size_t>(std::max<int64_t>(0, digits_ + 1 - static_cast<int64_t>(expected.size()))), '0');
  std::string answer = completion.substr(0, completion.find(';'));
  if (reverse_sum_) std::reverse(answer.begin(), answer.end());  // back to the usual digit order
  return "(sum " + expected + (answer == expected ? ", correct)" : ", model says " + answer + ")");
}

std::vector<std::string> SyntheticAddition::sample_prompts() const {
  std::vector<std::string> prompts;
  std::optional<TaskBatch> batch = task_batch(4);
  for (int64_t r = 0; r < 4; ++r) {
    std::vector<int64_t> ids(batch->tokens[r].data_ptr<int64_t>(), batch->tokens[r].data_ptr<int64_t>() + batch->answer_begin);
    prompts.push_back(decode(ids));
  }
  return prompts;
}

}  // namespace examples
