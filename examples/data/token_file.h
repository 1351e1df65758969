// Read-only memory-mapped token files: raw bytes (byte-level text, vocab 256) and uint16 token files in the
// two common `.bin` layouts:
//   llm.c     256 int32 header (header[0] = magic 20240520, header[1] = version 1, header[2] = token count),
//             then `count` little-endian uint16 tokens (file size must be 1024 + 2·count bytes)
//   nanoGPT   raw little-endian uint16 tokens, no header (numpy's tofile of a uint16 array)
// Detection ("auto"): header[0] == 20240520 -> llm.c; a header[0] that looks like another llm.c file
// (2024xxxx, e.g. a model checkpoint 20240326 or tokenizer 20240328) -> error; otherwise nanoGPT. With an
// explicit layout, a mismatching file is an error that says what was found. All errors name the path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace examples {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws bmt::core::Error (missing, unreadable, empty)
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t nbytes_ = 0;
};

// A view of a token array inside a mapped file.
struct TokenFile {
  std::shared_ptr<MappedFile> file;
  std::string layout;       // "bytes", "llm.c" or "nanoGPT"
  int64_t offset_nbytes = 0;  // first token
  int64_t num_tokens = 0;
  int bytes_per_token = 1;    // 1 (bytes) or 2 (uint16)

  int64_t token(int64_t i) const;
  int64_t max_token() const;  // scans the file
};

constexpr int32_t kLlmcTokenMagic = 20240520;

TokenFile open_byte_file(const std::string& path);
// layout: "auto", "llm.c" or "nanoGPT".
TokenFile open_token_bin(const std::string& path, const std::string& layout = "auto");

}  // namespace examples
