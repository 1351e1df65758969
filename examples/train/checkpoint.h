// Training checkpoints (collective: every rank calls save/load together).
//
// Layout under root:
//   root/step_<8 digits>/model.pt          consolidated model state (bmt::state_dict, full tensors — also with
//                                          tensor parallelism, so it loads at any tp), rank 0
//   root/step_<8 digits>/optim.rank<r>.pt  rank r's OptimManager state (its optimizer shard, loss scale, LR
//                                          schedule) plus trainer.step, trainer.world_size and trainer.tp_size
//   root/latest                            the name of the newest complete checkpoint directory
// Every file is written to "<name>.tmp" and renamed into place, and `latest` is replaced only after every rank
// has finished writing, so a crash leaves either the previous or the new checkpoint, never a torn one.
// Files are torch::serialize archives of a flat name -> tensor map (bmt::optim::save_state_dict).
#pragma once

#include <optional>
#include <string>

#include "bmt/optim/optim_manager.h"
#include "models/language_model.h"

namespace examples {

// Returns the directory written.
std::string save_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                            const bmt::optim::OptimManager& optim);

struct ResumeInfo {
  int64_t step = 0;              // steps already done
  bool optimizer_restored = false;  // false when the world or tp size changed (shards no longer match)
  std::string dir;
};
// Loads root/latest; nullopt when there is no checkpoint. Throws bmt::core::Error on a damaged checkpoint.
std::optional<ResumeInfo> load_checkpoint(const std::string& root, LanguageModel& model, bmt::optim::OptimManager& optim);

// Writes `contents` to path atomically (temp file + rename).
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace examples
