// Reading a Hugging Face model directory (what transformers' save_pretrained writes) without copying it:
//   DIR/config.json                       the architecture's settings (HfConfig below)
//   DIR/model.safetensors                 one file, or
//   DIR/model.safetensors.index.json      {"weight_map": {tensor name: file name}} with the shards it names
// (neither: every DIR/*.safetensors). Headers are parsed with the safetensors format code of this library
// (safetensors_format_internal.h); a file is memory-mapped read-only when one of its tensors is first viewed, so a
// rank maps only the files it needs and the kernel pages in only the bytes it copies out.
//
// load_hf_safetensors fills a model of DistributedParameters (ZeRO-sharded, inside Blocks or not, TP-split or not)
// from such a directory through a name map (our key -> HF tensor, optionally transposed): every rank copies only the
// elements of its own shard — of its tp piece (rows or columns of the mapped tensor, Q/K/V blocks of a grouped
// split) — straight from the mapping; no rank materialises a full tensor. Not collective except for the final
// agreement on errors (every rank raises if any failed).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bmt/checkpoint/tensor_info.h"
#include "bmt/params/module_state.h"

namespace bmt::checkpoint {

// config.json's top-level values; a missing key or one of another type throws naming the key and the file.
class HfConfig {
 public:
  HfConfig() = default;
  HfConfig(const std::string& json_text, const std::string& what);
  ~HfConfig();
  HfConfig(const HfConfig&);
  HfConfig& operator=(const HfConfig&);

  bool has(const std::string& key) const;      // present and not null
  std::vector<std::string> keys() const;       // in file order
  int64_t get_int(const std::string& key) const;
  double get_double(const std::string& key) const;  // ints convert
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  // The first string of an array value ("architectures"); "" when absent.
  std::string first_string(const std::string& key) const;
  // A nested object's value as its own config ("rope_parameters"); absent: an empty config.
  HfConfig object(const std::string& key) const;
  // Compact JSON of one value ("null" when absent), for messages.
  std::string dump(const std::string& key) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string what_;
};

class HfDir {
 public:
  // Reads config.json and the index (or the safetensors headers). Errors name the directory and the fix.
  explicit HfDir(const std::string& dir);
  ~HfDir();
  HfDir(const HfDir&) = delete;
  HfDir& operator=(const HfDir&) = delete;

  const std::string& path() const { return dir_; }
  const HfConfig& config() const { return config_; }
  std::vector<std::string> tensor_names() const;  // sorted
  bool has(const std::string& name) const { return file_of_.count(name) > 0; }
  // Name, dtype, shape (reads the header of the tensor's file on first use).
  const TensorInfo& info(const std::string& name);
  // A CPU tensor over the mapped bytes: no copy. Read-only (the mapping is PROT_READ); it keeps the mapping alive.
  at::Tensor view(const std::string& name);

  // The elements [begin, end) of v's row-major order (v: a view of view(), possibly transposed / narrowed),
  // copied into a new 1-D tensor, counted in bytes_copied().
  at::Tensor copy_range(const at::Tensor& v, int64_t begin, int64_t end);
  int64_t bytes_copied() const { return bytes_copied_; }
  int64_t files_mapped() const;

 private:
  struct File;
  File& file(const std::string& file_name);

  std::string dir_;
  HfConfig config_;
  std::map<std::string, std::string> file_of_;  // tensor name -> file name
  std::map<std::string, std::unique_ptr<File>> files_;
  int64_t bytes_copied_ = 0;
};

// One of our model's tensors from a Hugging Face tensor: ours = hf (transpose: hf.t(), for 2-D Conv1D weights).
// pad_rows: the model's dimension 0 may be longer (a vocabulary padded to a multiple of tp): the extra rows are 0.
struct HfSource {
  std::string name;
  bool transpose = false;
  bool pad_rows = false;
};
using HfNameMap = std::map<std::string, HfSource>;  // our state-dict key -> source

struct HfLoadOptions {
  bool strict = true;               // missing model keys, unused HF tensors and mismatches throw (listed together)
  std::set<std::string> ignore;     // HF tensors that may stay unused (e.g. a tied lm_head.weight)
};

struct HfLoadStats {
  int64_t bytes_copied = 0;   // tensor bytes this rank copied out of the mapped files
  int64_t bytes_needed = 0;   // what this rank's shards hold, in the files' dtypes (equal to bytes_copied)
  int64_t files_mapped = 0;
};

// Fills every parameter and buffer of `model` named in `map` from `dir`. A dtype different from the parameter's
// is converted. Collective only for the final error agreement (config().comm; local when bmt is not initialised).
LoadResult load_hf_safetensors(torch::nn::Module& model, HfDir& dir, const HfNameMap& map,
                               const HfLoadOptions& options = {}, HfLoadStats* stats = nullptr);
LoadResult load_hf_safetensors(torch::nn::Module& model, const std::string& dir, const HfNameMap& map,
                               const HfLoadOptions& options = {}, HfLoadStats* stats = nullptr);

}  // namespace bmt::checkpoint
