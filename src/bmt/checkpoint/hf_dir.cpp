#include "bmt/checkpoint/hf_dir.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/json_internal.h"
#include "bmt/checkpoint/safetensors_format_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tp_layout.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/pending_update.h"

namespace bmt::checkpoint {

// ---- HfConfig ----

struct HfConfig::Impl {
  Json root = Json::object();
};

HfConfig::HfConfig(const std::string& json_text, const std::string& what) : impl_(std::make_unique<Impl>()), what_(what) {
  impl_->root = Json::parse(json_text, what);
  impl_->root.as_object(what);  // throws unless an object
}
HfConfig::~HfConfig() = default;
HfConfig::HfConfig(const HfConfig& o) : impl_(o.impl_ ? std::make_unique<Impl>(*o.impl_) : nullptr), what_(o.what_) {}
HfConfig& HfConfig::operator=(const HfConfig& o) {
  impl_ = o.impl_ ? std::make_unique<Impl>(*o.impl_) : nullptr;
  what_ = o.what_;
  return *this;
}

bool HfConfig::has(const std::string& key) const {
  const Json* v = impl_ ? impl_->root.find(key) : nullptr;
  return v && !v->is_null();
}

std::vector<std::string> HfConfig::keys() const {
  std::vector<std::string> out;
  if (impl_)
    for (const auto& kv : impl_->root.as_object(what_)) out.push_back(kv.first);
  return out;
}

#define BMT_HF_GET(key)                                                                                     \
  BMT_CHECK(has(key), what_, ": the key \"", key, "\" is missing (or null); this model type needs it");     \
  const Json& v = *impl_->root.find(key);                                                                   \
  const std::string ctx = what_ + ": \"" + key + "\""

int64_t HfConfig::get_int(const std::string& key) const {
  BMT_HF_GET(key);
  return v.as_int(ctx);
}
double HfConfig::get_double(const std::string& key) const {
  BMT_HF_GET(key);
  return v.as_double(ctx);
}
bool HfConfig::get_bool(const std::string& key) const {
  BMT_HF_GET(key);
  return v.as_bool(ctx);
}
std::string HfConfig::get_string(const std::string& key) const {
  BMT_HF_GET(key);
  return v.as_string(ctx);
}
#undef BMT_HF_GET

std::string HfConfig::first_string(const std::string& key) const {
  if (!has(key)) return "";
  const Json& v = *impl_->root.find(key);
  if (v.is_string()) return v.as_string(what_);
  if (!v.is_array() || v.as_array(what_).empty()) return "";
  return v.as_array(what_)[0].as_string(what_ + ": \"" + key + "\"[0]");
}

HfConfig HfConfig::object(const std::string& key) const {
  HfConfig out;
  out.what_ = what_ + " \"" + key + "\"";
  out.impl_ = std::make_unique<Impl>();
  if (has(key)) {
    out.impl_->root = *impl_->root.find(key);
    out.impl_->root.as_object(out.what_);
  }
  return out;
}

std::string HfConfig::dump(const std::string& key) const {
  const Json* v = impl_ ? impl_->root.find(key) : nullptr;
  return v ? v->dump() : "null";
}

// ---- mapped files ----

struct HfDir::File {
  std::string path;
  SafetensorsHeader header;
  std::map<std::string, size_t> index;  // name -> position in header.tensors
  std::shared_ptr<void> mapping;        // the whole file, PROT_READ; null until a tensor is viewed
  int64_t nbytes = 0;
};

HfDir::File& HfDir::file(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return *it->second;
  auto f = std::make_unique<File>();
  f->path = dir_ + "/" + name;
  BMT_CHECK(path_exists(f->path), dir_, ": the safetensors file ", name, " named by the index is missing");
  InFile in(f->path);
  f->nbytes = in.size_nbytes();
  uint8_t first8[8] = {};
  BMT_CHECK(f->nbytes >= 8, f->path, ": not a safetensors file (", f->nbytes, " bytes)");
  in.pread_exact(0, 8, first8);
  const int64_t n = safetensors_header_nbytes(first8, f->nbytes, f->path);
  std::string json(static_cast<size_t>(n), '\0');
  in.pread_exact(8, n, json.data());
  f->header = parse_safetensors_json(json, f->nbytes, f->path);
  for (size_t i = 0; i < f->header.tensors.size(); ++i) f->index[f->header.tensors[i].name] = i;
  return *files_.emplace(name, std::move(f)).first->second;
}

int64_t HfDir::files_mapped() const {
  int64_t n = 0;
  for (const auto& kv : files_) n += kv.second->mapping ? 1 : 0;
  return n;
}

HfDir::HfDir(const std::string& dir) : dir_(dir) {
  BMT_CHECK(is_directory(dir), "Hugging Face import: ", dir, " is not a directory (expected what transformers' "
            "save_pretrained writes: config.json and *.safetensors)");
  const std::string config_path = dir + "/config.json";
  BMT_CHECK(path_exists(config_path), "Hugging Face import: ", dir, " has no config.json");
  config_ = HfConfig(read_file(config_path, 16 << 20), config_path);
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (path_exists(index_path)) {
    Json index = Json::parse(read_file(index_path, 256 << 20), index_path);
    for (const auto& kv : index.at("weight_map", index_path).as_object(index_path + " weight_map"))
      file_of_[kv.first] = kv.second.as_string(index_path + " weight_map." + kv.first);
    return;
  }
  std::vector<std::string> names;
  if (path_exists(dir + "/model.safetensors")) {
    names = {"model.safetensors"};
  } else {
    for (const std::string& n : list_directory(dir))
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) names.push_back(n);
  }
  BMT_CHECK(!names.empty(), "Hugging Face import: ", dir, " holds no *.safetensors file (save the model with "
            "save_pretrained(..., safe_serialization=True); .bin / .pt weights are not read)");
  for (const std::string& n : names)
    for (const TensorInfo& t : file(n).header.tensors) {
      BMT_CHECK(!file_of_.count(t.name), dir, ": tensor ", t.name, " is in both ", file_of_[t.name], " and ", n);
      file_of_[t.name] = n;
    }
}

HfDir::~HfDir() = default;

std::vector<std::string> HfDir::tensor_names() const {
  std::vector<std::string> out;
  for (const auto& kv : file_of_) out.push_back(kv.first);
  return out;
}

const TensorInfo& HfDir::info(const std::string& name) {
  auto it = file_of_.find(name);
  BMT_CHECK(it != file_of_.end(), dir_, ": no tensor named ", name);
  File& f = file(it->second);
  auto t = f.index.find(name);
  BMT_CHECK(t != f.index.end(), dir_, ": the index puts ", name, " in ", it->second, " but that file does not hold it");
  return f.header.tensors[t->second];
}

at::Tensor HfDir::view(const std::string& name) {
  const TensorInfo& ti = info(name);
  File& f = file(file_of_.at(name));
  if (!f.mapping) {
    const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    BMT_CHECK(fd >= 0, "cannot open ", f.path, ": ", std::strerror(errno));
    void* p = ::mmap(nullptr, static_cast<size_t>(f.nbytes), PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    BMT_CHECK(p != MAP_FAILED, "cannot memory-map ", f.path, ": ", std::strerror(err));
    const size_t len = static_cast<size_t>(f.nbytes);
    f.mapping = std::shared_ptr<void>(p, [len](void* q) { ::munmap(q, len); });
  }
  const size_t i = f.index.at(name);
  char* data = static_cast<char*>(f.mapping.get()) + f.header.data_start_nbytes + f.header.data_offsets[i];
  std::shared_ptr<void> keep = f.mapping;
  // from_blob never writes; the const_cast is only for its signature.
  return at::from_blob(data, ti.shape, [keep](void*) {}, at::TensorOptions().dtype(scalar_type_of(ti.dtype)));
}

namespace {

// Elements [begin, end) of v's row-major order: one copy of the whole rows in the middle, the partial first and
// last rows recursively, so only the requested elements are touched.
at::Tensor copy_flat(const at::Tensor& v, int64_t begin, int64_t end) {
  if (begin >= end) return at::empty({0}, v.options());
  if (v.dim() <= 1) return v.reshape({-1}).slice(0, begin, end).clone(at::MemoryFormat::Contiguous);
  const int64_t inner = v.numel() / v.size(0);
  const int64_t r0 = begin / inner, r_last = (end - 1) / inner;
  if (r0 == r_last) return copy_flat(v.select(0, r0), begin - r0 * inner, end - r0 * inner);
  std::vector<at::Tensor> parts;
  int64_t full_begin = r0, full_end = r_last + 1;
  if (begin % inner != 0) {
    parts.push_back(copy_flat(v.select(0, r0), begin % inner, inner));
    full_begin = r0 + 1;
  }
  at::Tensor tail;
  if (end % inner != 0) {
    tail = copy_flat(v.select(0, r_last), 0, end - r_last * inner);
    full_end = r_last;
  }
  if (full_end > full_begin) parts.push_back(v.slice(0, full_begin, full_end).clone(at::MemoryFormat::Contiguous).view({-1}));
  if (tail.defined()) parts.push_back(tail);
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

}  // namespace

at::Tensor HfDir::copy_range(const at::Tensor& v, int64_t begin, int64_t end) {
  BMT_ASSERT(0 <= begin && begin <= end && end <= v.numel(), "copy_range [", begin, ", ", end, ") of ", v.numel());
  at::Tensor out = copy_flat(v, begin, end);
  bytes_copied_ += out.numel() * static_cast<int64_t>(out.element_size());
  return out;
}

// ---- loading ----

LoadResult load_hf_safetensors(torch::nn::Module& model, HfDir& dir, const HfNameMap& map,
                               const HfLoadOptions& options, HfLoadStats* stats) {
  wait_all_pending_updates();  // an update still running would overwrite the loaded values
  at::NoGradGuard no_grad;
  const std::string what = "Hugging Face import from " + dir.path();
  const int64_t copied_before = dir.bytes_copied();
  HfLoadStats st;
  LoadResult result;
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::string error = detail::capture_error([&] {
    for (const LoadTarget& t : model_targets(model, "")) {
      auto m = map.find(t.key);
      if (m == map.end()) {
        result.missing_keys.push_back(t.key);
        continue;
      }
      const HfSource& src = m->second;
      if (!dir.has(src.name)) {
        problems.push_back(t.key + ": the Hugging Face tensor " + src.name + " is not in the directory");
        continue;
      }
      used.insert(src.name);
      const TensorInfo& info = dir.info(src.name);
      std::vector<int64_t> shape = info.shape;
      if (src.transpose) {
        if (shape.size() != 2) {
          problems.push_back(t.key + ": " + src.name + " is " + shape_string(shape) + ", cannot transpose");
          continue;
        }
        std::swap(shape[0], shape[1]);
      }
      const ParamRange& r = t.range;
      // Rows of dimension 0 the source has (fewer than the model's only with pad_rows; split along dim 0 only).
      const std::vector<int64_t> want = r.layout.real_shape();
      int64_t src_rows = want.empty() ? 0 : want[0];
      if (src.pad_rows && !shape.empty() && shape.size() == want.size() && shape[0] < want[0] &&
          std::equal(shape.begin() + 1, shape.end(), want.begin() + 1) && r.layout.split_groups == 1 &&
          r.layout.split_dim <= 0) {
        src_rows = shape[0];
        shape[0] = want[0];
      }
      if (shape != want) {
        problems.push_back(t.key + ": " + src.name + (src.transpose ? " transposed" : "") + " is " +
                           shape_string(shape) + ", the model needs " + shape_string(r.layout.real_shape()));
        continue;
      }
      at::Tensor v = dir.view(src.name);
      if (src.transpose) v = v.t();
      int64_t begin = r.begin, end = r.end, piece_rows = src_rows, first_row = 0;
      if (r.layout.is_split()) {
        // The tp piece as a view: the (grouped) logical shape, narrowed along the split dimension.
        const int64_t n = r.layout.piece_shape()[static_cast<size_t>(r.layout.split_dim)];
        if (src_rows == want[0]) {
          v = v.view(r.layout.logical_shape).narrow(r.layout.split_dim, r.tp_rank * n, n);
        } else {  // padded rows, split along dim 0: this piece's rows that the source has
          first_row = r.tp_rank * n;
          piece_rows = std::clamp<int64_t>(src_rows - first_row, 0, n);
          v = v.narrow(0, std::min(first_row, src_rows), piece_rows);
        }
        begin = r.piece_begin();
        end = r.piece_end();
      }
      // Elements past the source's rows (pad_rows) are zeros.
      const int64_t have = want.empty() ? end : piece_rows * (v.dim() > 0 ? v.numel() / std::max<int64_t>(v.size(0), 1) : 1);
      at::Tensor values = dir.copy_range(v, std::min(begin, have), std::min(end, have));
      if (end > have) values = at::cat({values, at::zeros({end - std::max(begin, have)}, values.options())});
      st.bytes_needed += (std::min(end, have) - std::min(begin, have)) * dtype_element_nbytes(info.dtype);
      t.dst.copy_(values.view(t.dst.sizes()));
    }
  });
  if (error.empty()) {
    for (const std::string& name : dir.tensor_names())
      if (!used.count(name) && !options.ignore.count(name)) result.unexpected_keys.push_back(name);
    if (!problems.empty() || (options.strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty()))) {
      error = "the directory does not match the model:";
      if (!result.missing_keys.empty()) {
        error += "\n    model keys without a source in the name map:";
        for (const auto& k : result.missing_keys) error += " " + k;
      }
      if (!result.unexpected_keys.empty()) {
        error += "\n    Hugging Face tensors the model does not use:";
        for (const auto& k : result.unexpected_keys) error += " " + k;
      }
      for (const auto& p : problems) error += "\n    " + p;
    }
  }
  if (is_initialized())
    detail::raise_if_any_failed(*config().comm, error, what);
  else
    BMT_CHECK(error.empty(), what, " failed: ", error);
  st.bytes_copied = dir.bytes_copied() - copied_before;
  st.files_mapped = dir.files_mapped();
  if (stats) *stats = st;
  return result;
}

LoadResult load_hf_safetensors(torch::nn::Module& model, const std::string& dir, const HfNameMap& map,
                               const HfLoadOptions& options, HfLoadStats* stats) {
  HfDir d(dir);
  return load_hf_safetensors(model, d, map, options, stats);
}

}  // namespace bmt::checkpoint
