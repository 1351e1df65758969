#include "data/file_dataset.h"

#include <cctype>
#include <cstdio>

#include "bmt/core/error.h"

namespace examples {

FileDataset::FileDataset(TokenFile tokens, uint64_t seed, double eval_fraction)
    : tokens_(std::move(tokens)), seed_(seed) {
  BMT_CHECK(eval_fraction > 0 && eval_fraction < 1, "eval fraction must be in (0, 1), got ", eval_fraction);
  train_end_ = static_cast<int64_t>(static_cast<double>(tokens_.num_tokens) * (1.0 - eval_fraction));
  if (is_bytes()) {
    vocab_size_ = 256;
  } else {
    const int64_t max_id = tokens_.max_token();
    vocab_size_ = max_id < 50304 ? 50304 : (max_id + 1 + 63) / 64 * 64;
  }
}

std::string FileDataset::describe() const {
  return tokens_.file->path() + " (" + tokens_.layout + ", " + std::to_string(tokens_.num_tokens) + " tokens: " +
         std::to_string(train_tokens()) + " train / " + std::to_string(eval_tokens()) + " eval, vocab " +
         std::to_string(vocab_size_) + ")";
}

at::Tensor FileDataset::window_rows(const std::vector<int64_t>& offsets, int64_t seq) const {
  at::Tensor out = at::empty({static_cast<int64_t>(offsets.size()), seq + 1}, at::TensorOptions().dtype(at::kLong));
  auto acc = out.accessor<int64_t, 2>();
  for (size_t r = 0; r < offsets.size(); ++r)
    for (int64_t t = 0; t <= seq; ++t) acc[static_cast<int64_t>(r)][t] = tokens_.token(offsets[r] + t);
  return out;
}

at::Tensor FileDataset::train_batch(int64_t step, int rank, int64_t rows, int64_t seq) const {
  const int64_t span = train_end_ - seq;  // valid start offsets: [0, span)
  BMT_CHECK(span > 0, "data file ", tokens_.file->path(), ": the training split (", train_end_,
            " tokens) is shorter than one sequence of ", seq + 1, " tokens");
  std::vector<int64_t> offsets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    offsets[static_cast<size_t>(r)] = static_cast<int64_t>(
        mix64(seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(rank), static_cast<uint64_t>(r)) %
        static_cast<uint64_t>(span));
  return window_rows(offsets, seq);
}

at::Tensor FileDataset::eval_batch(int64_t index, int64_t rows, int64_t seq) const {
  const int64_t span = eval_tokens() - seq;
  BMT_CHECK(span > 0, "data file ", tokens_.file->path(), ": the held-out split (", eval_tokens(),
            " tokens) is shorter than one sequence of ", seq + 1, " tokens");
  std::vector<int64_t> offsets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) offsets[static_cast<size_t>(r)] = train_end_ + ((index * rows + r) * seq) % span;
  return window_rows(offsets, seq);
}

std::vector<int64_t> FileDataset::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  if (is_bytes()) {
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  // No tokenizer is embedded: token-file prompts are ids, "[464 3290 318]" or "464 3290 318".
  std::string number;
  for (char c : text + " ") {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      number += c;
    } else {
      BMT_CHECK(c == ' ' || c == '[' || c == ']' || c == ',', "token-file prompt '", text,
                "': expected token ids such as [464 3290]");
      if (!number.empty()) ids.push_back(std::stoll(number));
      number.clear();
    }
  }
  for (int64_t id : ids) BMT_CHECK(id < vocab_size_, "token-file prompt: id ", id, " >= vocab ", vocab_size_);
  return ids;
}

std::string FileDataset::decode(const std::vector<int64_t>& ids) const {
  std::string s;
  if (!is_bytes()) {
    s = "[";
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s + "]";
  }
  for (int64_t id : ids) {
    const unsigned char c = static_cast<unsigned char>(id);
    if (std::isprint(c) || c == '\n' || c == '\t' || c >= 0x80) {
      s += static_cast<char>(c);  // bytes >= 0x80: parts of UTF-8 characters
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      s += buf;
    }
  }
  return s;
}

std::vector<std::string> FileDataset::sample_prompts() const {
  // The start of the held-out split (up to 32 tokens), cut after the last space for text.
  const int64_t n = std::min<int64_t>(32, eval_tokens());
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(tokens_.token(train_end_ + i));
  if (!is_bytes()) return {decode(ids)};
  std::string text(ids.begin(), ids.end());
  size_t cut = text.find_last_of(' ');
  if (cut != std::string::npos && cut > 8) text = text.substr(0, cut + 1);
  return {text};
}

}  // namespace examples
