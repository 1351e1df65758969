#include "bmt/checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>

#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace {

WriteHook& write_hook() {
  static WriteHook hook;
  return hook;
}

std::string errno_str(int err) { return std::strerror(err); }

constexpr int64_t kMaxWriteNbytes = int64_t{8} << 20;  // per write() call (the hook's granularity)

// For the errors that mean "no room": the free space of the file's filesystem (or the file-size limit), so the
// message says what to free or raise.
std::string space_hint(const std::string& path, int err) {
  if (err == EFBIG)
    return " (the file exceeds the file-size limit of this process or filesystem: check `ulimit -f`)";
  if (err != ENOSPC && err != EDQUOT) return "";
  struct statvfs st {};
  const std::string dir = parent_directory(path);
  if (::statvfs(dir.c_str(), &st) != 0) return " (the disk holding " + dir + " is full)";
  const double free_mib = static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize) / (1 << 20);
  const double total_mib = static_cast<double>(st.f_blocks) * static_cast<double>(st.f_frsize) / (1 << 20);
  char buf[160];
  std::snprintf(buf, sizeof buf, " (the filesystem holding %s has %.1f MiB free of %.1f MiB", dir.c_str(), free_mib,
                total_mib);
  return std::string(buf) + (err == EDQUOT ? "; your disk quota is exhausted)" : "; free space or save elsewhere)");
}

}  // namespace

std::string describe_write_error(const std::string& path, int err) { return errno_str(err) + space_hint(path, err); }

void set_write_hook(WriteHook hook) { write_hook() = std::move(hook); }

bool direct_writes_requested() {
  static const bool on = [] {
    const char* e = std::getenv("BMT_CKPT_DIRECT");
    return e && std::string(e) == "1";
  }();
  return on;
}

OutFile::OutFile(const std::string& path, bool direct) : path_(path) {
#ifdef O_DIRECT
  if (direct) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    direct_ = fd_ >= 0;  // EINVAL: the filesystem does not support it (tmpfs): buffered below
  }
#endif
  if (fd_ < 0) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = errno;
  BMT_CHECK(fd_ >= 0, "cannot create file ", path, ": ", errno_str(err), space_hint(path, err));
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, int64_t nbytes) {
  BMT_ASSERT(fd_ >= 0, "write after close of ", path_);
  const auto* p = static_cast<const char*>(data);
#ifdef O_DIRECT
  constexpr int64_t kAlign = 4096;
  if (direct_ && (reinterpret_cast<uintptr_t>(p) % kAlign != 0 || pos_ % kAlign != 0 || nbytes % kAlign != 0)) {
    const int flags = ::fcntl(fd_, F_GETFL);
    BMT_CHECK(flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0, "cannot turn off O_DIRECT on ", path_, ": ",
              errno_str(errno));
    direct_ = false;
  }
#endif
  while (nbytes > 0) {
    const int64_t n = std::min(nbytes, kMaxWriteNbytes);
    if (write_hook()) write_hook()(path_, pos_, n);
    ssize_t w = ::write(fd_, p, static_cast<size_t>(n));
    const int err = errno;
    if (w < 0 && err == EINTR) continue;
    BMT_CHECK(w > 0, "cannot write ", n, " bytes to ", path_, " at offset ", pos_, ": ",
              w < 0 ? errno_str(err) : std::string("no progress"), w < 0 ? space_hint(path_, err) : std::string());
    p += w;
    pos_ += w;
    nbytes -= w;
  }
}

void OutFile::write_zeros(int64_t nbytes) {
  static const char zeros[4096] = {};
  while (nbytes > 0) {
    int64_t n = std::min<int64_t>(nbytes, sizeof zeros);
    write(zeros, n);
    nbytes -= n;
  }
}

void OutFile::start_writeback(int64_t offset_nbytes, int64_t nbytes) {
  static const bool enabled = [] {
    const char* e = std::getenv("BMT_CKPT_WRITEBACK");
    return !(e && std::string(e) == "0");
  }();
  if (!enabled || direct_ || fd_ < 0 || nbytes <= 0) return;
#ifdef SYNC_FILE_RANGE_WRITE
  (void)::sync_file_range(fd_, offset_nbytes, nbytes, SYNC_FILE_RANGE_WRITE);
#else
  (void)offset_nbytes;
#endif
}

void OutFile::sync() {
  BMT_ASSERT(fd_ >= 0, "sync after close of ", path_);
  const int rc = ::fsync(fd_), err = errno;
  BMT_CHECK(rc == 0, "fsync of ", path_, " failed: ", errno_str(err), space_hint(path_, err));
}

void OutFile::close() {
  if (fd_ < 0) return;
  const int rc = ::close(fd_), err = errno;
  fd_ = -1;
  BMT_CHECK(rc == 0, "closing ", path_, " failed: ", errno_str(err), space_hint(path_, err));
}

InFile::InFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BMT_CHECK(fd_ >= 0, "cannot open ", path, ": ", errno_str(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    BMT_ERROR("cannot stat ", path, ": ", errno_str(err));
  }
  size_ = static_cast<int64_t>(st.st_size);
}

InFile::~InFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InFile::pread_exact(int64_t offset_nbytes, int64_t nbytes, void* dst) const {
  BMT_CHECK(offset_nbytes >= 0 && nbytes >= 0 && offset_nbytes <= size_ && nbytes <= size_ - offset_nbytes,
            "file ", path_, " is truncated or corrupted: reading ", nbytes, " bytes at offset ", offset_nbytes,
            " but the file has ", size_, " bytes");
  auto* p = static_cast<char*>(dst);
  while (nbytes > 0) {
    ssize_t r = ::pread(fd_, p, static_cast<size_t>(std::min(nbytes, kMaxWriteNbytes)), offset_nbytes);
    if (r < 0 && errno == EINTR) continue;
    BMT_CHECK(r > 0, "cannot read ", path_, " at offset ", offset_nbytes, ": ",
              r < 0 ? errno_str(errno) : std::string("unexpected end of file (truncated?)"));
    p += r;
    offset_nbytes += r;
    nbytes -= r;
  }
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directory(const std::string& path) {
  BMT_CHECK(::mkdir(path.c_str(), 0755) == 0, "cannot create directory ", path, ": ", errno_str(errno));
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  BMT_CHECK(fd >= 0, "cannot open directory ", path, " to fsync it: ", errno_str(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some filesystems do not support fsync on directories; that is not a failure of ours.
  BMT_CHECK(rc == 0 || err == EINVAL || err == EROFS, "fsync of directory ", path, " failed: ", errno_str(err));
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    BMT_CHECK(errno == ENOENT, "cannot stat ", path, ": ", errno_str(errno));
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& name : list_directory(path)) remove_tree(join_path(path, name));
    BMT_CHECK(::rmdir(path.c_str()) == 0 || errno == ENOENT, "cannot remove directory ", path, ": ", errno_str(errno));
  } else {
    BMT_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, "cannot remove ", path, ": ", errno_str(errno));
  }
}

std::vector<std::string> list_directory(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  BMT_CHECK(d != nullptr, "cannot list directory ", path, ": ", errno_str(errno));
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void rename_path(const std::string& from, const std::string& to) {
  BMT_CHECK(::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ", errno_str(errno));
}

bool exchange_paths(const std::string& a, const std::string& b) {
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  BMT_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP || errno == EXDEV, "cannot exchange ", a, " and ",
            b, ": ", errno_str(errno));
#endif
  return false;
}

std::string read_file(const std::string& path, int64_t max_nbytes) {
  InFile f(path);
  BMT_CHECK(f.size_nbytes() <= max_nbytes, "file ", path, " has ", f.size_nbytes(), " bytes, more than the ",
            max_nbytes, " expected (not a checkpoint file?)");
  std::string s(static_cast<size_t>(f.size_nbytes()), '\0');
  f.pread_exact(0, f.size_nbytes(), s.data());
  return s;
}

void write_file_durable(const std::string& path, const std::string& bytes) {
  OutFile f(path);
  f.write(bytes.data(), static_cast<int64_t>(bytes.size()));
  f.sync();
  f.close();
}

std::string random_hex_suffix() {
  uint64_t v = 0;
  try {
    std::random_device rd;
    v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  } catch (...) {
  }
  v ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull;
  v ^= static_cast<uint64_t>(::getpid()) << 17;
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[i] = digits[v & 0xF];
  return s;
}

std::string strip_trailing_slashes(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string parent_directory(const std::string& path) {
  std::string p = strip_trailing_slashes(path);
  size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return p.substr(0, slash);
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace bmt::checkpoint
