// Training checkpoints of train_gpt (collective: every rank calls save/load together), in bmtrain's sharded
// format (bmt::checkpoint: one checksummed shard file per rank plus checkpoint.meta; `bmt-ckpt verify DIR` checks
// one). Layout under root:
//   root/step_<8 digits>/  one bmt::checkpoint directory: the model, the OptimManager (AdamW moments, LR schedule
//                          position, loss scale) and the RNG states, with user metadata trainer.step,
//                          trainer.world_size, trainer.tp_size and trainer.run_id. It loads at any world size and tp size
//                          (optimizer state re-cut, not restarted); the RNG states only at the same sizes.
//   root/latest            the name of the newest complete checkpoint directory
//   root/run_id            the run id of the run that claimed the folder (claim_save_dir)
// bmt::checkpoint::save writes into a temporary directory, fsyncs it and renames it into place; `latest` is
// replaced (written, fsynced, renamed, parent fsynced) only after that, and only then are older step folders
// beyond keep_last deleted. A crash or a failed save therefore leaves `latest` on a complete checkpoint.
// Run identity: a fresh run draws a run id, a resumed run keeps its checkpoint's; keep_last deletes only step
// folders of the same run id, and a fresh run refuses a folder already holding checkpoints (claim_save_dir).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/optim/optim_manager.h"
#include "models/language_model.h"

namespace examples {

struct SavedCheckpoint {
  std::string dir;                   // the step folder written
  std::vector<std::string> removed;  // older step folders deleted for keep_last
};

// Collective: a new random run id (16 hex digits), rank 0's on every rank.
std::string draw_run_id();

// Collective, before a run that has loaded no checkpoint saves into root: refuses (the same error on every rank) a
// root holding checkpoints (step_* folders or `latest`) -- another run's: they would be overwritten and pruned --
// naming the folder and the ways on (resumed: whether --resume found no `latest`). overwrite: deletes them instead
// (rank 0), and says so. A missing or empty root, or one with other files only, is fine. One exception: under
// --resume, a root without `latest` holding one step folder, of the run named in root/run_id (the run that claimed
// the folder last, killed between its first commit and its first `latest`), is that run starting over from step 0
// under its id (the folder is saved again when the run reaches it); its id is returned. Otherwise returns
// new_run_id. Either way root/run_id then names the returned id.
std::string claim_save_dir(const std::string& root, bool resume_requested, bool overwrite,
                           const std::string& new_run_id);

// keep_last > 0: keep the newest keep_last step folders of this run (run_id; the new one included), delete its
// older ones; 0 keeps all. Step folders of other runs (another run id, none, or unreadable) are never deleted.
// Throws bmt::core::Error on every rank when any rank failed (e.g. a full disk): the partial step folder is gone,
// `latest` and the earlier checkpoints are untouched.
SavedCheckpoint save_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                                bmt::optim::OptimManager& optim, int64_t keep_last, const std::string& run_id);

// --async-save: a checkpoint whose files are still being written in the background (bmt::checkpoint's async save:
// the state was copied (device or host memory) before start_checkpoint returned, so training may go on). `latest` moves
// only in finish_checkpoint, after every rank's files are committed: a crash meanwhile leaves `latest` on the
// previous checkpoint.
struct CheckpointInFlight {
  std::string root, name;
  int64_t step = 0, keep_last = 0;
  std::string run_id;  // prune_old deletes only this run's older folders
  bmt::checkpoint::SaveHandle handle;
};
// Collective. async = false writes before returning (save_checkpoint = start + finish).
CheckpointInFlight start_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                                    bmt::optim::OptimManager& optim, int64_t keep_last, const std::string& run_id,
                                    bool async);
// Collective: waits for the files, then moves `latest` and prunes; throws like save_checkpoint.
SavedCheckpoint finish_checkpoint(CheckpointInFlight& in_flight);

struct ResumeInfo {
  int64_t step = 0;  // steps already done
  int saved_world_size = 0, saved_tp_size = 0;
  bool rng_restored = false;  // false when the world or tp size changed
  std::string dir;
  std::string run_id;  // empty for checkpoints written before run ids
};
// Loads the checkpoint root/latest names; nullopt when there is no root/latest. Throws bmt::core::Error naming
// the damaged or missing file and the way out (an earlier step folder) on every rank.
std::optional<ResumeInfo> load_checkpoint(const std::string& root, LanguageModel& model,
                                          bmt::optim::OptimManager& optim);

// The step folder name, "step_00000042".
std::string step_dir_name(int64_t step);

// Writes `contents` to path durably and atomically (temp file, fsync, rename, fsync of the parent directory); on
// a failure (a full disk: the error names the path and the free space) the temporary file is removed.
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace examples
