#include "bmt/checkpoint/comm_util_internal.h"

#include <cstring>
#include <map>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt::checkpoint::detail {
namespace {

at::TensorOptions comm_options(at::ScalarType t) { return at::TensorOptions().dtype(t).device(config().device); }

}  // namespace

std::vector<std::string> all_gather_strings(core::Communicator& comm, const std::string& mine) {
  const int ws = comm.size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), comm_options(at::kLong));
  at::Tensor lens = at::empty({ws}, comm_options(at::kLong));
  comm.all_gather(len.data_ptr(), lens.data_ptr(), 1, core::DType::kInt64, current_stream_handle(len));
  at::Tensor lens_cpu = lens.to(at::kCPU);
  int64_t max_len = 1;
  for (int r = 0; r < ws; ++r) max_len = std::max(max_len, lens_cpu.data_ptr<int64_t>()[r]);
  at::Tensor buf = at::zeros({max_len}, at::TensorOptions().dtype(at::kByte));
  if (!mine.empty()) std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  buf = buf.to(config().device);
  at::Tensor all = at::empty({ws * max_len}, comm_options(at::kByte));
  comm.all_gather(buf.data_ptr(), all.data_ptr(), static_cast<size_t>(max_len), core::DType::kUInt8,
                  current_stream_handle(buf));
  at::Tensor all_cpu = all.to(at::kCPU);
  std::vector<std::string> out;
  const char* base = reinterpret_cast<const char*>(all_cpu.data_ptr());
  for (int r = 0; r < ws; ++r)
    out.emplace_back(base + r * max_len, static_cast<size_t>(lens_cpu.data_ptr<int64_t>()[r]));
  return out;
}

std::string broadcast_string(core::Communicator& comm, const std::string& s, int root) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), comm_options(at::kLong));
  comm.broadcast(len.data_ptr(), len.data_ptr(), 1, core::DType::kInt64, root, current_stream_handle(len));
  const int64_t n = len.to(at::kCPU).item<int64_t>();
  at::Tensor buf = at::zeros({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kByte));
  if (comm.rank() == root && n > 0) std::memcpy(buf.data_ptr(), s.data(), s.size());
  buf = buf.to(config().device);
  comm.broadcast(buf.data_ptr(), buf.data_ptr(), static_cast<size_t>(buf.numel()), core::DType::kUInt8, root,
                 current_stream_handle(buf));
  at::Tensor cpu = buf.to(at::kCPU);
  return std::string(reinterpret_cast<const char*>(cpu.data_ptr()), static_cast<size_t>(n));
}

void raise_if_any_failed(core::Communicator& comm, const std::string& my_error, const std::string& what) {
  std::vector<std::string> errors = all_gather_strings(comm, my_error);
  // Group identical messages so that a problem every rank sees is reported once.
  std::map<std::string, std::vector<int>> by_message;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) by_message[errors[r]].push_back(static_cast<int>(r));
  if (by_message.empty()) return;
  std::string msg = what + " failed:";
  for (const auto& kv : by_message) {
    msg += "\n  rank";
    msg += kv.second.size() > 1 ? "s " : " ";
    for (size_t i = 0; i < kv.second.size(); ++i) msg += (i ? "," : "") + std::to_string(kv.second[i]);
    msg += ": " + kv.first;
  }
  throw core::Error(msg);
}

at::Tensor byte_view(const at::Tensor& t, int64_t begin, int64_t end) {
  at::Tensor flat = t.reshape({-1}).narrow(0, begin, end - begin).contiguous();
  if (flat.scalar_type() == at::kBool) flat = flat.view(at::kByte);
  return flat.view(at::kByte);
}

void send_tensor_bytes(core::Communicator& comm, const at::Tensor& t, int peer) {
  at::Tensor bytes = byte_view(t, 0, t.numel());
  if (bytes.device() != config().device) bytes = bytes.to(config().device);
  if (bytes.numel() == 0) return;
  comm.send(bytes.data_ptr(), static_cast<size_t>(bytes.numel()), core::DType::kUInt8, peer,
            current_stream_handle(bytes));
}

void recv_tensor_bytes(core::Communicator& comm, at::Tensor& dst_u8, int peer) {
  BMT_ASSERT(dst_u8.scalar_type() == at::kByte && dst_u8.is_contiguous(), "recv_tensor_bytes needs contiguous uint8");
  if (dst_u8.numel() == 0) return;
  if (dst_u8.device() == config().device) {
    comm.recv(dst_u8.data_ptr(), static_cast<size_t>(dst_u8.numel()), core::DType::kUInt8, peer,
              current_stream_handle(dst_u8));
    return;
  }
  at::Tensor staging = at::empty({dst_u8.numel()}, comm_options(at::kByte));
  comm.recv(staging.data_ptr(), static_cast<size_t>(staging.numel()), core::DType::kUInt8, peer,
            current_stream_handle(staging));
  dst_u8.copy_(staging);
}

std::vector<std::string> keys_on_every_rank(core::Communicator& comm, const std::vector<std::string>& mine) {
  if (comm.size() == 1) return mine;
  std::string joined;
  for (const auto& k : mine) joined += k + '\n';
  std::map<std::string, int> count;
  for (const std::string& s : all_gather_strings(comm, joined)) {
    size_t a = 0;
    for (size_t b = s.find('\n'); b != std::string::npos; a = b + 1, b = s.find('\n', a)) ++count[s.substr(a, b - a)];
  }
  std::vector<std::string> out;
  for (const auto& k : mine)
    if (count[k] == comm.size()) out.push_back(k);
  return out;
}

}  // namespace bmt::checkpoint::detail
