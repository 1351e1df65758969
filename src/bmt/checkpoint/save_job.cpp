#include "bmt/checkpoint/save_job_internal.h"

#include <cstdio>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/json_internal.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint::detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string encode_file_info(const ShardFileInfo& f) {
  Json blocks = Json::array();
  for (uint32_t c : f.block_crc32) blocks.push_back(c);
  return Json::object({{"name", Json(f.name)}, {"nbytes", Json(f.nbytes)}, {"crc32", Json(f.crc32)},
                       {"block_crc32", std::move(blocks)}})
      .dump();
}

ShardFileInfo decode_file_info(const std::string& s, const std::string& what) {
  Json j = Json::parse(s, what);
  ShardFileInfo f;
  f.name = j.at("name", what).as_string(what);
  f.nbytes = j.at("nbytes", what).as_int(what);
  f.crc32 = static_cast<uint32_t>(j.at("crc32", what).as_int(what));
  for (const Json& b : j.at("block_crc32", what).as_array(what)) f.block_crc32.push_back(static_cast<uint32_t>(b.as_int(what)));
  return f;
}

// A marker rank 0 polls for: written under a temporary name, then renamed, so that it is never seen half-written.
void write_marker(const std::string& path, const std::string& bytes) {
  write_file_durable(path + ".partial", bytes);
  rename_path(path + ".partial", path);
}

}  // namespace

std::string done_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.done", rank);
  return buf;
}
std::string failed_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.failed", rank);
  return buf;
}

SaveJob::~SaveJob() {
  if (thread_.joinable()) thread_.join();
}

void SaveJob::start_async() {
  thread_ = std::thread([this] { body(); });
}

void SaveJob::run() { body(); }

void SaveJob::run_failed(const std::string& error) {
  spec_.items.clear();
  spec_.snapshot.reset();
  error_ = error;
  try {
    write_marker(join_path(spec_.tmp_dir, failed_file_name(spec_.rank)), error_);
    if (spec_.rank == 0) remove_tree(spec_.tmp_dir);
  } catch (...) {
  }
  total_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  finished_ = true;
}

void SaveJob::finish() {
  if (thread_.joinable()) thread_.join();
}

void SaveJob::body() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = shard_file_name(spec_.rank);
  error_ = capture_error([&] {
    const std::string path = join_path(spec_.tmp_dir, name);
    const int64_t B = spec_.meta_template.checksum_block_nbytes;
    ShardFileInfo info = spec_.snapshot ? spec_.snapshot->write(path, name, B, &profile_)
                                        : write_shard_file(path, name, spec_.items, spec_.file_nbytes, B, &profile_);
    spec_.items.clear();
    spec_.snapshot.reset();  // the host chunks are free for the next save
    write_s_ = seconds_since(t0);
    write_marker(join_path(spec_.tmp_dir, done_file_name(spec_.rank)), encode_file_info(info));
  });
  spec_.items.clear();
  spec_.snapshot.reset();
  if (!error_.empty()) {
    char need[96];
    std::snprintf(need, sizeof need, " [this rank's shard file needs %.1f MiB]",
                  static_cast<double>(spec_.file_nbytes) / (1 << 20));
    error_ += need;  // with a full disk's free space in the message: how much to free
    try {  // the partial shard first: on a full disk the marker needs its space
      remove_tree(join_path(spec_.tmp_dir, name));
    } catch (...) {
    }
    try {
      write_marker(join_path(spec_.tmp_dir, failed_file_name(spec_.rank)), error_);
    } catch (...) {
    }
  }
  if (spec_.rank == 0) {
    if (error_.empty()) error_ = capture_error([&] { finalize_rank0(); });
    if (!error_.empty()) {
      try {
        remove_tree(spec_.tmp_dir);
      } catch (...) {
      }
    }
  }
  total_s_ = seconds_since(started);
  finished_ = true;
}

void SaveJob::finalize_rank0() {
  CheckpointMetadata meta = spec_.meta_template;
  meta.files.resize(static_cast<size_t>(spec_.world_size));
  std::vector<bool> have(static_cast<size_t>(spec_.world_size), false);
  int remaining = spec_.world_size;
  const auto deadline = std::chrono::steady_clock::now() + spec_.timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (remaining > 0) {
    for (int r = 0; r < spec_.world_size; ++r) {
      if (have[static_cast<size_t>(r)]) continue;
      const std::string failed = join_path(spec_.tmp_dir, failed_file_name(r));
      if (path_exists(failed)) BMT_ERROR("rank ", r, " could not write its shard: ", read_file(failed, 1 << 20));
      const std::string done = join_path(spec_.tmp_dir, done_file_name(r));
      if (!path_exists(done)) continue;
      ShardFileInfo f = decode_file_info(read_file(done, kMaxMetadataNbytes), done);
      BMT_CHECK(f.name == shard_file_name(r), "unexpected done file content in ", done);
      meta.files[static_cast<size_t>(r)] = std::move(f);
      have[static_cast<size_t>(r)] = true;
      --remaining;
    }
    if (remaining == 0) break;
    BMT_CHECK(std::chrono::steady_clock::now() < deadline, "timed out after ", spec_.timeout.count(), " ms waiting for ",
              remaining, " rank(s) to finish writing their shards into ", spec_.tmp_dir,
              " (a rank died, or the directory is not on a filesystem shared by all ranks)");
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
  }
  meta.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  write_file_durable(join_path(spec_.tmp_dir, kMetadataFileName), serialize_metadata(meta));
  for (int r = 0; r < spec_.world_size; ++r) remove_tree(join_path(spec_.tmp_dir, done_file_name(r)));
  commit_directory(spec_.tmp_dir, spec_.dir, spec_.allow_exchange);
}

}  // namespace bmt::checkpoint::detail
