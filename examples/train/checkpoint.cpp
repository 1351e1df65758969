#include "train/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "train/test_kill.h"

namespace examples {

namespace {

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // the rename itself succeeded; a directory that cannot be opened has nothing to flush
  ::fsync(fd);
  ::close(fd);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> list_names(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Not std::filesystem::remove_all: libtorch.so exports an incompatible one that crashes (tests/examples note).
void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& n : list_names(path)) remove_tree(join(path, n));
    BMT_CHECK(::rmdir(path.c_str()) == 0 || errno == ENOENT, "cannot remove ", path, ": ", std::strerror(errno));
  } else {
    BMT_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, "cannot remove ", path, ": ", std::strerror(errno));
  }
}

// "step_00000042" -> 42; -1 for any other name (temporary "step_*.tmp-*" folders included).
int64_t step_of(const std::string& name) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

std::vector<std::string> prune_old(const std::string& root, const std::string& keep_name, int64_t keep_last) {
  std::vector<std::string> steps;
  for (const std::string& n : list_names(root))
    if (step_of(n) >= 0 && is_dir(join(root, n))) steps.push_back(n);  // sorted: zero-padded names
  std::vector<std::string> removed;
  if (keep_last <= 0 || static_cast<int64_t>(steps.size()) <= keep_last) return removed;
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < steps.size(); ++i) {
    if (steps[i] == keep_name) continue;
    remove_tree(join(root, steps[i]));
    removed.push_back(join(root, steps[i]));
  }
  fsync_directory(root);
  return removed;
}

bmt::checkpoint::TrainingState training_state(LanguageModel& model, bmt::optim::OptimManager& optim) {
  bmt::checkpoint::TrainingState state;
  state.model = &model;
  state.add("optim", optim);
  return state;
}

// One line: the library's agreed errors list every rank's message on its own line.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  std::string out;
  for (char c : s)
    if (!(c == ' ' && !out.empty() && out.back() == ' ')) out += c;
  return out;
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08ld", static_cast<long>(step));
  return buf;
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BMT_CHECK(fd >= 0, "cannot create '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  int err = 0;
  while (done < contents.size()) {
    const ssize_t w = ::write(fd, contents.data() + done, contents.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    BMT_ERROR("cannot write '", tmp, "': ", std::strerror(err), " (disk full?)");
  }
  BMT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path, "': ",
            std::strerror(errno));
  fsync_directory(parent_of(path));
}

namespace {

[[noreturn]] void save_failed(const std::string& root, int64_t step, const std::exception& e) {
  std::string latest;
  std::ifstream(join(root, "latest")) >> latest;
  BMT_ERROR("checkpoint of step ", step, " failed: ", one_line(e.what()), ". The partial folder was removed; ",
            latest.empty() ? std::string("there is no earlier checkpoint") : join(root, latest) + " is intact",
            ". Free space or choose another --save-dir (--keep-last K bounds the space used)");
}

}  // namespace

CheckpointInFlight start_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                                    bmt::optim::OptimManager& optim, int64_t keep_last, bool async) {
  const auto& cfg = bmt::config();
  CheckpointInFlight out;
  out.root = root;
  out.name = step_dir_name(step);
  out.step = step;
  out.keep_last = keep_last;
  if (cfg.rank == 0) {  // a failure shows as the save's own (agreed) error below
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
  }
  bmt::checkpoint::TrainingState state = training_state(model, optim);
  state.step = step;
  state.user_metadata = {{"trainer.step", std::to_string(step)},
                         {"trainer.world_size", std::to_string(cfg.world_size)},
                         {"trainer.tp_size", std::to_string(cfg.tp_size)}};
  bmt::checkpoint::SaveOptions options;
  options.async = async;
  try {
    out.handle = bmt::checkpoint::save(join(root, out.name), state, options);  // collective; same error everywhere
  } catch (const std::exception& e) {
    save_failed(root, step, e);
  }
  return out;
}

SavedCheckpoint finish_checkpoint(CheckpointInFlight& in_flight) {
  SavedCheckpoint out;
  out.dir = join(in_flight.root, in_flight.name);
  try {
    in_flight.handle.wait();  // collective: throws on every rank if any rank's files failed
  } catch (const std::exception& e) {
    save_failed(in_flight.root, in_flight.step, e);
  }
  test_kill_point("commit", in_flight.step);  // the folder is committed, `latest` not yet moved
  if (bmt::config().rank == 0) {
    write_file_atomic(join(in_flight.root, "latest"), in_flight.name + "\n");
    out.removed = prune_old(in_flight.root, in_flight.name, in_flight.keep_last);
  }
  bmt::synchronize();
  return out;
}

SavedCheckpoint save_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                                bmt::optim::OptimManager& optim, int64_t keep_last) {
  CheckpointInFlight in_flight = start_checkpoint(root, step, model, optim, keep_last, /*async=*/false);
  return finish_checkpoint(in_flight);
}

std::optional<ResumeInfo> load_checkpoint(const std::string& root, LanguageModel& model,
                                          bmt::optim::OptimManager& optim) {
  const std::string latest = join(root, "latest");
  struct stat st {};
  if (::stat(latest.c_str(), &st) != 0) return std::nullopt;
  std::string name;
  std::ifstream(latest) >> name;
  const std::string fix = "resume from an earlier checkpoint by writing its folder name (ls " + root +
                          ") into " + latest + ", or delete " + latest + " to start over";
  BMT_CHECK(!name.empty(), "cannot resume: ", latest, " is empty; ", fix);
  ResumeInfo info;
  info.dir = join(root, name);
  bmt::checkpoint::TrainingState state = training_state(model, optim);
  bmt::checkpoint::LoadInfo loaded;
  try {
    loaded = bmt::checkpoint::load(info.dir, state);  // collective; verifies every byte it uses (CRC-32)
  } catch (const std::exception& e) {
    BMT_ERROR("cannot resume from ", info.dir, ": ", one_line(e.what()), ". Restore the damaged file or ", fix);
  }
  auto meta_int = [&](const char* key, int64_t fallback) {
    auto it = loaded.user_metadata.find(key);
    return it == loaded.user_metadata.end() ? fallback : std::stoll(it->second);
  };
  info.step = meta_int("trainer.step", loaded.step);
  info.saved_world_size = static_cast<int>(meta_int("trainer.world_size", loaded.saved_world_size));
  info.saved_tp_size = static_cast<int>(meta_int("trainer.tp_size", 1));
  info.rng_restored = loaded.rng_restored;
  return info;
}

}  // namespace examples
