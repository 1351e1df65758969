// Consolidated tensor files (one file, full tensors under the model's keys), streamed: the writer receives the
// tensors' bytes in order and the reader hands out byte ranges of one tensor at a time.
//
// Formats, by extension (any name other than *.safetensors is torch.save's format, as with BMTrain's save):
//   .safetensors  own reader/writer (safetensors_format.h). Writing streams straight to the file: the writer
//                 buffers nothing. Reading preads exactly the requested range.
//   .pt / .pth    the zip archive torch.save writes (readable by Python's torch.load, also weights_only=True): a
//                 pickled dict {name: tensor} in "data.pkl" (written by hand, protocol 2, the opcodes torch.save
//                 uses) and one uncompressed record "data/<i>" per tensor, through torch's PyTorchStreamWriter. Its
//                 writeRecord takes a whole record, so the writer buffers ONE tensor at a time: the bound is the
//                 largest tensor's nbytes. Reading parses data.pkl with our own pickle reader (pt_pickle.h) and
//                 preads each requested byte range from the tensor's record (a strided view is gathered once,
//                 its own size); files written by Python's torch.save of a dict or state_dict of tensors load.
//                 The zip's CRC-32s are checked (torch's reader does not): data.pkl's at open, a tensor's record
//                 by the time its last byte is read (a whole-storage tensor read in order costs no extra read).
// Writers create "<path>.tmp-<random>" and commit() fsyncs it and renames it over <path> (then fsyncs the
// directory): <path> is never seen half-written. A writer destroyed without commit() deletes its temporary file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bmt/checkpoint/tensor_info.h"

namespace bmt::checkpoint {

enum class TensorFileFormat { kSafetensors, kTorchPickle };
// By extension: .safetensors, anything else (.pt, .pth, .ckpt, .bin, ...) torch.save's format.
TensorFileFormat tensor_file_format(const std::string& path);

class TensorFileWriter {
 public:
  virtual ~TensorFileWriter() = default;
  // The next bytes of the data: tensors in the order given at creation, each tensor's bytes in row-major order.
  virtual void append(const void* data, int64_t nbytes) = 0;
  // Requires every byte to have been appended.
  virtual void commit() = 0;
  // The most bytes this writer holds in memory at once.
  virtual int64_t max_buffered_nbytes() const = 0;
};

std::unique_ptr<TensorFileWriter> create_tensor_file(const std::string& path, const std::vector<TensorInfo>& tensors,
                                                     const std::map<std::string, std::string>& metadata = {});

class TensorFileReader {
 public:
  virtual ~TensorFileReader() = default;
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Bytes [offset, offset + nbytes) of tensor i's row-major data.
  virtual void read(size_t i, int64_t offset_nbytes, int64_t nbytes, void* dst) = 0;
  // Tensor i will not be read again (lets the reader drop cached pages).
  virtual void release(size_t i) { (void)i; }

 protected:
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

std::unique_ptr<TensorFileReader> open_tensor_file(const std::string& path);

namespace detail {
std::unique_ptr<TensorFileWriter> create_safetensors_file(const std::string& path, const std::vector<TensorInfo>& t,
                                                          const std::map<std::string, std::string>& metadata);
std::unique_ptr<TensorFileReader> open_safetensors_file(const std::string& path);
std::unique_ptr<TensorFileWriter> create_pt_file(const std::string& path, const std::vector<TensorInfo>& t);
std::unique_ptr<TensorFileReader> open_pt_file(const std::string& path);
// Temporary name beside `path` and the final fsync + rename + directory fsync.
std::string temp_file_for(const std::string& path);
void commit_file(const std::string& tmp, const std::string& path);
}  // namespace detail

}  // namespace bmt::checkpoint
