#include "bmt/checkpoint/state_slices.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <mutex>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/parameter.h"

namespace bmt::checkpoint {

std::unordered_map<const void*, std::string> param_names(torch::nn::Module& model) {
  std::unordered_map<const void*, std::string> names;
  for (auto& item : model.named_parameters(true)) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  for (auto& item : model.named_buffers(true)) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return names;
}

ParamRange param_range(const at::Tensor& p, const std::string& name) {
  ParamRange r;
  if (const ParamMeta* m = find_meta(p)) {
    BMT_ASSERT(p.numel() == m->shard_end - m->shard_begin, "parameter ", name, " holds ", p.numel(),
               " elements, its shard range is [", m->shard_begin, ", ", m->shard_end, ")");
    r.layout = unsplit_layout(m->logical_shape());
    int64_t base = 0;
    if (m->is_tp_split()) {
      r.layout = split_layout(m->logical_shape(), m->tp_split_dim, m->tp_size, static_cast<int>(m->tp_split_groups));
      r.tp_rank = m->tp_rank;
      BMT_ASSERT(r.layout.piece_numel() == m->full_numel, "parameter ", name, ": piece shape ",
                 shape_string(m->full_shape), " is not a tp piece of ", r.layout.describe());
      base = r.tp_rank * m->full_numel;
    }
    r.full_shape = r.layout.stored_shape();
    r.begin = base + m->shard_begin;
    r.end = base + m->shard_end;
  } else {
    r.layout = unsplit_layout(p.sizes().vec());
    r.full_shape = r.layout.logical_shape;
    r.begin = 0;
    r.end = p.numel();
  }
  return r;
}

at::Tensor read_param_range(CheckpointReader& reader, const EntryMeta& e, const ParamRange& r) {
  TpLayout src = entry_tp_layout(e.key, e.shape, e.attrs);
  TpLayout dst = r.layout;
  BMT_CHECK(align_unsplit(src, dst) && align_unsplit(dst, src) && src.logical_shape == dst.logical_shape,
            "checkpoint entry ", e.key, " has logical shape ", src.describe(), ", the target has ", r.layout.describe());
  if (src == dst) return reader.read(e, r.begin, r.end);
  const int64_t pn = src.piece_numel();
  return assemble_piece_range(src, dst, r.tp_rank, r.piece_begin(), r.piece_end(), scalar_type_of(e.dtype),
                              [&](int j, int64_t a, int64_t b) { return reader.read(e, j * pn + a, j * pn + b); });
}

bool stored_like(const EntryMeta& e, const ParamRange& r) {
  TpLayout src = entry_tp_layout(e.key, e.shape, e.attrs);
  TpLayout dst = r.layout;
  return align_unsplit(src, dst) && align_unsplit(dst, src) && src.logical_shape == dst.logical_shape && src == dst;
}

std::string entry_mismatch(const EntryMeta& e, const std::string& dtype, const ParamRange& r) {
  const TpLayout src = entry_tp_layout(e.key, e.shape, e.attrs);
  if (e.dtype == dtype && src.real_shape() == r.layout.real_shape()) return "";
  return "checkpoint has " + e.dtype + " " + src.describe() + ", model has " + dtype + " " + r.layout.describe();
}

namespace {

template <typename Fn>
void for_each_model_tensor(torch::nn::Module& model, Fn&& fn) {
  for (auto& item : model.named_parameters(true)) fn(item.key(), item.value(), "parameter");
  for (auto& item : model.named_buffers(true)) fn(item.key(), item.value(), "buffer");
}

}  // namespace

std::vector<LocalSlice> model_slices(torch::nn::Module& model, const std::string& prefix) {
  std::vector<LocalSlice> out;
  for_each_model_tensor(model, [&](const std::string& name, const at::Tensor& t, const char* kind) {
    ParamRange r = param_range(t, name);
    LocalSlice s;
    s.decl.key = prefix + name;
    s.decl.dtype = dtype_name(t.scalar_type());
    s.decl.shape = r.full_shape;
    s.decl.attrs = {{"role", "model"}, {"kind", kind}};
    add_tp_attrs(r.layout, s.decl.attrs);
    s.decl.begin = r.begin;
    s.decl.end = r.end;
    s.data = t.detach();
    out.push_back(std::move(s));
  });
  return out;
}

std::vector<LoadTarget> model_targets(torch::nn::Module& model, const std::string& prefix) {
  std::vector<LoadTarget> out;
  for_each_model_tensor(model, [&](const std::string& name, const at::Tensor& t, const char*) {
    out.push_back(LoadTarget{prefix + name, dtype_name(t.scalar_type()), param_range(t, name), t.detach()});
  });
  return out;
}

namespace {

int cuda_device_count() {
  const auto& hooks = at::detail::getCUDAHooks();
  return hooks.hasCUDA() ? static_cast<int>(hooks.deviceCount()) : 0;
}

LocalSlice rng_slice(int rank, int tp_size, const std::string& device, at::Tensor state) {
  LocalSlice s;
  s.data = state.contiguous().view({-1});
  s.decl.key = "rng/" + std::to_string(rank) + "/" + device;
  s.decl.dtype = "U8";
  s.decl.shape = {s.data.numel()};
  s.decl.attrs = {{"role", "rng"}, {"rank", std::to_string(rank)}, {"device", device}};
  if (tp_size > 1) s.decl.attrs["tp_size"] = std::to_string(tp_size);
  s.decl.begin = 0;
  s.decl.end = s.data.numel();
  return s;
}

}  // namespace

std::vector<LocalSlice> rng_slices(int rank, int tp_size) {
  std::vector<LocalSlice> out;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.push_back(rng_slice(rank, tp_size, "cpu", gen.get_state()));
  }
  for (int i = 0; i < cuda_device_count(); ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.push_back(rng_slice(rank, tp_size, "cuda:" + std::to_string(i), gen.get_state()));
  }
  return out;
}

int restore_rng(int rank, const std::function<at::Tensor(const std::string&)>& read_entry) {
  int restored = 0;
  auto restore = [&](at::Generator gen, const std::string& device) {
    at::Tensor state = read_entry("rng/" + std::to_string(rank) + "/" + device);
    if (!state.defined()) return;
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.to(at::kCPU).contiguous());
    ++restored;
  };
  restore(at::detail::getDefaultCPUGenerator(), "cpu");
  for (int i = 0; i < cuda_device_count(); ++i)
    restore(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))),
            "cuda:" + std::to_string(i));
  return restored;
}

}  // namespace bmt::checkpoint
