// libFuzzer target for the .pt (torch.save zip) reader that bmt::load uses for a consolidated file: the input is
// written as a file and opened through open_tensor_file (torch's zip reader, our pickle reader, record and CRC
// checks), then every tensor is read whole, in two halves and released, as bmt::load does chunk by chunk.
// Properties (checked under ASan + UBSan): no crash, no out-of-bounds access, no undefined behaviour; a malformed
// file only ever raises bmt::core::Error, never an InternalError (an assertion of ours that input reached).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/tensor_info.h"
#include "bmt/core/error.h"

namespace {

const std::string& input_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/bmt_fuzz_pt_" + std::to_string(::getpid()) + ".pt";
  }();
  return path;
}

void read_all(bmt::checkpoint::TensorFileReader& reader) {
  std::vector<char> buf;
  for (size_t i = 0; i < reader.tensors().size(); ++i) {
    const bmt::checkpoint::TensorInfo& t = reader.tensors()[i];
    const int64_t nbytes = bmt::checkpoint::checked_nbytes(t.dtype, t.shape, t.name);
    // A view may repeat its storage's elements (stride 0: an expanded tensor torch.save keeps as one element), so
    // a small file can describe a huge tensor; reading it is correct but only costs memory here.
    if (nbytes > (int64_t{16} << 20)) continue;
    buf.resize(static_cast<size_t>(nbytes));
    const int64_t half = nbytes / 2;
    reader.read(i, 0, half, buf.data());
    reader.read(i, half, nbytes - half, buf.data() + half);
    reader.read(i, 0, nbytes, buf.data());  // again, whole (the CRC is already checked)
    reader.release(i);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = input_path();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) std::abort();
  try {
    read_all(*bmt::checkpoint::open_tensor_file(path));
  } catch (const bmt::core::InternalError& e) {
    std::fprintf(stderr, "InternalError on malformed input: %s\n", e.what());
    std::abort();
  } catch (const bmt::core::Error&) {
    // Malformed input, reported as it should be.
  }
  ::unlink(path.c_str());
  return 0;
}
