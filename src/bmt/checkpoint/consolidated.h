// bmt::save(model, path) / bmt::load(model, path): one consolidated file with the unwrapped model's keys (the
// keys bmt::state_dict gives, full unsharded tensors, parameter dtypes), as .safetensors or .pt (tensor_file.h).
// Collective over bmt::config().comm (pipe_size == tp_size == 1).
//
// Streaming bounds:
//  * save: rank 0 assembles each tensor chunk by chunk (at most chunk_nbytes) from its own shard and the shards
//    received point-to-point from their owners (each element sent once, by the lowest rank holding it), and
//    appends it to the file. Rank 0 holds one chunk, plus, for .pt, the tensor being written (torch's zip writer
//    takes whole records): peak = chunk_nbytes for .safetensors, max(chunk, largest tensor) for .pt. Other ranks
//    hold nothing beyond their shards.
//  * load: rank 0 reads every needed tensor once, chunk by chunk, and sends each rank only the elements of its
//    shard (replicated tensors: the whole tensor). No rank ever holds a full model.
// Errors (missing file, corrupted header, missing / unexpected keys, shape or dtype mismatches) are listed
// together and raised on every rank; a failed save leaves `path` untouched (written to a temporary file first).
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "bmt/state_dict.h"

namespace bmt {

struct ConsolidatedOptions {
  int64_t chunk_nbytes = int64_t{64} << 20;
  std::map<std::string, std::string> metadata;  // safetensors "__metadata__" (ignored for .pt)
};

struct ConsolidatedStats {
  int64_t file_nbytes = 0;          // tensor bytes written / read
  int64_t rank0_peak_nbytes = 0;    // largest host buffer rank 0 held (chunk + format buffer)
  double seconds = 0;
};

ConsolidatedStats save(torch::nn::Module& model, const std::string& path, const ConsolidatedOptions& options = {});
LoadResult load(torch::nn::Module& model, const std::string& path, bool strict = true,
                const ConsolidatedOptions& options = {}, ConsolidatedStats* stats = nullptr);

}  // namespace bmt
