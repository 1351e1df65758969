// Dataset: the token source of train_gpt. Every batch is a CPU int64 tensor (rows, seq + 1): inputs are
// [:, :seq], next-token targets [:, 1:].
//
// Determinism and sharding: train_batch(step, rank, ...) is a pure function of (seed, step, rank), so ranks see
// different data, a resumed run sees exactly the batches it would have seen, and nothing is stored between
// steps. Held-out data (eval_batch, task_batch) never overlaps the training split.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace examples {

// Exact-match task: predict tokens[:, answer_begin, answer_begin + answer_len) from the tokens before them.
// Greedy decoding gets a row right iff every teacher-forced argmax over the answer span is right, so one forward
// pass scores the whole batch.
struct TaskBatch {
  at::Tensor tokens;  // (rows, len) int64
  int64_t answer_begin = 0, answer_len = 0;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string describe() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual at::Tensor train_batch(int64_t step, int rank, int64_t rows, int64_t seq) const = 0;
  // Held-out rows; `index` enumerates disjoint eval batches (deterministic).
  virtual at::Tensor eval_batch(int64_t index, int64_t rows, int64_t seq) const = 0;
  // The first `rows` held-out task examples, for datasets with a task (else nullopt).
  virtual std::optional<TaskBatch> task_batch(int64_t rows) const { return std::nullopt; }

  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual std::vector<std::string> sample_prompts() const = 0;
  virtual int64_t stop_token() const { return -1; }  // generation stops after emitting it (-1: none)
  // A short verdict on a generated completion (e.g. "= 82, correct"), or "" when the data has no answer key.
  virtual std::string annotate(const std::string& prompt, const std::string& completion) const { return ""; }
};

struct DataOptions {
  std::string path;         // empty: the embedded synthetic task; *.bin: token file; anything else: bytes
  std::string format = "auto";  // auto | synthetic | text | bin
  uint64_t seed = 0;
  double eval_fraction = 0.1;  // tail of a file held out for evaluation
};

std::unique_ptr<Dataset> make_dataset(const DataOptions& options);

// splitmix64: the deterministic mixing used for every data-side random choice.
uint64_t mix64(uint64_t x);
uint64_t mix64(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0);

}  // namespace examples
