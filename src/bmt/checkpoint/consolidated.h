// bmt::save(model, path) / bmt::load(model, path): one consolidated file with the unwrapped model's keys (the
// keys bmt::state_dict gives, full unsharded tensors, parameter dtypes), as .safetensors or .pt (tensor_file.h).
// Collective over bmt::config().comm (pipe_size == 1; any tp_size: the file always holds LOGICAL tensors).
//
// Streaming bounds:
//  * save: rank 0 assembles the file's bytes in two staging buffers of chunk_nbytes / 2 (pinned when its tensors
//    are on a GPU) from its own shard and the shards received point-to-point from their owners (each element sent
//    once, by the lowest rank holding it); a background thread writes one buffer (sync_file_range write-back
//    after each write, one fsync at the end) while the other is filled (staged_appender_internal.h). Rank 0
//    holds one chunk, plus, for .pt, the tensor being written (torch's zip writer takes whole records): peak =
//    chunk_nbytes for .safetensors, chunk + largest tensor for .pt. Other ranks hold nothing beyond their shards.
//  * load: rank 0 reads every needed tensor once, chunk by chunk, and sends each rank only the elements of its
//    shard (replicated tensors: the whole tensor). No rank ever holds a full model.
// Tensor parallelism (tp_size > 1): a TP-split parameter's pieces are written as the logical tensor. Split along
//  dim 0 the pieces are consecutive in logical order and stream like any tensor; split along a later dim, rank 0
//  streams chunks of whole logical rows, each assembled from the same rows of every tp piece (received from their
//  owners), so it holds about twice a chunk (at least one logical row per chunk) — never the whole parameter.
//  Load: each rank receives the logical rows its piece's shard touches (about tp_size x its shard) and cuts its
//  elements out of them locally (the slicing scatter_logical does, without materialising the logical tensor).
// Errors (missing file, corrupted header, missing / unexpected keys, shape or dtype mismatches) are listed
// together and raised on every rank; a failed save leaves `path` untouched (written to a temporary file first).
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "bmt/params/module_state.h"

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
