// Umbrella header of bmtrain's checkpointing:
//   consolidated.h        bmt::save / bmt::load: one .safetensors or .pt file with the unwrapped model's keys
//   sharded_checkpoint.h  bmt::checkpoint::save / load: sharded, resharding, atomic, optionally async, with
//                         optimizer, LR-scheduler, loss-scale and RNG state
//   sharded_state.h       ShardedStateProvider: how optimizer-like state takes part (adapters for OptimManager,
//                         BmtOptimizer, LR schedulers)
//   checkpoint_reader.h   CheckpointReader: reading a sharded checkpoint in one process
//   export.h              export_consolidated / describe_checkpoint (what the bmt-ckpt tool runs)
//   tensor_file.h         the consolidated file readers and writers
//   tp_layout.h           how TP-split parameters are stored (stacked tp pieces) and re-cut for another tp size
#pragma once

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/export.h"
#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/checkpoint/sharded_state.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/tp_layout.h"
