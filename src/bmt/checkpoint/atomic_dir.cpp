#include "bmt/checkpoint/atomic_dir_internal.h"

#include <vector>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/metadata.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace {

struct Candidate {
  std::string path;
  int64_t created_unix_ms = 0;
};

std::string base_of(const std::string& dir) {
  std::string d = strip_trailing_slashes(dir);
  size_t slash = d.rfind('/');
  return slash == std::string::npos ? d : d.substr(slash + 1);
}

// Complete leftovers "<dir>.tmp-*" / "<dir>.old-*" beside dir, and every leftover name.
std::vector<Candidate> leftovers(const std::string& dir, std::vector<std::string>* all_names) {
  const std::string parent = parent_directory(dir), base = base_of(dir);
  std::vector<Candidate> out;
  if (!is_directory(parent)) return out;
  for (const std::string& name : list_directory(parent)) {
    const bool tmp = name.rfind(base + ".tmp-", 0) == 0, old = name.rfind(base + ".old-", 0) == 0;
    if (!tmp && !old) continue;
    const std::string path = join_path(parent, name);
    if (all_names) all_names->push_back(path);
    if (!incomplete_reason(path).empty()) continue;
    try {
      CheckpointMetadata m = parse_metadata(read_file(join_path(path, kMetadataFileName), kMaxMetadataNbytes), path);
      out.push_back({path, m.created_unix_ms});
    } catch (const std::exception&) {
    }
  }
  return out;
}

const Candidate* newest(const std::vector<Candidate>& c) {
  const Candidate* best = nullptr;
  for (const Candidate& x : c)
    if (!best || x.created_unix_ms > best->created_unix_ms ||
        (x.created_unix_ms == best->created_unix_ms && x.path > best->path))
      best = &x;
  return best;
}

}  // namespace

std::string make_temp_dir(const std::string& dir) {
  const std::string tmp = strip_trailing_slashes(dir) + ".tmp-" + random_hex_suffix();
  make_directory(tmp);
  return tmp;
}

void commit_directory(const std::string& tmp, const std::string& dir_in, bool allow_exchange) {
  const std::string dir = strip_trailing_slashes(dir_in), parent = parent_directory(dir);
  fsync_dir(tmp);
  fsync_dir(parent);
  if (!path_exists(dir)) {
    rename_path(tmp, dir);
    fsync_dir(parent);
    return;
  }
  const std::string old = dir + ".old-" + random_hex_suffix();
  if (allow_exchange && exchange_paths(tmp, dir)) {
    fsync_dir(parent);
    rename_path(tmp, old);  // tmp now holds the previous checkpoint
  } else {
    rename_path(dir, old);
    fsync_dir(parent);  // crash from here to the next rename: resolve_checkpoint_dir picks tmp (newest)
    rename_path(tmp, dir);
  }
  fsync_dir(parent);
  remove_tree(old);
  fsync_dir(parent);
}

std::string incomplete_reason(const std::string& dir) {
  if (!is_directory(dir)) return "no directory " + dir;
  const std::string meta_path = join_path(dir, kMetadataFileName);
  if (!path_exists(meta_path))
    return dir + " has no " + kMetadataFileName + " (an unfinished save, or not a bmtrain checkpoint)";
  try {
    CheckpointMetadata m = parse_metadata(read_file(meta_path, kMaxMetadataNbytes), meta_path);
    for (const ShardFileInfo& f : m.files) {
      const std::string p = join_path(dir, f.name);
      if (!path_exists(p)) return "missing shard file " + p;
      InFile in(p);
      if (in.size_nbytes() != f.nbytes)
        return "shard file " + p + " has " + std::to_string(in.size_nbytes()) + " bytes, the metadata records " +
               std::to_string(f.nbytes) + " (truncated or corrupted)";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

std::string resolve_checkpoint_dir(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  if (path_exists(dir)) {
    std::string why = incomplete_reason(dir);
    BMT_CHECK(why.empty(), "cannot load checkpoint ", dir, ": ", why);
    return dir;
  }
  std::vector<Candidate> c = leftovers(dir, nullptr);
  const Candidate* best = newest(c);
  BMT_CHECK(best != nullptr, "cannot load checkpoint ", dir, ": no such directory (and no complete checkpoint left "
            "beside it by an interrupted save)");
  return best->path;
}

void repair_and_clean(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in), parent = parent_directory(dir);
  std::vector<std::string> names;
  std::vector<Candidate> c = leftovers(dir, &names);
  if (!path_exists(dir)) {
    if (const Candidate* best = newest(c)) {
      rename_path(best->path, dir);
      fsync_dir(parent);
    }
  }
  for (const std::string& p : names)
    if (path_exists(p)) remove_tree(p);
  if (!names.empty()) fsync_dir(parent);
}

}  // namespace bmt::checkpoint
