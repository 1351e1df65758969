#include "bmt/optim/flat_state_dict.h"

#include <torch/serialize.h>

#include <cstring>

#include "bmt/core/error.h"

namespace bmt::optim {
namespace {
constexpr const char* kArchiveKey = "bmt_state_dict";
}

at::Tensor scalar_entry(double value) { return at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble)); }

at::Tensor int_entry(int64_t value) { return at::scalar_tensor(value, at::TensorOptions().dtype(at::kLong)); }

bool has_entry(const StateDict& sd, const std::string& key) { return sd.count(key) > 0; }

const at::Tensor& get_entry(const StateDict& sd, const std::string& key, const char* what) {
  auto it = sd.find(key);
  BMT_CHECK(it != sd.end() && it->second.defined(), "load_state_dict of ", what, ": the state dict has no entry '",
            key, "' (was it saved by a different model, optimizer or bmtrain version?)");
  return it->second;
}

double get_double(const StateDict& sd, const std::string& key, const char* what) {
  const at::Tensor& t = get_entry(sd, key, what);
  BMT_CHECK(t.numel() == 1, "load_state_dict of ", what, ": entry '", key, "' should be a scalar but has shape ",
            t.sizes());
  return t.item<double>();
}

int64_t get_int(const StateDict& sd, const std::string& key, const char* what) {
  const at::Tensor& t = get_entry(sd, key, what);
  BMT_CHECK(t.numel() == 1 && !t.is_floating_point(), "load_state_dict of ", what, ": entry '", key,
            "' should be an integer scalar but is ", t.scalar_type(), " of shape ", t.sizes());
  return t.item<int64_t>();
}

void put_prefixed(StateDict& dst, const std::string& prefix, const StateDict& src) {
  for (const auto& [k, v] : src) dst[prefix + k] = v;
}

StateDict get_prefixed(const StateDict& src, const std::string& prefix) {
  StateDict out;
  for (auto it = src.lower_bound(prefix); it != src.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
    out[it->first.substr(prefix.size())] = it->second;
  return out;
}

void save_state_dict(const StateDict& sd, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [k, v] : sd) dict.insert(k, v);
  torch::serialize::OutputArchive archive;
  archive.write(kArchiveKey, c10::IValue(dict));
  archive.save_to(path);
}

StateDict load_state_dict_file(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  c10::IValue value;
  BMT_CHECK(archive.try_read(kArchiveKey, value) && value.isGenericDict(), "load_state_dict_file('", path,
            "'): not a bmtrain optimizer state dict (no '", kArchiveKey, "' entry)");
  StateDict sd;
  for (const auto& entry : value.toGenericDict()) sd[entry.key().toStringRef()] = entry.value().toTensor();
  return sd;
}

at::Tensor bytes_to_tensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte));
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::string tensor_to_bytes(const at::Tensor& t) {
  BMT_CHECK(t.scalar_type() == at::kByte && t.dim() == 1, "expected a 1-D uint8 tensor of serialised bytes, got ",
            t.scalar_type(), " of shape ", t.sizes());
  at::Tensor c = t.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

}  // namespace bmt::optim
