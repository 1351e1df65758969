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

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/file_io.h"
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

// The run id a step folder's metadata names; empty when it has none or cannot be read (then it is not ours).
std::string run_id_of(const std::string& dir) {
  try {
    const bmt::checkpoint::CheckpointReader reader(dir);
    const auto& meta = reader.metadata().user_metadata;
    auto it = meta.find("trainer.run_id");
    return it == meta.end() ? std::string() : it->second;
  } catch (const std::exception&) {
    return "";
  }
}

std::vector<std::string> step_folders(const std::string& root) {
  std::vector<std::string> steps;
  for (const std::string& n : list_names(root))
    if (step_of(n) >= 0 && is_dir(join(root, n))) steps.push_back(n);  // sorted: zero-padded names
  return steps;
}

// Only this run's step folders count and are deleted: another run's (or one without a run id) stay.
std::vector<std::string> prune_old(const std::string& root, const std::string& keep_name, int64_t keep_last,
                                   const std::string& run_id) {
  std::vector<std::string> removed;
  if (keep_last <= 0) return removed;
  std::vector<std::string> ours;
  for (const std::string& n : step_folders(root))
    if (n == keep_name || run_id_of(join(root, n)) == run_id) ours.push_back(n);
  if (static_cast<int64_t>(ours.size()) <= keep_last) return removed;
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < ours.size(); ++i) {
    if (ours[i] == keep_name) continue;
    remove_tree(join(root, ours[i]));
    removed.push_back(join(root, ours[i]));
  }
  fsync_directory(root);
  return removed;
}

// Printable: control bytes (a NUL included, which would cut a C string) and non-ASCII bytes as \xNN.
std::string escaped(const std::string& s) {
  std::string out;
  char buf[8];
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
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
  const std::string tmp = path + ".tmp";  // one fixed name: a killed writer leaves no pile of temporaries
  try {  // OutFile's errors name the file, strerror and, for a full disk, the free space
    bmt::checkpoint::OutFile out(tmp);
    out.write(contents.data(), static_cast<int64_t>(contents.size()));
    out.sync();
    out.close();
    bmt::checkpoint::rename_path(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(parent_of(path));
}


namespace {

// Rank 0's run id as a 60-bit number, the same on every rank (run ids are 15 hex digits).
std::string broadcast_run_id(const std::string& id_on_rank0) {
  const auto& cfg = bmt::config();
  const int64_t v = cfg.rank == 0 ? static_cast<int64_t>(std::stoull(id_on_rank0, nullptr, 16)) : 0;
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kLong).device(cfg.device));
  t = bmt::distributed::raw_broadcast(t, 0, *cfg.comm).cpu();
  char buf[24];
  std::snprintf(buf, sizeof buf, "%015llx", static_cast<unsigned long long>(t.item<int64_t>()));
  return buf;
}

// "a, b, c, d, ... (n entries)": the first four names.
std::string listing_of(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 4; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 4) out += ", ... (" + std::to_string(names.size()) + " entries)";
  return out;
}

bool is_run_id(const std::string& s) {
  return s.size() == 15 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

std::string draw_run_id() {
  // 60 random bits from rank 0 (fits an int64 exactly in any dtype path), the same id on every rank.
  return broadcast_run_id(bmt::checkpoint::random_hex_suffix().substr(0, 15));
}

std::string claim_save_dir(const std::string& root, bool resume_requested, bool overwrite,
                           const std::string& new_run_id) {
  const auto& cfg = bmt::config();
  std::vector<std::string> found = step_folders(root);
  const bool has_latest = bmt::checkpoint::path_exists(join(root, "latest"));
  // Rank 0 decides (ranks on other machines may not see the folder), every rank raises the same error.
  // 0: free; 1: holds checkpoints; 2: the run in root/run_id, killed before its first `latest`, starts over.
  int64_t decision = (!found.empty() || has_latest) ? 1 : 0;
  std::string restarted;
  // Before its first `latest` a run holds at most one committed step folder (a save waits for the previous one's
  // `latest`); more, or none of its own, is not that case (e.g. a user deleted `latest`): refused below.
  if (cfg.rank == 0 && decision == 1 && resume_requested && !has_latest && !overwrite && found.size() == 1) {
    std::string marker;
    std::ifstream(join(root, "run_id")) >> marker;
    bool all_of_it = is_run_id(marker);
    for (const std::string& n : found) all_of_it = all_of_it && run_id_of(join(root, n)) == marker;
    if (all_of_it) {
      decision = 2;
      restarted = marker;
    }
  }
  at::Tensor verdict = at::full({1}, decision, at::TensorOptions().dtype(at::kLong).device(cfg.device));
  decision = bmt::distributed::raw_broadcast(verdict, 0, *cfg.comm).cpu().item<int64_t>();
  auto mark = [&](const std::string& id) {  // rank 0 writes root/run_id; every rank gets the id
    if (cfg.rank == 0) {
      std::error_code ec;
      std::filesystem::create_directories(root, ec);
      write_file_atomic(join(root, "run_id"), id + "\n");
    }
    bmt::synchronize();
    return id;
  };
  if (decision == 0) return mark(new_run_id);
  if (decision == 2) {
    const std::string id = broadcast_run_id(cfg.rank == 0 ? restarted : new_run_id);
    if (cfg.rank == 0) {  // the folder stays until the run saves that step again (atomically, the same bytes)
      std::printf("--resume: %s has no `latest`: its run (id %s) stopped before its first checkpoint (%s) became "
                  "`latest`; starting that run over from step 0\n", root.c_str(), id.c_str(),
                  listing_of(found).c_str());
      std::fflush(stdout);
    }
    return mark(id);
  }
  if (has_latest) found.push_back("latest");
  const std::string listing = listing_of(found);
  if (overwrite) {
    if (cfg.rank == 0) {
      for (const std::string& n : found) remove_tree(join(root, n));
      fsync_directory(root);
      std::printf("--overwrite-checkpoints: deleted %s from %s\n", listing.c_str(), root.c_str());
      std::fflush(stdout);
    }
    bmt::synchronize();
    return mark(new_run_id);
  }
  BMT_CHECK(!resume_requested || has_latest, "--resume found no ", join(root, "latest"), " but ", root,
            " holds checkpoints (", listing, "): to continue from one, write its folder name into ",
            join(root, "latest"), " (echo ", found.empty() ? std::string("step_<n>") : found.back(), " > ",
            join(root, "latest"), "); to start a new run, "
            "choose a new --save-dir or add --overwrite-checkpoints (deletes them)");
  BMT_ERROR("the save folder ", root, " already holds checkpoints (", listing, ") of another run, which this fresh "
            "run would overwrite: continue that run with --resume, or start this one in a new --save-dir, or add "
            "--overwrite-checkpoints (deletes them first)");
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
                                    bmt::optim::OptimManager& optim, int64_t keep_last, const std::string& run_id,
                                    bool async) {
  const auto& cfg = bmt::config();
  CheckpointInFlight out;
  out.root = root;
  out.name = step_dir_name(step);
  out.step = step;
  out.keep_last = keep_last;
  out.run_id = run_id;
  if (cfg.rank == 0) {  // a failure shows as the save's own (agreed) error below
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
  }
  bmt::checkpoint::TrainingState state = training_state(model, optim);
  state.step = step;
  state.user_metadata = {{"trainer.step", std::to_string(step)},
                         {"trainer.world_size", std::to_string(cfg.world_size)},
                         {"trainer.tp_size", std::to_string(cfg.tp_size)},
                         {"trainer.run_id", run_id}};
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
    out.removed = prune_old(in_flight.root, in_flight.name, in_flight.keep_last, in_flight.run_id);
  }
  bmt::synchronize();
  return out;
}

SavedCheckpoint save_checkpoint(const std::string& root, int64_t step, LanguageModel& model,
                                bmt::optim::OptimManager& optim, int64_t keep_last, const std::string& run_id) {
  CheckpointInFlight in_flight = start_checkpoint(root, step, model, optim, keep_last, run_id, /*async=*/false);
  return finish_checkpoint(in_flight);
}

std::optional<ResumeInfo> load_checkpoint(const std::string& root, LanguageModel& model,
                                          bmt::optim::OptimManager& optim) {
  const std::string latest = join(root, "latest");
  struct stat st {};
  if (::stat(latest.c_str(), &st) != 0) return std::nullopt;
  std::string name = bmt::checkpoint::read_file(latest, 4096);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
  const std::string fix = "resume from an earlier checkpoint by writing its folder name (ls " + root +
                          ") into " + latest + ", or delete " + latest + " to start over";
  BMT_CHECK(!name.empty(), "cannot resume: ", latest, " is empty; ", fix);
  bool plain = true;  // one folder name: no path separator, no control or non-ASCII bytes
  for (unsigned char c : name) plain = plain && c > 0x20 && c < 0x7f && c != '/';
  BMT_CHECK(plain && name != "." && name != "..", "cannot resume: ", latest, " holds \"", escaped(name),
            "\", not a checkpoint folder name (such as step_00000010); ", fix);
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
  if (auto it = loaded.user_metadata.find("trainer.run_id"); it != loaded.user_metadata.end()) info.run_id = it->second;
  return info;
}

}  // namespace examples
