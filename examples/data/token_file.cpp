#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "bmt/core/error.h"

namespace examples {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  BMT_CHECK(fd >= 0, "cannot open data file '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) == 0 && !S_ISREG(st.st_mode)) {  // a directory would fail later as "No such device"
    ::close(fd);
    BMT_ERROR("--data '", path, "' is ", S_ISDIR(st.st_mode) ? "a directory" : "not a regular file",
              "; give one file: a text file (bytes) or a uint16 .bin token file (llm.c or nanoGPT layout)");
  }
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    BMT_ERROR("data file '", path, "' is empty or unreadable");
  }
  nbytes_ = st.st_size;
  void* p = ::mmap(nullptr, static_cast<size_t>(nbytes_), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  BMT_CHECK(p != MAP_FAILED, "cannot map data file '", path, "': ", std::strerror(errno));
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(nbytes_));
}

int64_t TokenFile::token(int64_t i) const {
  const uint8_t* p = file->data() + offset_nbytes + i * bytes_per_token;
  return bytes_per_token == 1 ? p[0] : static_cast<int64_t>(p[0] | (p[1] << 8));  // little-endian uint16
}

int64_t TokenFile::max_token() const {
  int64_t m = 0;
  for (int64_t i = 0; i < num_tokens; ++i) m = std::max(m, token(i));
  return m;
}

TokenFile open_byte_file(const std::string& path) {
  TokenFile f;
  f.file = std::make_shared<MappedFile>(path);
  f.layout = "bytes";
  f.num_tokens = f.file->nbytes();
  return f;
}

namespace {

int32_t read_i32(const uint8_t* p) {
  uint32_t v = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
               static_cast<uint32_t>(p[3]) << 24;
  return static_cast<int32_t>(v);
}

TokenFile open_llmc(std::shared_ptr<MappedFile> file) {
  const std::string& path = file->path();
  const int32_t magic = file->nbytes() >= 4 ? read_i32(file->data()) : 0;
  BMT_CHECK(magic == kLlmcTokenMagic, "token file '", path, "': bad magic ", magic, " (llm.c token files start with ",
            kLlmcTokenMagic, ")");
  BMT_CHECK(file->nbytes() >= 1024, "token file '", path, "': ", file->nbytes(),
            " bytes is shorter than llm.c's 1024-byte header");
  const int32_t version = read_i32(file->data() + 4);
  const int64_t count = read_i32(file->data() + 8);
  BMT_CHECK(version == 1, "token file '", path, "': unsupported llm.c version ", version, " (expected 1)");
  BMT_CHECK(count > 0 && 1024 + 2 * count == file->nbytes(), "token file '", path, "': header says ", count,
            " tokens but the file holds ", (file->nbytes() - 1024) / 2, " (", file->nbytes(), " bytes)");
  TokenFile f;
  f.file = std::move(file);
  f.layout = "llm.c";
  f.offset_nbytes = 1024;
  f.num_tokens = count;
  f.bytes_per_token = 2;
  return f;
}

TokenFile open_nanogpt(std::shared_ptr<MappedFile> file) {
  BMT_CHECK(file->nbytes() % 2 == 0, "token file '", file->path(), "': ", file->nbytes(),
            " bytes is not a whole number of uint16 tokens (nanoGPT layout)");
  TokenFile f;
  f.file = std::move(file);
  f.layout = "nanoGPT";
  f.num_tokens = f.file->nbytes() / 2;
  f.bytes_per_token = 2;
  return f;
}

}  // namespace

TokenFile open_token_bin(const std::string& path, const std::string& layout) {
  BMT_CHECK(layout == "auto" || layout == "llm.c" || layout == "nanoGPT",
            "token file layout must be auto, llm.c or nanoGPT, got '", layout, "'");
  auto file = std::make_shared<MappedFile>(path);
  if (layout == "llm.c") return open_llmc(std::move(file));
  if (layout == "nanoGPT") return open_nanogpt(std::move(file));
  const int32_t magic = file->nbytes() >= 4 ? read_i32(file->data()) : 0;
  if (magic == kLlmcTokenMagic) return open_llmc(std::move(file));
  BMT_CHECK(!(magic >= 20240000 && magic <= 20249999), "token file '", path, "': bad magic ", magic,
            ": this looks like another llm.c file (token files have magic ", kLlmcTokenMagic,
            "; 20240326 is a model checkpoint, 20240328 a tokenizer)");
  return open_nanogpt(std::move(file));
}

}  // namespace examples
