// .safetensors implementation of TensorFileWriter / TensorFileReader, and the format dispatch (tensor_file.h).
#include <algorithm>
#include <unistd.h>

#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/safetensors_format_internal.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace detail {

std::string temp_file_for(const std::string& path) { return path + ".tmp-" + random_hex_suffix(); }

void commit_file(const std::string& tmp, const std::string& path) {
  rename_path(tmp, path);
  fsync_dir(parent_directory(path));
}

namespace {

class SafetensorsWriter final : public TensorFileWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<TensorInfo>& tensors,
                    const std::map<std::string, std::string>& metadata)
      : path_(path), tmp_(temp_file_for(path)) {
    const std::string header = build_safetensors_header(tensors, metadata);
    for (const TensorInfo& t : tensors) data_nbytes_ += checked_nbytes(t.dtype, t.shape, "tensor " + t.name);
    out_ = std::make_unique<OutFile>(tmp_);
    try {
      out_->write(header.data(), static_cast<int64_t>(header.size()));
    } catch (...) {  // no destructor runs for a half-built object: a full disk must not leave the temporary file
      out_.reset();
      ::unlink(tmp_.c_str());
      throw;
    }
    expected_end_ = static_cast<int64_t>(header.size()) + data_nbytes_;
  }
  ~SafetensorsWriter() override {
    if (!committed_) {
      out_.reset();
      ::unlink(tmp_.c_str());
    }
  }
  void append(const void* data, int64_t nbytes) override {
    BMT_ASSERT(out_->position_nbytes() + nbytes <= expected_end_, "appending past the end of ", path_);
    const int64_t at = out_->position_nbytes();
    out_->write(data, nbytes);
    out_->start_writeback(at, nbytes);  // the final fsync then finds little left
  }
  void commit() override {
    BMT_ASSERT(out_->position_nbytes() == expected_end_, "commit of ", path_, " after ", out_->position_nbytes(),
               " of ", expected_end_, " bytes");
    out_->sync();
    out_->close();
    commit_file(tmp_, path_);
    committed_ = true;
  }
  int64_t max_buffered_nbytes() const override { return 0; }

 private:
  std::string path_, tmp_;
  std::unique_ptr<OutFile> out_;
  int64_t data_nbytes_ = 0, expected_end_ = 0;
  bool committed_ = false;
};

class SafetensorsReader final : public TensorFileReader {
 public:
  explicit SafetensorsReader(const std::string& path) : file_(path) {
    const int64_t size = file_.size_nbytes();
    uint8_t first8[8] = {};
    BMT_CHECK(size >= 8, path, ": not a safetensors file (", size, " bytes)");
    file_.pread_exact(0, 8, first8);
    const int64_t n = safetensors_header_nbytes(first8, size, path);
    std::string json(static_cast<size_t>(n), '\0');
    file_.pread_exact(8, n, json.data());
    SafetensorsHeader h = parse_safetensors_json(json, size, path);
    tensors_ = std::move(h.tensors);
    metadata_ = std::move(h.metadata);
    offsets_ = std::move(h.data_offsets);
    data_start_ = h.data_start_nbytes;
  }
  void read(size_t i, int64_t offset, int64_t nbytes, void* dst) override {
    BMT_ASSERT(i < tensors_.size(), "tensor index ", i);
    const int64_t total = checked_nbytes(tensors_[i].dtype, tensors_[i].shape, tensors_[i].name);
    BMT_ASSERT(offset >= 0 && nbytes >= 0 && offset + nbytes <= total, "read outside tensor ", tensors_[i].name);
    file_.pread_exact(data_start_ + offsets_[i] + offset, nbytes, dst);
  }

 private:
  InFile file_;
  std::vector<int64_t> offsets_;
  int64_t data_start_ = 0;
};

}  // namespace

std::unique_ptr<TensorFileWriter> create_safetensors_file(const std::string& path, const std::vector<TensorInfo>& t,
                                                          const std::map<std::string, std::string>& metadata) {
  return std::make_unique<SafetensorsWriter>(path, t, metadata);
}

std::unique_ptr<TensorFileReader> open_safetensors_file(const std::string& path) {
  return std::make_unique<SafetensorsReader>(path);
}

}  // namespace detail

TensorFileFormat tensor_file_format(const std::string& path) {
  auto ends_with = [&](const std::string& s) {
    return path.size() >= s.size() && path.compare(path.size() - s.size(), s.size(), s) == 0;
  };
  // Every other name is torch.save's format, as BMTrain's save (torch.save regardless of the extension: model.ckpt,
  // model.bin, ...) writes it.
  return ends_with(".safetensors") ? TensorFileFormat::kSafetensors : TensorFileFormat::kTorchPickle;
}

std::unique_ptr<TensorFileWriter> create_tensor_file(const std::string& path, const std::vector<TensorInfo>& tensors,
                                                     const std::map<std::string, std::string>& metadata) {
  if (tensor_file_format(path) == TensorFileFormat::kSafetensors)
    return detail::create_safetensors_file(path, tensors, metadata);
  return detail::create_pt_file(path, tensors);
}

std::unique_ptr<TensorFileReader> open_tensor_file(const std::string& path) {
  BMT_CHECK(path_exists(path), "cannot load ", path, ": no such file");
  if (tensor_file_format(path) == TensorFileFormat::kSafetensors) return detail::open_safetensors_file(path);
  return detail::open_pt_file(path);
}

}  // namespace bmt::checkpoint
