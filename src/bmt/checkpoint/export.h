// Offline tools over a sharded checkpoint, in one process without a communicator (what bmt-ckpt runs):
// consolidated export of the model and a human-readable summary.
//
// export_consolidated assembles each full tensor from its pieces chunk by chunk (every byte checksum-verified) and
// streams it into a .safetensors or .pt file (tensor_file.h) under the unwrapped model's keys, so the result equals
// what bmt::save would have written at save time. Peak memory: one chunk (+ the largest tensor for .pt).
// Entries of TP-split parameters (stacked tp pieces, tp_layout.h) are written as LOGICAL tensors: split along dim 0
// they stream unchanged; split along a later dim, each chunk of whole logical rows is assembled from the same rows
// of every piece (peak about twice a chunk, at least one logical row).
#pragma once

#include <cstdint>
#include <string>

namespace bmt::checkpoint {

struct ExportStats {
  int64_t num_tensors = 0;
  int64_t nbytes = 0;
  int64_t peak_buffer_nbytes = 0;
};

// Exports the entries under `prefix` (default: the model) with the prefix removed.
ExportStats export_consolidated(const std::string& checkpoint_dir, const std::string& out_path,
                                const std::string& prefix = "model/", int64_t chunk_nbytes = int64_t{64} << 20);

// Format version, world size, step, user metadata, files with sizes and checksums, and (with entries) one line per
// entry: key, dtype, shape, pieces.
std::string describe_checkpoint(const std::string& checkpoint_dir, bool entries);

}  // namespace bmt::checkpoint
