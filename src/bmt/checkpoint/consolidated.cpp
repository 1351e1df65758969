#include "bmt/checkpoint/consolidated.h"

#include <chrono>
#include <cstring>
#include <set>
#include <unordered_map>

#include "bmt/checkpoint/comm_util.h"
#include "bmt/checkpoint/json.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/core/error.h"
#include "bmt/init.h"

namespace bmt {

using namespace checkpoint;
using checkpoint::detail::byte_view;
using checkpoint::detail::capture_error;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

void check_topology(const char* op) {
  const Config& cfg = config();
  BMT_CHECK(cfg.pipe_size == 1 && cfg.tp_size == 1, op, ": consolidated files need pipe_size == tp_size == 1 (got ",
            cfg.pipe_size, ", ", cfg.tp_size, "); use bmt::checkpoint::save and bmt-ckpt export instead");
}

int64_t chunk_numel_for(const std::string& dtype, int64_t chunk_nbytes) {
  return std::max<int64_t>(1, chunk_nbytes / dtype_element_nbytes(dtype));
}

}  // namespace

ConsolidatedStats save(torch::nn::Module& model, const std::string& path, const ConsolidatedOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  check_topology("bmt::save");
  core::Communicator& comm = *config().comm;
  const int rank = comm.rank();
  std::vector<LocalSlice> mine;
  std::string err = capture_error([&] { mine = model_slices(model, ""); });
  checkpoint::detail::raise_if_any_failed(comm, err, "bmt::save(" + path + ")");
  std::vector<SliceDecl> decls;
  std::unordered_map<std::string, const LocalSlice*> by_key;
  for (const LocalSlice& s : mine) {
    decls.push_back(s.decl);
    by_key[s.decl.key] = &s;
  }
  std::vector<std::vector<SliceDecl>> all;
  for (const auto& s : checkpoint::detail::all_gather_strings(comm, encode_decls(decls))) all.push_back(decode_decls(s));
  const std::vector<PlannedEntry> plan = plan_pieces(all);

  ConsolidatedStats stats;
  std::unique_ptr<TensorFileWriter> writer;
  std::string rank0_error;
  if (rank == 0) {
    std::vector<TensorInfo> infos;
    for (const PlannedEntry& e : plan) infos.push_back(TensorInfo{e.info.key, e.info.dtype, e.info.shape});
    rank0_error = capture_error([&] { writer = create_tensor_file(path, infos, options.metadata); });
  }
  at::Tensor buf;
  for (const PlannedEntry& e : plan) {
    const int64_t elem = dtype_element_nbytes(e.info.dtype), step = chunk_numel_for(e.info.dtype, options.chunk_nbytes);
    for (int64_t a = 0; a < e.numel; a += step) {
      const int64_t b = std::min(e.numel, a + step);
      if (rank == 0) buf = at::empty({(b - a) * elem}, at::TensorOptions().dtype(at::kByte));
      for (const PlannedPiece& p : e.pieces) {
        const int64_t lo = std::max(a, p.begin), hi = std::min(b, p.end);
        if (lo >= hi || (rank != 0 && rank != p.rank)) continue;
        if (rank == 0 && p.rank == 0) {
          const LocalSlice& s = *by_key.at(e.info.key);
          buf.narrow(0, (lo - a) * elem, (hi - lo) * elem).copy_(byte_view(s.data, lo - s.decl.begin, hi - s.decl.begin));
        } else if (rank == 0) {
          at::Tensor dst = buf.narrow(0, (lo - a) * elem, (hi - lo) * elem);
          checkpoint::detail::recv_tensor_bytes(comm, dst, p.rank);
        } else {
          const LocalSlice& s = *by_key.at(e.info.key);
          checkpoint::detail::send_tensor_bytes(comm, byte_view(s.data, lo - s.decl.begin, hi - s.decl.begin), 0);
        }
      }
      if (rank == 0) {
        stats.rank0_peak_nbytes = std::max(stats.rank0_peak_nbytes, buf.numel());
        stats.file_nbytes += buf.numel();
        if (rank0_error.empty()) rank0_error = capture_error([&] { writer->append(buf.data_ptr(), buf.numel()); });
      }
    }
  }
  if (rank == 0) {
    if (rank0_error.empty()) rank0_error = capture_error([&] { writer->commit(); });
    if (writer) stats.rank0_peak_nbytes += writer->max_buffered_nbytes();
    writer.reset();  // deletes the temporary file after a failure
  }
  checkpoint::detail::raise_if_any_failed(comm, rank0_error, "bmt::save(" + path + ")");
  stats.seconds = seconds_since(t0);
  return stats;
}

LoadResult load(torch::nn::Module& model, const std::string& path, bool strict, const ConsolidatedOptions& options,
                ConsolidatedStats* stats_out) {
  const auto t0 = std::chrono::steady_clock::now();
  check_topology("bmt::load");
  core::Communicator& comm = *config().comm;
  const int rank = comm.rank(), world = comm.size();
  const std::string what = "bmt::load(" + path + ")";
  ConsolidatedStats stats;

  // Rank 0 opens the file and shares its index.
  std::unique_ptr<TensorFileReader> reader;
  std::string index;
  if (rank == 0) {
    std::string e = capture_error([&] {
      reader = open_tensor_file(path);
      std::vector<SliceDecl> idx;
      for (const TensorInfo& t : reader->tensors()) idx.push_back(SliceDecl{t.name, t.dtype, t.shape, {}, 0, 0});
      index = encode_decls(idx);
    });
    if (!e.empty()) index = "!" + e;
  }
  index = checkpoint::detail::broadcast_string(comm, index, 0);
  BMT_CHECK(index.empty() || index[0] != '!', what, " failed: ", index.substr(1));
  const std::vector<SliceDecl> file_index = decode_decls(index);

  // Check the model against the index (every rank sees the same index; each checks its own model).
  LoadResult result;
  std::vector<LoadTarget> targets = model_targets(model, "");
  std::unordered_map<std::string, size_t> target_of, file_pos;
  for (size_t i = 0; i < targets.size(); ++i) target_of[targets[i].key] = i;
  for (size_t i = 0; i < file_index.size(); ++i) file_pos[file_index[i].key] = i;
  std::vector<std::string> mismatched;
  std::vector<SliceDecl> needs;
  for (const LoadTarget& t : targets) {
    auto it = file_pos.find(t.key);
    if (it == file_pos.end()) {
      result.missing_keys.push_back(t.key);
      continue;
    }
    const SliceDecl& f = file_index[it->second];
    if (f.dtype != t.dtype || f.shape != t.shape) {
      mismatched.push_back(t.key + ": file has " + f.dtype + " " + shape_string(f.shape) + ", model has " + t.dtype +
                           " " + shape_string(t.shape));
      continue;
    }
    needs.push_back(SliceDecl{t.key, t.dtype, t.shape, {}, t.begin, t.end});
  }
  for (const SliceDecl& f : file_index)
    if (!target_of.count(f.key)) result.unexpected_keys.push_back(f.key);
  std::string err;
  if (!mismatched.empty() || (strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty()))) {
    err = "the file does not match the model:";
    if (!result.missing_keys.empty()) {
      err += "\n    missing keys:";
      for (const auto& k : result.missing_keys) err += " " + k;
    }
    if (!result.unexpected_keys.empty()) {
      err += "\n    unexpected keys:";
      for (const auto& k : result.unexpected_keys) err += " " + k;
    }
    for (const auto& m : mismatched) err += "\n    shape/dtype mismatch: " + m;
    if (mismatched.empty()) err += "\n    (pass strict = false to load the matching keys only)";
  }
  checkpoint::detail::raise_if_any_failed(comm, err, what);

  // Who needs which range of which tensor.
  std::vector<std::vector<SliceDecl>> all_needs;
  for (const auto& s : checkpoint::detail::all_gather_strings(comm, encode_decls(needs))) all_needs.push_back(decode_decls(s));
  std::vector<std::vector<std::pair<int, SliceDecl>>> by_tensor(file_index.size());
  for (int r = 0; r < world; ++r)
    for (const SliceDecl& d : all_needs[static_cast<size_t>(r)]) by_tensor[file_pos.at(d.key)].emplace_back(r, d);

  std::string local_error;
  at::NoGradGuard no_grad;
  for (size_t ti = 0; ti < file_index.size(); ++ti) {
    if (by_tensor[ti].empty()) continue;
    const SliceDecl& f = file_index[ti];
    const int64_t elem = dtype_element_nbytes(f.dtype), numel = checked_numel(f.shape, f.key);
    const int64_t step = chunk_numel_for(f.dtype, options.chunk_nbytes);
    // My destination: the target itself when contiguous, else a staging tensor copied at the end.
    at::Tensor dst, flat;
    int64_t my_begin = 0, my_end = 0;
    if (auto it = target_of.find(f.key); it != target_of.end() && file_pos.count(f.key)) {
      const LoadTarget& t = targets[it->second];
      dst = t.dst;
      my_begin = t.begin;
      my_end = t.end;
      flat = dst.is_contiguous() ? dst.view({-1}) : at::empty({my_end - my_begin}, dst.options());
    }
    for (int64_t a = 0; a < numel; a += step) {
      const int64_t b = std::min(numel, a + step);
      at::Tensor buf;
      if (rank == 0) {
        buf = at::zeros({(b - a) * elem}, at::TensorOptions().dtype(at::kByte));
        if (local_error.empty())
          local_error = capture_error([&] { reader->read(ti, a * elem, (b - a) * elem, buf.data_ptr()); });
        stats.rank0_peak_nbytes = std::max(stats.rank0_peak_nbytes, buf.numel());
        stats.file_nbytes += buf.numel();
      }
      for (const auto& [r, need] : by_tensor[ti]) {
        const int64_t lo = std::max(a, need.begin), hi = std::min(b, need.end);
        if (lo >= hi || (rank != 0 && rank != r)) continue;
        if (rank == 0 && r != 0) {
          checkpoint::detail::send_tensor_bytes(comm, buf.narrow(0, (lo - a) * elem, (hi - lo) * elem), r);
          continue;
        }
        at::Tensor part = flat.narrow(0, lo - my_begin, hi - lo);
        at::Tensor part_bytes = part.view(at::kByte);
        if (rank == 0) {
          part_bytes.copy_(buf.narrow(0, (lo - a) * elem, (hi - lo) * elem));
        } else if (part_bytes.device() == config().device) {
          checkpoint::detail::recv_tensor_bytes(comm, part_bytes, 0);
        } else {
          at::Tensor staging = at::empty({part_bytes.numel()}, at::TensorOptions().dtype(at::kByte).device(config().device));
          checkpoint::detail::recv_tensor_bytes(comm, staging, 0);
          part_bytes.copy_(staging);
        }
      }
    }
    if (dst.defined() && !dst.is_contiguous()) dst.copy_(flat.view(dst.sizes()));
    if (rank == 0) reader->release(ti);
  }
  checkpoint::detail::raise_if_any_failed(comm, local_error, what);
  stats.seconds = seconds_since(t0);
  if (stats_out) *stats_out = stats;
  return result;
}

}  // namespace bmt
