// .pt (torch.save zip) implementation of TensorFileWriter / TensorFileReader (tensor_file.h).
#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/pt_pickle_internal.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/zip_directory_internal.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint::detail {
namespace {

// Pickle protocol 2, the subset torch.save emits for {str: tensor}.
class PickleWriter {
 public:
  void proto() { out_ += "\x80\x02"; }
  void global(const char* module, const char* name) { out_ += std::string("c") + module + "\n" + name + "\n"; }
  void mark() { out_ += '('; }
  void tuple() { out_ += 't'; }
  void empty_tuple() { out_ += ')'; }
  void empty_dict() { out_ += '}'; }
  void reduce() { out_ += 'R'; }
  void setitems() { out_ += 'u'; }
  void binpersid() { out_ += 'Q'; }
  void new_false() { out_ += '\x89'; }
  void stop() { out_ += '.'; }
  void str(const std::string& s) {
    out_ += 'X';
    put_le(static_cast<uint64_t>(s.size()), 4);
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      put_le(static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
    } else {  // LONG1: 8-byte two's complement
      out_ += '\x8a';
      out_ += '\x08';
      put_le(static_cast<uint64_t>(v), 8);
    }
  }
  const std::string& bytes() const { return out_; }

 private:
  void put_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  std::string out_;
};

const char* storage_class(const std::string& dtype) {
  static const std::map<std::string, const char*> m = {
      {"F32", "FloatStorage"}, {"F64", "DoubleStorage"}, {"F16", "HalfStorage"}, {"BF16", "BFloat16Storage"},
      {"I64", "LongStorage"},  {"I32", "IntStorage"},    {"I16", "ShortStorage"}, {"I8", "CharStorage"},
      {"U8", "ByteStorage"},   {"BOOL", "BoolStorage"},  {"F8_E4M3", "Float8_e4m3fnStorage"},
      {"F8_E5M2", "Float8_e5m2Storage"}};
  auto it = m.find(dtype);
  BMT_CHECK(it != m.end(), "cannot write dtype ", dtype, " to a .pt file");
  return it->second;
}

std::string build_pickle(const std::vector<TensorInfo>& tensors) {
  PickleWriter p;
  p.proto();
  p.empty_dict();
  p.mark();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    p.str(t.name);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.mark();
    p.mark();  // persistent id: ('storage', torch.<T>Storage, key, location, numel)
    p.str("storage");
    p.global("torch", storage_class(t.dtype));
    p.str(std::to_string(i));
    p.str("cpu");
    p.integer(checked_numel(t.shape, t.name));
    p.tuple();
    p.binpersid();
    p.integer(0);  // storage offset
    p.mark();
    for (int64_t d : t.shape) p.integer(d);
    p.tuple();
    p.mark();
    int64_t stride = 1;
    std::vector<int64_t> strides(t.shape.size(), 1);
    for (size_t k = t.shape.size(); k-- > 0;) {
      strides[k] = stride;
      stride *= std::max<int64_t>(t.shape[k], 1);
    }
    for (int64_t s : strides) p.integer(s);
    p.tuple();
    p.new_false();  // requires_grad
    p.global("collections", "OrderedDict");
    p.empty_tuple();
    p.reduce();  // backward_hooks = OrderedDict()
    p.tuple();
    p.reduce();
  }
  p.setitems();
  p.stop();
  return p.bytes();
}

class PtWriter final : public TensorFileWriter {
 public:
  PtWriter(const std::string& path, const std::vector<TensorInfo>& tensors)
      : path_(path), tmp_(temp_file_for(path)), tensors_(tensors) {
    for (const TensorInfo& t : tensors) {
      nbytes_.push_back(checked_nbytes(t.dtype, t.shape, "tensor " + t.name));
      max_nbytes_ = std::max(max_nbytes_, nbytes_.back());
    }
    out_ = std::make_unique<OutFile>(tmp_);
    try {
      zip_ = std::make_unique<caffe2::serialize::PyTorchStreamWriter>(
          [this](const void* data, size_t n) { return sink(data, n); });
      const std::string pkl = build_pickle(tensors);
      guarded([&] {
        zip_->writeRecord("data.pkl", pkl.data(), pkl.size());
        zip_->writeRecord("byteorder", "little", 6);
      });
      flush_complete();
    } catch (...) {  // no destructor runs for a half-built object: drop the temporary file here
      abandon();
      throw;
    }
  }
  ~PtWriter() override {
    if (!committed_) abandon();
  }
  void append(const void* data, int64_t nbytes) override {
    const char* p = static_cast<const char*>(data);
    while (nbytes > 0) {
      BMT_ASSERT(cur_ < tensors_.size(), "appending past the last tensor of ", path_);
      const int64_t take = std::min(nbytes, nbytes_[cur_] - static_cast<int64_t>(buf_.size()));
      buf_.insert(buf_.end(), p, p + take);
      p += take;
      nbytes -= take;
      flush_complete();
    }
  }
  void commit() override {
    BMT_ASSERT(cur_ == tensors_.size(), "commit of ", path_, " with ", tensors_.size() - cur_, " tensors missing");
    guarded([&] { zip_->writeEndOfFile(); });
    zip_.reset();
    out_->sync();
    out_->close();
    commit_file(tmp_, path_);
    committed_ = true;
  }
  int64_t max_buffered_nbytes() const override { return max_nbytes_; }

 private:
  // torch's zip writer must never see a short write: it then throws from inside the zip library's C code, and
  // again ("unexpected pos") from its destructor, which ends the process. So every byte is reported as taken; the
  // first error is kept (later bytes go nowhere) and guarded() raises it once the zip call has returned.
  size_t sink(const void* data, size_t n) {
    if (discard_ || !write_error_.empty()) return n;
    try {
      out_->write(data, static_cast<int64_t>(n));
    } catch (const std::exception& e) {
      write_error_ = e.what();
    }
    return n;
  }
  template <typename F>
  void guarded(F&& fn) {
    try {
      fn();
    } catch (const c10::Error& e) {
      BMT_ERROR("writing ", path_, " failed: ", write_error_.empty() ? e.what_without_backtrace() : write_error_);
    }
    BMT_CHECK(write_error_.empty(), "writing ", path_, " failed: ", write_error_);
  }
  // The archive is finished into the void (its destructor would otherwise write the central directory), then the
  // temporary file is removed. Never throws.
  void abandon() noexcept {
    discard_ = true;
    try {
      if (zip_) zip_->writeEndOfFile();
    } catch (...) {  // nothing was written anywhere: nothing to report
    }
    zip_.reset();
    out_.reset();
    ::unlink(tmp_.c_str());
  }
  // Writes every tensor whose bytes are complete (zero-size tensors at once).
  void flush_complete() {
    while (cur_ < tensors_.size() && static_cast<int64_t>(buf_.size()) == nbytes_[cur_]) {
      guarded([&] { zip_->writeRecord("data/" + std::to_string(cur_), buf_.data(), buf_.size()); });
      buf_.clear();
      buf_.shrink_to_fit();
      ++cur_;
    }
  }

  std::string path_, tmp_;
  std::vector<TensorInfo> tensors_;
  std::vector<int64_t> nbytes_;
  int64_t max_nbytes_ = 0;
  std::unique_ptr<OutFile> out_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> zip_;
  std::vector<char> buf_;
  size_t cur_ = 0;
  bool committed_ = false, discard_ = false;
  std::string write_error_;
};

// The CRC-32 the archive stores for a record: torch's writer (miniz, flag bit 3) puts it in the data descriptor
// after the data, optionally behind the signature PK\7\8; other writers put it in the local header.
uint32_t stored_crc32(const InFile& file, const uint8_t* local, int64_t data_end) {
  auto le32 = [](const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
           static_cast<uint32_t>(p[3]) << 24;
  };
  if (!(local[6] & 8)) return le32(local + 14);
  uint8_t desc[8];
  file.pread_exact(data_end, 8, desc);
  return le32(desc) == 0x08074b50u ? le32(desc + 4) : le32(desc);
}

class PtReader final : public TensorFileReader {
 public:
  explicit PtReader(const std::string& path) : path_(path), file_(path) {
    try {
      // Bounds every record's claimed size by the file's before torch's reader allocates it.
      read_zip_directory(file_);
      caffe2::serialize::PyTorchStreamReader zip(path);
      BMT_CHECK(zip.hasRecord("data.pkl"), path, ": not a torch.save archive (no data.pkl)");
      // torch's zip reader checks no CRC: a flipped byte in the pickle could rename or reshape a tensor.
      Record pkl_rec = stored_record(zip, "data.pkl");
      auto [pkl, pkl_nbytes] = zip.getRecord("data.pkl");
      BMT_CHECK(static_cast<int64_t>(pkl_nbytes) == pkl_rec.nbytes, path, ": data.pkl has two sizes (corrupted)");
      check_crc(pkl_rec, crc32(pkl.get(), pkl_nbytes));
      refs_ = parse_torch_pickle(std::string_view(static_cast<const char*>(pkl.get()), pkl_nbytes), path);
      std::map<std::string, size_t> record_of_key;
      for (const PickledTensor& t : refs_) {
        auto [it, added] = record_of_key.emplace(t.storage_key, records_.size());
        record_of_.push_back(it->second);
        const int64_t need = checked_nbytes(t.dtype, {t.storage_numel}, path);
        const std::string rec = "data/" + t.storage_key;
        if (added) {
          BMT_CHECK(zip.hasRecord(rec), path, ": tensor ", t.name, " refers to a missing record ", rec);
          records_.push_back(stored_record(zip, rec));
        }
        BMT_CHECK(records_[it->second].nbytes >= need, path, ": record ", rec, " is shorter than its ",
                  t.storage_numel, "-element storage (truncated or corrupted)");
        // A stride-0 view can describe more bytes than int64 holds: refuse it here, not in a caller's arithmetic.
        checked_nbytes(t.dtype, t.shape, path + ": tensor " + t.name);
        tensors_.push_back(TensorInfo{t.name, t.dtype, t.shape});
      }
    } catch (const core::Error&) {
      throw;
    } catch (const std::exception& e) {
      BMT_ERROR("cannot read ", path, " as a torch.save archive: ", e.what());
    }
    gathered_.resize(refs_.size());
    progress_.resize(refs_.size());
  }
  // Every record a tensor's bytes come from is checked against its CRC-32 by the time the tensor's last byte is
  // read (an error then: the caller has received corrupted bytes before it and must discard them, as
  // bmt::load does on any error). A whole-storage tensor read front to back is checksummed on the way; anything
  // else (a view, reads out of order) re-reads its record once.
  void read(size_t i, int64_t offset, int64_t nbytes, void* dst) override {
    BMT_ASSERT(i < refs_.size(), "tensor index ", i);
    const PickledTensor& t = refs_[i];
    const int64_t elem = dtype_element_nbytes(t.dtype);
    const int64_t tensor_nbytes = checked_nbytes(t.dtype, t.shape, t.name);
    BMT_ASSERT(offset >= 0 && nbytes >= 0 && offset + nbytes <= tensor_nbytes, "read outside tensor ", t.name);
    if (nbytes == 0) return;
    Record& rec = records_[record_of_[i]];
    if (t.is_contiguous()) {  // straight from the file
      file_.pread_exact(rec.offset + t.storage_offset * elem + offset, nbytes, dst);
      Progress& p = progress_[i];
      if (rec.verified) return;
      if (t.storage_offset == 0 && tensor_nbytes == rec.nbytes && offset == p.next_nbytes) {
        p.crc = crc32_update(p.crc, dst, static_cast<size_t>(nbytes));
        p.next_nbytes += nbytes;
        if (p.next_nbytes == rec.nbytes) check_crc(rec, p.crc);
      } else if (offset + nbytes == tensor_nbytes) {
        verify(rec);
      }
      return;
    }
    if (!gathered_[i].defined()) {  // a strided view: gather it once (this tensor's size)
      verify(rec);
      int64_t last = t.storage_offset;
      for (size_t k = 0; k < t.shape.size(); ++k) last += (t.shape[k] - 1) * t.strides[k];
      at::Tensor storage = at::empty({(last + 1) * elem}, at::TensorOptions().dtype(at::kByte));
      file_.pread_exact(rec.offset, (last + 1) * elem, storage.data_ptr());
      // The view over bytes, with a last dimension of one element's bytes: gathers whole elements of any dtype.
      // A size-1 dimension's stride is never followed (and may be anything in the file): 0.
      std::vector<int64_t> shape = t.shape, strides;
      for (size_t k = 0; k < t.shape.size(); ++k) strides.push_back(t.shape[k] == 1 ? 0 : t.strides[k] * elem);
      shape.push_back(elem);
      strides.push_back(1);
      gathered_[i] = storage.as_strided(shape, strides, t.storage_offset * elem).contiguous();
    }
    std::memcpy(dst, static_cast<const char*>(gathered_[i].data_ptr()) + offset, static_cast<size_t>(nbytes));
  }
  void release(size_t i) override {
    if (i < gathered_.size()) gathered_[i] = at::Tensor();
  }

 private:
  struct Record {
    std::string name;  // "data/<key>"
    int64_t offset = 0, nbytes = 0;
    uint32_t crc = 0;
    bool verified = false;
  };
  struct Progress {  // a whole-storage tensor read front to back
    int64_t next_nbytes = 0;
    uint32_t crc = 0;
  };
  // A record's place, size and stored CRC; it must be stored uncompressed (as torch.save writes) and lie inside
  // the file.
  Record stored_record(caffe2::serialize::PyTorchStreamReader& zip, const std::string& name) {
    uint8_t local[30];  // zip local file header
    file_.pread_exact(static_cast<int64_t>(zip.getRecordHeaderOffset(name)), 30, local);
    BMT_CHECK(local[8] == 0 && local[9] == 0, path_, ": record ", name, " is compressed; only uncompressed archives "
              "(what torch.save writes) are supported");
    Record r{name, static_cast<int64_t>(zip.getRecordOffset(name)), static_cast<int64_t>(zip.getRecordSize(name))};
    BMT_CHECK(r.offset >= 0 && r.nbytes >= 0 && r.nbytes <= file_.size_nbytes() - r.offset, path_, ": record ", name,
              " runs past the end of the file (truncated or corrupted)");
    r.crc = stored_crc32(file_, local, r.offset + r.nbytes);
    return r;
  }
  void verify(Record& rec) {
    if (rec.verified) return;
    std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(rec.nbytes, int64_t{4} << 20)));
    uint32_t crc = 0;
    for (int64_t at = 0; at < rec.nbytes;) {
      const int64_t n = std::min<int64_t>(rec.nbytes - at, static_cast<int64_t>(buf.size()));
      file_.pread_exact(rec.offset + at, n, buf.data());
      crc = crc32_update(crc, buf.data(), static_cast<size_t>(n));
      at += n;
    }
    check_crc(rec, crc);
  }
  void check_crc(Record& rec, uint32_t crc) {
    BMT_CHECK(crc == rec.crc, path_, ": record ", rec.name, " fails its CRC-32 check (stored ", crc32_hex(rec.crc),
              ", computed ", crc32_hex(crc), "): the file is corrupted; load another copy or re-save it");
    rec.verified = true;
  }

  std::string path_;
  InFile file_;
  std::vector<PickledTensor> refs_;
  std::vector<Record> records_;
  std::vector<size_t> record_of_;  // tensor -> its record
  std::vector<Progress> progress_;
  std::vector<at::Tensor> gathered_;
};

}  // namespace

std::unique_ptr<TensorFileWriter> create_pt_file(const std::string& path, const std::vector<TensorInfo>& t) {
  return std::make_unique<PtWriter>(path, t);
}

std::unique_ptr<TensorFileReader> open_pt_file(const std::string& path) { return std::make_unique<PtReader>(path); }

}  // namespace bmt::checkpoint::detail
