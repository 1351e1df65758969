// Atomic replacement of a checkpoint directory.
//
// A save writes everything into "<dir>.tmp-<16 hex>" (shard files, then the metadata file last), fsyncs the
// files and the directory, then commit_directory makes it "<dir>":
//  * no "<dir>" yet: rename(tmp, dir);
//  * otherwise, where the filesystem supports it, renameat2(RENAME_EXCHANGE) swaps the two atomically, then the
//    old one (now under the tmp name) is renamed to "<dir>.old-<hex>" and deleted;
//  * else: rename(dir, "<dir>.old-<hex>"), rename(tmp, dir), delete the old.
// Each step is followed by an fsync of the parent directory. Crash safety: at every instant either "<dir>" is a
// complete checkpoint, or (only inside the last protocol's two renames) "<dir>" is missing while both the new
// complete tmp directory and the old one exist. resolve_checkpoint_dir handles that case by picking the newest
// complete candidate ("complete" = valid metadata file and every shard file present with its recorded size), so a
// loader always finds either the old or the new checkpoint. The next save first repairs such a state (renames the
// newest complete candidate to "<dir>") and deletes leftovers.
#pragma once

#include <string>

namespace bmt::checkpoint {

// Creates and returns "<dir>.tmp-<hex>" (dir without trailing slashes).
std::string make_temp_dir(const std::string& dir);
void commit_directory(const std::string& tmp, const std::string& dir, bool allow_exchange);

// Empty string when `dir` holds a complete checkpoint, else the reason.
std::string incomplete_reason(const std::string& dir);
// The directory to read for checkpoint `dir` (see above); throws a clear error when there is none.
std::string resolve_checkpoint_dir(const std::string& dir);
// Before a save (one process): restore "<dir>" from a crashed commit if needed, then delete every leftover
// "<dir>.tmp-*" and "<dir>.old-*".
void repair_and_clean(const std::string& dir);

}  // namespace bmt::checkpoint
