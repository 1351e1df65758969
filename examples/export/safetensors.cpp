#include "export/safetensors.h"

#include "bmt/checkpoint/json_internal.h"
#include "bmt/checkpoint/safetensors_format_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"

namespace examples {
namespace {

namespace ck = bmt::checkpoint;

std::vector<ck::TensorInfo> infos_of(const NamedTensors& tensors) {
  std::vector<ck::TensorInfo> infos;
  infos.reserve(tensors.size());
  for (const auto& [name, t] : tensors) infos.push_back({name, ck::dtype_name(t.scalar_type()), t.sizes().vec()});
  return infos;
}

}  // namespace

std::string json_quote(const std::string& s) { return ck::Json(s).dump(); }

std::string safetensors_header(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  // The library's header is the u64 length + JSON padded with spaces; return the JSON alone.
  std::string h = ck::build_safetensors_header(infos_of(tensors), metadata).substr(8);
  while (!h.empty() && h.back() == ' ') h.pop_back();
  return h;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  auto writer = ck::create_tensor_file(path, infos_of(tensors), metadata);  // checks names, writes atomically
  for (const auto& item : tensors) {
    at::Tensor t = item.second.detach().cpu().contiguous();
    writer->append(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
  }
  writer->commit();
}

}  // namespace examples
