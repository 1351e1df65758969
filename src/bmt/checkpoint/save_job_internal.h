// SaveJob: the part of a sharded save that runs after the collective planning, on every rank, inline (sync) or on
// a background thread (async). It never calls a collective, so it can run while training continues.
//
// Protocol inside the temporary directory (a shared filesystem):
//   every rank: write + fsync its shard file, then durably write (under a temporary name, then renamed) "rank-XXXXX.done" (the file's size and CRCs), or
//               "rank-XXXXX.failed" (the error) on failure;
//   rank 0:     waits (up to the configured timeout) until every rank's .done exists (a .failed ends the wait
//               with that rank's error), writes the metadata file last, removes the .done files and commits the
//               directory (atomic_dir.h). On any failure it deletes the temporary directory, and deletes it
//               again once every rank has agreed on the failure (sharded_checkpoint.cpp): a rank still writing
//               when rank 0 failed may have left files behind. A failed rank removes its partial shard before
//               writing its marker, so that a full disk has room for the marker.
// finish() joins the thread; the caller then agrees on the outcome with a collective (sharded_checkpoint.cpp).
#pragma once

#include <atomic>
#include <memory>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/shard_writer_internal.h"

namespace bmt::checkpoint::detail {

struct SaveJobSpec {
  std::string dir, tmp_dir;
  int rank = 0, world_size = 1;
  std::vector<WriteItem> items;       // this rank's pieces (sync), or
  std::unique_ptr<ShardSnapshot> snapshot;  // their host snapshot (async)
  int64_t file_nbytes = 0;            // this rank's planned file size
  CheckpointMetadata meta_template;   // rank 0: everything but files and created_unix_ms
  bool allow_exchange = true;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

class SaveJob {
 public:
  explicit SaveJob(SaveJobSpec spec) : spec_(std::move(spec)) {}
  ~SaveJob();
  SaveJob(const SaveJob&) = delete;
  SaveJob& operator=(const SaveJob&) = delete;

  void start_async();
  void run();     // inline
  // Records a failure that happened before the write (e.g. the host snapshot) the same way a write failure is.
  void run_failed(const std::string& error);
  void finish();  // joins the thread (if any)

  const std::string& error() const { return error_; }  // "" when this rank's part succeeded
  double write_s() const { return write_s_; }
  const WriteProfile& profile() const { return profile_; }
  double total_s() const { return total_s_; }
  int64_t rank_nbytes() const { return spec_.file_nbytes; }
  const std::string& tmp_dir() const { return spec_.tmp_dir; }
  bool finished() const { return finished_; }
  std::chrono::steady_clock::time_point started{std::chrono::steady_clock::now()};

 private:
  void body();
  void finalize_rank0();

  SaveJobSpec spec_;
  std::thread thread_;
  std::string error_;
  double write_s_ = 0, total_s_ = 0;
  WriteProfile profile_;
  std::atomic<bool> finished_{false};
};

std::string done_file_name(int rank);
std::string failed_file_name(int rank);

}  // namespace bmt::checkpoint::detail
