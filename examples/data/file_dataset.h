// FileDataset: training windows over a token file (byte-level text or a uint16 `.bin`, data/token_file.h).
//
// The first (1 - eval_fraction) of the tokens are the training split, the rest the held-out split. A training
// row is the seq + 1 tokens at a random offset of the training split (offset = hash(seed, step, rank, row));
// eval batches walk the held-out split in consecutive windows. Byte files have vocab 256 and decode to text;
// token files have vocab 50304 (GPT-2's 50257 rounded up to a multiple of 64) unless a larger token id appears,
// and decode to bracketed ids since no tokenizer is embedded.
#pragma once

#include "data/dataset.h"
#include "data/token_file.h"

namespace examples {

class FileDataset : public Dataset {
 public:
  FileDataset(TokenFile tokens, uint64_t seed, double eval_fraction);

  std::string describe() const override;
  int64_t vocab_size() const override { return vocab_size_; }
  at::Tensor train_batch(int64_t step, int rank, int64_t rows, int64_t seq) const override;
  at::Tensor eval_batch(int64_t index, int64_t rows, int64_t seq) const override;
  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  std::vector<std::string> sample_prompts() const override;

  int64_t train_tokens() const { return train_end_; }
  int64_t eval_tokens() const { return tokens_.num_tokens - train_end_; }

 private:
  at::Tensor window_rows(const std::vector<int64_t>& offsets, int64_t seq) const;
  bool is_bytes() const { return tokens_.bytes_per_token == 1; }

  TokenFile tokens_;
  uint64_t seed_;
  int64_t train_end_;  // tokens [0, train_end_) train, [train_end_, num_tokens) eval
  int64_t vocab_size_;
};

}  // namespace examples
