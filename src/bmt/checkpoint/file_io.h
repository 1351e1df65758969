// POSIX file helpers for checkpoints (torch-free): durable writes, exact positional reads, directory fsync,
// temporary names and recursive removal. Every failure throws bmt::core::Error naming the path and strerror.
//
// Durability: OutFile::sync() = fsync; close() reports write-back errors; fsync_dir() makes renames and new
// entries of a directory durable. A file is only trusted once it was written completely, synced and closed.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace bmt::checkpoint {

// Test hook: called before every write() system call with the path, the file offset and the byte count
// (e.g. to slow a writer down so that a crash test can kill it mid-write). nullptr clears it. Not thread-safe to
// change while writes are running.
using WriteHook = std::function<void(const std::string& path, int64_t offset_nbytes, int64_t nbytes)>;
void set_write_hook(WriteHook hook);

class OutFile {
 public:
  // Creates (truncates) `path` for writing. direct: O_DIRECT (bypassing the page cache) while the writes are
  // 4 KiB aligned (address, offset, size); the first unaligned write (a file's tail) turns it off. Falls back to
  // buffered writes where the filesystem refuses O_DIRECT.
  explicit OutFile(const std::string& path, bool direct = false);
  ~OutFile();  // closes without reporting errors (call close() to see them)
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, int64_t nbytes);
  void write_zeros(int64_t nbytes);
  // Starts writing back [offset, offset + nbytes) without waiting (sync_file_range), so that the final fsync
  // finds little left and dirty pages do not pile up. A hint: errors surface at sync(). BMT_CKPT_WRITEBACK=0
  // turns it off.
  void start_writeback(int64_t offset_nbytes, int64_t nbytes);
  int64_t position_nbytes() const { return pos_; }
  void sync();
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t pos_ = 0;
  bool direct_ = false;
};

// strerror(err) and, for the errors that mean "no room" (ENOSPC, EDQUOT, EFBIG), what to do: the free and total
// space of the filesystem holding `path`, or the file-size limit. For every writer's error messages.
std::string describe_write_error(const std::string& path, int err);

// BMT_CKPT_DIRECT=1: shard files are written with O_DIRECT (OutFile's direct mode).
bool direct_writes_requested();

class InFile {
 public:
  explicit InFile(const std::string& path);
  ~InFile();
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;

  int64_t size_nbytes() const { return size_; }
  // Reads exactly nbytes at offset; a range past the end is reported as a truncated file.
  void pread_exact(int64_t offset_nbytes, int64_t nbytes, void* dst) const;
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
void make_directory(const std::string& path);
void fsync_dir(const std::string& path);
// Removes a file or a directory tree; a missing path is not an error.
void remove_tree(const std::string& path);
// Names (not paths) of a directory's entries, sorted, without "." and "..".
std::vector<std::string> list_directory(const std::string& path);
// rename(2), with the error naming both paths.
void rename_path(const std::string& from, const std::string& to);
// Atomically swaps two existing paths (renameat2 RENAME_EXCHANGE); false when the filesystem cannot.
bool exchange_paths(const std::string& a, const std::string& b);

// Whole small file (throws past max_nbytes).
std::string read_file(const std::string& path, int64_t max_nbytes);
// Writes, fsyncs and closes `path`.
void write_file_durable(const std::string& path, const std::string& bytes);

// 16 hex digits from the OS entropy source (falls back to time and pid).
std::string random_hex_suffix();
std::string parent_directory(const std::string& path);  // "." for a bare name
std::string join_path(const std::string& dir, const std::string& name);
// `path` without trailing slashes ("ckpt/" -> "ckpt").
std::string strip_trailing_slashes(const std::string& path);

}  // namespace bmt::checkpoint
