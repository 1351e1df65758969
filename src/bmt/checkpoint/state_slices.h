// What a rank contributes to a checkpoint and where loaded values go, for the model and the RNG states.
//
// LocalSlice: elements [begin, end) of the flattened global tensor `decl.key`, held in `data` (numel == end -
// begin, any device, row-major order of the global tensor). LoadTarget: the same range of an entry, to be written
// into `dst` (whose logical row-major order is that range).
//
// Model entries use the unwrapped model's keys (bmt::state_dict's) under "model/": a DistributedParameter
// contributes its shard [shard_begin, shard_end) of full_shape (the same rule inside and outside Blocks);
// plain parameters and buffers are replicated, so every rank declares the whole tensor (the plan writes rank 0's
// copy once). A tp-replicated parameter is declared identically by every tp rank (written once). A TP-split
// parameter is stored as its stacked pieces (tp_layout.h): entry shape (tp_size, *piece_shape) with tp attrs, and
// this rank declares [tp_rank * piece_numel + shard_begin, tp_rank * piece_numel + shard_end).
// On load, entries are matched by LOGICAL shape; an entry saved with another tp layout (another tp size, or split
// vs unsplit) is re-cut by read_param_range.
// RNG entries "rng/<rank>/cpu" and "rng/<rank>/cuda:<i>" hold a rank's generator states (uint8; with tp_size > 1
// an attr "tp_size"); they are restored only at the same world size and tp size (otherwise the current, per-rank
// seeded generators are kept).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/checkpoint/tensor_dtype.h"
#include "bmt/checkpoint/tp_layout.h"

namespace bmt::checkpoint {

struct LocalSlice {
  SliceDecl decl;
  at::Tensor data;
  // `data` is a copy nobody else writes (optimizer and scheduler state dicts, RNG states): an async save may keep
  // it as its snapshot instead of copying it again. Live tensors (model parameters) are copied.
  bool private_copy = false;
};



// The unwrapped model's parameter and buffer names, by TensorImpl (stable across Block's set_data).
std::unordered_map<const void*, std::string> param_names(torch::nn::Module& model);

// Global (stored) shape and local element range of a parameter (DistributedParameter or plain tensor).
struct ParamRange {
  TpLayout layout;                  // logical shape and tp split
  int tp_rank = 0;                  // the piece held here (0 when not split)
  std::vector<int64_t> full_shape;  // the entry's shape: layout.stored_shape()
  int64_t begin = 0, end = 0;       // elements of the flattened entry held here
  // The same range inside the flattened piece tp_rank.
  int64_t piece_begin() const { return begin - (layout.is_split() ? tp_rank * layout.piece_numel() : 0); }
  int64_t piece_end() const { return end - (layout.is_split() ? tp_rank * layout.piece_numel() : 0); }
};
ParamRange param_range(const at::Tensor& p, const std::string& name);

// Where loaded values of a model tensor go: elements r.begin..r.end of the entry, written into `dst`.
struct LoadTarget {
  std::string key;
  std::string dtype;  // required dtype (safetensors name)
  ParamRange range;
  at::Tensor dst;
};

// The elements [r.begin, r.end) of r's layout (1-D CPU tensor) from checkpoint entry `e`, whose logical shape must
// equal r.layout's: a direct range read when e was stored with the same tp layout, else the piece is re-cut from
// e's pieces (tp_layout.h; one parameter's overlapping rows at a time).
at::Tensor read_param_range(CheckpointReader& reader, const EntryMeta& e, const ParamRange& r);
// True when `e` holds r's elements as the plain range [r.begin, r.end) (stored with r's tp layout: no re-cut).
bool stored_like(const EntryMeta& e, const ParamRange& r);
// "" when entry `e` can fill r (same dtype and logical shape), else "checkpoint has F32 [16, 8], model has ...".
std::string entry_mismatch(const EntryMeta& e, const std::string& dtype, const ParamRange& r);

std::vector<LocalSlice> model_slices(torch::nn::Module& model, const std::string& prefix = "model/");
std::vector<LoadTarget> model_targets(torch::nn::Module& model, const std::string& prefix = "model/");

// The generators of this process as slices of `rank` (their attributes record tp_size when it is > 1).
std::vector<LocalSlice> rng_slices(int rank, int tp_size);
// Restores the generators of `rank` from entries read by `read_entry(key)` (undefined tensor when absent).
// Returns the number of generators restored.
int restore_rng(int rank, const std::function<at::Tensor(const std::string&)>& read_entry);

}  // namespace bmt::checkpoint
