// Sharded distributed checkpoints: bmt::checkpoint::save(dir, state) / load(dir, state).
//
// Directory layout: "checkpoint.meta" (metadata.h: format version, global shapes/dtypes, where every slice lives,
// CRC-32s per file and per block) and one "rank-XXXXX.bin" per rank holding that rank's local slices. Every
// element is stored once (replicated tensors by rank 0).
//
// save (collective over bmt::config().comm, every rank calls it with the same state structure):
//  1. collects this rank's slices: model parameters/buffers (model/...), each component's state (sharded_state.h),
//     RNG states (rng/<rank>/...), and exchanges the declarations to plan who writes what;
//  2. rank 0 repairs/cleans leftovers of interrupted saves and creates "<dir>.tmp-<random>";
//  3. every rank writes its shard file in parallel; rank 0 writes the metadata last and atomically replaces
//     "<dir>" (atomic_dir.h). A crash at any point leaves the previous or the new checkpoint loadable.
//  Async mode: step 3 runs on a background thread from a host snapshot of this rank's pieces (shard_writer_internal.h:
//  device tensors are copied into pinned host chunks on a side stream and the compute stream waits for those copies,
//  so save() returns without waiting for them; host tensors are memcpy'd before it returns; the chunks are kept for
//  the next save, release_snapshot_buffers() frees them). SaveStats::stall_s reports how long the caller was
//  blocked. Only one save is in flight: a new save, wait_pending_save, load, or the handle's destruction at program
//  end first waits for the previous one; its error is thrown there (naming the file). SaveHandle::wait() is
//  collective.
//
// load (collective): every rank opens the checkpoint (CheckpointReader), checks the model (missing / unexpected
// keys, shape and dtype mismatches) and each component's state (unknown parameters, shapes) and reports every
// problem of every rank together in one error before changing anything; then reads only the byte ranges that
// overlap its current shards (any world size, ZeRO level or Block layout; rounded out to the enclosing checksum
// blocks, 1 MiB by default, so that every byte used is verified) and restores the RNG states when the
// world size and tp size are unchanged. The model's tensors, then the optimizer state (for optimizers that take
// placeholders: BmtOptimizer::accepts_state_placeholders), are read straight into place, each part as one batch of
// parallel verified reads (host tensors directly, CUDA tensors through pinned staging and a side stream); a
// checksum mismatch found during these reads ("the checkpoint is damaged: ...") leaves the state partly loaded.
// Tensor parallelism: model keys are the unwrapped model's with LOGICAL shapes (mismatches list logical shapes). A
// TP-split parameter and its optimizer states are stored as the stacked tp pieces (tp_layout.h), so at the same
// tp size each rank reads one contiguous range; at another tp size (or into an unsplit model, tp 1) each rank
// rebuilds the rows of its new piece that its shard touches from the overlapping saved pieces, one parameter at a
// time. Replicated parameters keep the plain layout, so checkpoints of dp-only models are unchanged and load at
// any tp size. Errors during reading (checksum mismatch naming the file, missing or truncated files)
// are agreed on, so every rank throws the same message.
#pragma once

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/sharded_state.h"

namespace bmt::checkpoint {

struct TrainingState {
  torch::nn::Module* model = nullptr;
  std::vector<std::pair<std::string, std::shared_ptr<ShardedStateProvider>>> components;  // name -> state
  int64_t step = 0;
  bool rng = true;  // save the RNG states
  std::map<std::string, std::string> user_metadata;

  TrainingState& add(const std::string& name, std::shared_ptr<ShardedStateProvider> provider);
  TrainingState& add(const std::string& name, optim::OptimManager& manager);
  TrainingState& add(const std::string& name, optim::BmtOptimizer& optimizer);
  TrainingState& add(const std::string& name, optim::lr_scheduler::WarmupLRScheduler& scheduler);
};

struct SaveOptions {
  bool async = false;
  int64_t checksum_block_nbytes = kDefaultChecksumBlockNbytes;
  bool allow_exchange = true;  // commit with renameat2(RENAME_EXCHANGE) where supported (else rename protocol)
  // Async saves whose host buffers are not ready (no earlier async save, no prepare_async_save) copy the GPU state
  // into device memory instead, when the GPU has room beside the peak of the steps so far, and stage it to the
  // file from there (stall: milliseconds, not the seconds pinning the whole file takes; the copy is freed once
  // written). false, or BMT_CKPT_DEVICE_STAGING=0: always the pinned host snapshot.
  bool device_staging = true;
};

struct SaveStats {
  double stall_s = 0;     // time save() blocked the caller (includes waiting for a previous async save)
  double snapshot_s = 0;  // part of the stall spent on the host snapshot (async: host pieces copied, device
                          // copies enqueued on a side stream that the compute stream then waits for)
  double write_s = 0;     // writing + fsync of this rank's shard file
  bool device_staged = false;  // async: the snapshot went to device memory (SaveOptions::device_staging)
  // Profile of this rank's save (seconds): collecting the slices and planning (collectives), then the shard
  // write's thread: waiting for staged bytes (device → host copies, memcpy), write syscalls, waiting for the
  // checksum workers, the final fsync + close.
  double plan_s = 0, wait_data_s = 0, write_syscalls_s = 0, crc_wait_s = 0, fsync_s = 0;
  double total_s = 0;     // save() entry to the end of this rank's part (rank 0: to the commit)
  int64_t rank_nbytes = 0;   // size of this rank's shard file
  int64_t total_nbytes = 0;  // all shard files
  std::string dir;
};

namespace detail {
class SaveJob;
}

class SaveHandle {
 public:
  SaveHandle() = default;
  // Collective: waits until the checkpoint is committed; throws on every rank if any rank failed.
  // A second call returns the same stats.
  SaveStats wait();
  bool valid() const { return state_ != nullptr; }
  // True once this rank's part is done (non-blocking, local).
  bool done() const;
  // How long save() blocked the caller; known as soon as save() returns.
  double stall_s() const;

  struct State;

 private:
  explicit SaveHandle(std::shared_ptr<State> s) : state_(std::move(s)) {}
  std::shared_ptr<State> state_;
  friend SaveHandle save(const std::string&, const TrainingState&, const SaveOptions&);
};

SaveHandle save(const std::string& dir, const TrainingState& state, const SaveOptions& options = {});
// Collective: waits for the async save in flight, if any.
void wait_pending_save();
// Collective, once the model and optimizer exist (e.g. before the training loop) when async saves will follow:
// plans a save of `state` (a short collective) and starts allocating this rank's host buffers for it (pinned with
// CUDA: the whole shard file) on a background thread, so that the first async save does not pin them inside its
// stall (7.2 s at gpt-1.3b on an H200, against 0.12 s for later saves). A save issued before the buffers are
// ready waits for them. The buffers stay until release_snapshot_buffers(). Pinning holds the CUDA driver's lock:
// training steps issued meanwhile stall (one gpt-1.3b step took 10.3 s on an H200), so prefer the device staging
// of SaveOptions (no preparation, 0.064 s stall) where the GPU has room.
void prepare_async_save(const TrainingState& state);
// Local: true when no preparation of prepare_async_save is still running on this rank.
bool async_save_prepared();
// Frees the host buffers (pinned with CUDA) that saves keep for reuse: an async save holds its whole shard file
// there. Waits for a pending save first (collective then).
void release_snapshot_buffers();

struct LoadOptions {
  bool strict = true;  // missing or unexpected model keys are errors
  bool rng = true;     // restore RNG states (only when the world size and tp size are unchanged)
};

struct LoadInfo {
  std::string path;  // the directory actually read
  int64_t step = 0;
  int saved_world_size = 0;
  std::map<std::string, std::string> user_metadata;
  std::vector<std::string> missing_keys, unexpected_keys;  // model keys (strict = false)
  bool rng_restored = false;
  // Profile: checking the checkpoint against the state, reading the small entries (check_s), then applying
  // (apply_s): the model's tensors (model_s, model_bytes_read) and the components' state (state_s,
  // state_bytes_read; load_state_dict + the state tensors read into place), the RNG states. bytes_read: all bytes
  // read from shard files.
  double check_s = 0, apply_s = 0, model_s = 0, state_s = 0;
  int64_t bytes_read = 0, model_bytes_read = 0, state_bytes_read = 0;
};

// Fills the model, every component, state.step and state.user_metadata.
LoadInfo load(const std::string& dir, TrainingState& state, const LoadOptions& options = {});

}  // namespace bmt::checkpoint
