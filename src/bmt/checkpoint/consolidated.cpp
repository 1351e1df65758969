#include "bmt/checkpoint/consolidated.h"

#include <chrono>
#include <cstring>
#include <set>
#include <unordered_map>

#include "bmt/checkpoint/comm_util_internal.h"
#include "bmt/checkpoint/json_internal.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/checkpoint/staged_appender_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/tp_layout.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/pending_update.h"

namespace bmt {

using namespace checkpoint;
using checkpoint::detail::byte_view;
using checkpoint::detail::capture_error;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Any topology: with pipeline stages each tensor is assembled from the ranks of the stage holding it.
void check_topology(const char* op) { (void)config(); (void)op; }

int64_t chunk_numel_for(const std::string& dtype, int64_t chunk_nbytes) {
  return std::max<int64_t>(1, chunk_nbytes / dtype_element_nbytes(dtype));
}

}  // namespace

ConsolidatedStats save(torch::nn::Module& model, const std::string& path, const ConsolidatedOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  check_topology("bmt::save");
  wait_all_pending_updates();  // asynchronous optimizer steps still writing parameters
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

  std::vector<TpLayout> layouts;
  for (const PlannedEntry& e : plan) layouts.push_back(entry_tp_layout(e.info.key, e.info.shape, e.info.attrs));

  ConsolidatedStats stats;
  std::unique_ptr<TensorFileWriter> writer;
  std::unique_ptr<StagedAppender> stage;  // rank 0: fetching overlaps writing
  std::string rank0_error;
  if (rank == 0) {
    std::vector<TensorInfo> infos;
    for (size_t i = 0; i < plan.size(); ++i)
      infos.push_back(TensorInfo{plan[i].info.key, plan[i].info.dtype, layouts[i].real_shape()});
    bool on_device = false;
    for (const LocalSlice& s : mine) on_device |= !s.data.is_cpu();
    rank0_error = capture_error([&] {
      writer = create_tensor_file(path, infos, options.metadata);
      stage = std::make_unique<StagedAppender>(*writer, options.chunk_nbytes, on_device);
    });
  }
  // The staging buffers hold half a chunk each: two of them are one chunk.
  const int64_t piece_nbytes = std::max<int64_t>(1, options.chunk_nbytes / 2);
  // Elements [a, b) of entry e's flattened (stored) tensor into dst (bytes, rank 0), each from its owner.
  auto fetch = [&](const PlannedEntry& e, int64_t a, int64_t b, at::Tensor dst) {
    const int64_t elem = dtype_element_nbytes(e.info.dtype);
    for (const PlannedPiece& p : e.pieces) {
      const int64_t lo = std::max(a, p.begin), hi = std::min(b, p.end);
      if (lo >= hi || (rank != 0 && rank != p.rank)) continue;
      if (rank == 0 && p.rank == 0) {
        const LocalSlice& s = *by_key.at(e.info.key);
        dst.narrow(0, (lo - a) * elem, (hi - lo) * elem).copy_(byte_view(s.data, lo - s.decl.begin, hi - s.decl.begin));
      } else if (rank == 0) {
        at::Tensor part = dst.narrow(0, (lo - a) * elem, (hi - lo) * elem);
        checkpoint::detail::recv_tensor_bytes(comm, part, p.rank);
      } else {
        const LocalSlice& s = *by_key.at(e.info.key);
        checkpoint::detail::send_tensor_bytes(comm, byte_view(s.data, lo - s.decl.begin, hi - s.decl.begin), 0);
      }
    }
  };
  // Where rank 0 assembles the next n bytes: the staging buffer (or a scratch tensor after a failure).
  auto next_bytes = [&](int64_t n) {
    stats.file_nbytes += n;
    if (rank0_error.empty()) {
      at::Tensor t;
      rank0_error = capture_error([&] { t = stage->reserve(n); });
      if (t.defined()) return t;
    }
    return at::empty({n}, at::TensorOptions().dtype(at::kByte));  // the other ranks still send their parts
  };
  if (rank == 0) stats.rank0_peak_nbytes = 2 * piece_nbytes;
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  for (size_t ei = 0; ei < plan.size(); ++ei) {
    const PlannedEntry& e = plan[ei];
    const TpLayout& L = layouts[ei];
    const int64_t elem = dtype_element_nbytes(e.info.dtype), step = chunk_numel_for(e.info.dtype, piece_nbytes);
    if (!L.is_split() || L.split_dim == 0) {
      // The stored order is the logical order (split along dim 0: the pieces follow each other).
      for (int64_t a = 0; a < e.numel; a += step) {
        const int64_t b = std::min(e.numel, a + step);
        fetch(e, a, b, rank == 0 ? next_bytes((b - a) * elem) : at::Tensor());
      }
      continue;
    }
    // Split along a later dim: whole logical rows per chunk, each assembled from the same rows of every piece.
    const std::vector<int64_t> piece = L.piece_shape();
    const int64_t pn = L.piece_numel(), prow = piece.empty() || piece[0] == 0 ? 0 : pn / piece[0];
    const int64_t rows = L.logical_shape[0], rows_per_chunk = std::max<int64_t>(1, step / std::max<int64_t>(1, prow * L.tp_size));
    const at::ScalarType dtype = scalar_type_of(e.info.dtype);
    for (int64_t ra = 0; ra < rows && prow > 0; ra += rows_per_chunk) {
      const int64_t rb = std::min(rows, ra + rows_per_chunk);
      std::vector<at::Tensor> bufs(static_cast<size_t>(L.tp_size));
      for (int j = 0; j < L.tp_size; ++j) {
        if (rank == 0) bufs[static_cast<size_t>(j)] = at::empty({(rb - ra) * prow * elem}, bytes);
        fetch(e, j * pn + ra * prow, j * pn + rb * prow, bufs[static_cast<size_t>(j)]);
      }
      if (rank != 0) continue;
      at::Tensor out = logical_rows(L, ra, rb, dtype, [&](int j, int64_t a, int64_t b) {
        return bufs[static_cast<size_t>(j)].view(dtype).narrow(0, a - ra * prow, b - a);
      });
      const at::Tensor out_bytes = out.contiguous().view(at::kByte);
      stats.rank0_peak_nbytes = std::max(stats.rank0_peak_nbytes, 2 * piece_nbytes + 2 * out_bytes.numel());
      stats.file_nbytes += out_bytes.numel();
      if (rank0_error.empty()) rank0_error = capture_error([&] { stage->append(out_bytes); });
    }
  }
  if (rank == 0) {
    if (rank0_error.empty()) rank0_error = capture_error([&] { stage->finish(); });
    stage.reset();  // no write in flight past here
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
  wait_all_pending_updates();  // an update still running would overwrite the loaded values
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
    const ParamRange& r = t.range;
    if (f.dtype != t.dtype || f.shape != r.layout.real_shape()) {
      mismatched.push_back(t.key + ": file has " + f.dtype + " " + shape_string(f.shape) + ", model has " + t.dtype +
                           " " + r.layout.describe());
      continue;
    }
    // A TP-split piece: the logical rows its shard touches (re-cut locally below).
    const auto span = r.layout.is_split() ? logical_span(r.layout, r.tp_rank, r.piece_begin(), r.piece_end())
                                          : std::make_pair(r.begin, r.end);
    needs.push_back(SliceDecl{t.key, t.dtype, f.shape, {}, span.first, span.second});
  }
  for (const SliceDecl& f : file_index)
    if (!target_of.count(f.key)) result.unexpected_keys.push_back(f.key);
  // Pipeline stages hold different layers: a key is unexpected only when no rank wants it.
  if (config().pipe_size > 1) result.unexpected_keys = checkpoint::detail::keys_on_every_rank(comm, result.unexpected_keys);
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

  std::unordered_map<std::string, size_t> need_of;
  for (size_t i = 0; i < needs.size(); ++i) need_of[needs[i].key] = i;
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
    const ParamRange* split = nullptr;
    int64_t my_begin = 0, my_end = 0;
    if (auto nit = need_of.find(f.key); nit != need_of.end()) {
      const SliceDecl& d = needs[nit->second];
      const LoadTarget& t = targets[target_of.at(f.key)];
      dst = t.dst;
      my_begin = d.begin;
      my_end = d.end;
      if (t.range.layout.is_split()) split = &t.range;
      flat = dst.is_contiguous() && !split ? dst.view({-1})
                                           : at::empty({my_end - my_begin}, dst.options().device(at::kCPU));
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
    if (split) {
      at::Tensor v = assemble_piece_range(unsplit_layout(split->layout.logical_shape), split->layout, split->tp_rank, split->piece_begin(),
                                          split->piece_end(), dst.scalar_type(), [&](int, int64_t a, int64_t b) {
                                            return flat.narrow(0, a - my_begin, b - a);
                                          });
      dst.copy_(v.view(dst.sizes()));
    } else if (dst.defined() && !dst.is_contiguous()) {
      dst.copy_(flat.view(dst.sizes()));
    }
    if (rank == 0) reader->release(ti);
  }
  checkpoint::detail::raise_if_any_failed(comm, local_error, what);
  stats.seconds = seconds_since(t0);
  if (stats_out) *stats_out = stats;
  return result;
}

}  // namespace bmt
