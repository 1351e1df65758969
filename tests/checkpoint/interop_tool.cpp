// bmt_ckpt_interop: the C++ side of test_python_interop.py.
//   bmt_ckpt_interop write <dir>   writes formula.{safetensors,pt} (tensors of every dtype with values from
//                                  formula() below), and, from a one-rank training setup, model.{safetensors,pt}
//                                  (bmt::save) and a sharded checkpoint ckpt/ (bmt::checkpoint::save)
//   bmt_ckpt_interop check <file>  reads a file written by Python and checks every tensor against formula()
// formula(name, shape): arange(numel) as float64 * 0.5 - 3 cast to the dtype; integers arange - 5 (uint8:
// arange % 200); bool: arange % 3 == 0. Exit status 0 when everything matches.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/sharded_checkpoint.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/runtime/init.h"
#include "tiny_model.h"

using namespace bmt::checkpoint;

namespace {

const std::vector<std::pair<std::string, std::vector<int64_t>>> kSpec = {
    {"f32", {3, 4}}, {"f64", {5}}, {"f16", {2, 3}}, {"bf16", {7}}, {"i64", {4}},       {"i32", {2, 2}},
    {"i16", {3}},    {"i8", {3}},  {"u8", {10}},    {"bool", {5}}, {"scalar_f32", {}}, {"empty_f32", {0, 2}}};

at::ScalarType dtype_for(const std::string& name) {
  static const std::map<std::string, at::ScalarType> m = {
      {"f32", at::kFloat}, {"f64", at::kDouble}, {"f16", at::kHalf}, {"bf16", at::kBFloat16}, {"i64", at::kLong},
      {"i32", at::kInt},   {"i16", at::kShort},  {"i8", at::kChar},  {"u8", at::kByte},       {"bool", at::kBool}};
  auto it = m.find(name);
  return it != m.end() ? it->second : at::kFloat;
}

at::Tensor formula(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  at::Tensor idx = at::arange(numel, at::kDouble);
  const at::ScalarType t = dtype_for(name);
  at::Tensor v;
  if (t == at::kBool) v = at::fmod(idx, 3).eq(0);
  else if (t == at::kByte) v = at::fmod(idx, 200).to(t);
  else if (at::isIntegralType(t, false)) v = (idx - 5).to(t);
  else v = (idx * 0.5 - 3).to(t);
  return v.reshape(shape);
}

void write_formula(const std::string& path) {
  std::vector<TensorInfo> infos;
  for (auto& [n, s] : kSpec) infos.push_back({n, dtype_name(dtype_for(n)), s});
  auto w = create_tensor_file(path, infos, {{"format", "pt"}});
  for (auto& [n, s] : kSpec) {
    at::Tensor t = formula(n, s).contiguous();
    w->append(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
  }
  w->commit();
}

int check(const std::string& path) {
  auto r = open_tensor_file(path);
  int bad = 0;
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < r->tensors().size(); ++i) index[r->tensors()[i].name] = i;
  for (auto& [n, s] : kSpec) {
    auto it = index.find(n);
    if (it == index.end()) {
      std::cerr << path << ": missing " << n << "\n";
      ++bad;
      continue;
    }
    const TensorInfo& info = r->tensors()[it->second];
    at::Tensor got = at::empty(info.shape, at::TensorOptions().dtype(scalar_type_of(info.dtype)));
    r->read(it->second, 0, static_cast<int64_t>(got.nbytes()), got.data_ptr());
    at::Tensor want = formula(n, s);
    if (got.scalar_type() != want.scalar_type() || !at::equal(got, want)) {
      std::cerr << path << ": " << n << " differs (" << info.dtype << " " << shape_string(info.shape) << ")\n";
      ++bad;
    }
  }
  return bad == 0 ? 0 : 1;
}

// A free port, kept bound (SO_REUSEADDR, not listening) for the life of this process so that no parallel job is
// handed it before our own rendezvous store binds it (the store sets SO_REUSEADDR too).
int reserved_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);  // fd intentionally left open
}

int write_all(const std::string& dir) {
  write_formula(join_path(dir, "formula.safetensors"));
  write_formula(join_path(dir, "formula.pt"));
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("LOCAL_RANK", "0", 1);
  setenv("LOCAL_WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(reserved_port()).c_str(), 1);
  bmt::InitOptions o;
  o.backend = bmt::Backend::kGloo;
  o.quiet = true;
  bmt::init_distributed(o);
  tiny::Dims d;
  tiny::Model model(d, {}, true);
  at::manual_seed(7);
  bmt::init_parameters(model);
  bmt::save(model, join_path(dir, "model.safetensors"));
  bmt::save(model, join_path(dir, "model.pt"));
  TrainingState state;
  state.model = &model;
  state.step = 11;
  state.user_metadata = {{"origin", "interop"}};
  save(join_path(dir, "ckpt"), state);
  bmt::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: bmt_ckpt_interop write <dir> | check <file>\n";
    return 2;
  }
  try {
    const std::string mode = argv[1];
    if (mode == "write") return write_all(argv[2]);
    if (mode == "check") return check(argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "bmt_ckpt_interop: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "unknown mode\n";
  return 2;
}
