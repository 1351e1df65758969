#include "bmt/checkpoint/export.h"

#include <map>
#include <sstream>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/tp_layout.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

ExportStats export_consolidated(const std::string& checkpoint_dir, const std::string& out_path,
                                const std::string& prefix, int64_t chunk_nbytes) {
  BMT_CHECK(chunk_nbytes > 0, "export: chunk_nbytes must be positive");
  CheckpointReader reader(checkpoint_dir);
  std::vector<const EntryMeta*> chosen;
  std::vector<TensorInfo> infos;
  std::vector<TpLayout> layouts;
  for (const EntryMeta& e : reader.metadata().entries) {
    if (e.key.rfind(prefix, 0) != 0) continue;
    chosen.push_back(&e);
    layouts.push_back(entry_tp_layout(e.key, e.shape, e.attrs));
    infos.push_back(TensorInfo{e.key.substr(prefix.size()), e.dtype, layouts.back().real_shape()});
  }
  BMT_CHECK(!chosen.empty(), "export: checkpoint ", reader.path(), " has no entries under \"", prefix, "\"");
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", std::to_string(reader.metadata().step)}};
  std::unique_ptr<TensorFileWriter> writer = create_tensor_file(out_path, infos, meta);
  ExportStats stats;
  std::vector<char> buf;
  for (size_t ci = 0; ci < chosen.size(); ++ci) {
    const EntryMeta* e = chosen[ci];
    const TpLayout& L = layouts[ci];
    const int64_t elem = dtype_element_nbytes(e->dtype), numel = checked_numel(e->shape, e->key);
    const int64_t step = std::max<int64_t>(1, chunk_nbytes / elem);
    if (L.is_split() && L.split_dim > 0) {
      // Whole logical rows per chunk, each from the same rows of every tp piece.
      const std::vector<int64_t> piece = L.piece_shape();
      const int64_t pn = L.piece_numel(), prow = piece[0] == 0 ? 0 : pn / piece[0];
      const int64_t rows = L.logical_shape[0], per = std::max<int64_t>(1, step / std::max<int64_t>(1, prow * L.tp_size));
      const at::ScalarType dtype = scalar_type_of(e->dtype);
      for (int64_t ra = 0; ra < rows && prow > 0; ra += per) {
        const int64_t rb = std::min(rows, ra + per);
        at::Tensor out = logical_rows(L, ra, rb, dtype, [&](int j, int64_t a, int64_t b) {
          return reader.read(*e, j * pn + a, j * pn + b);
        }).contiguous();
        const int64_t n = out.numel() * elem;
        writer->append(out.data_ptr(), n);
        stats.nbytes += n;
        stats.peak_buffer_nbytes = std::max(stats.peak_buffer_nbytes, 2 * n);
      }
      ++stats.num_tensors;
      continue;
    }
    for (int64_t a = 0; a < numel; a += step) {
      const int64_t b = std::min(numel, a + step);
      buf.resize(static_cast<size_t>((b - a) * elem));
      reader.read_into(*e, a, b, buf.data());
      writer->append(buf.data(), static_cast<int64_t>(buf.size()));
      stats.nbytes += static_cast<int64_t>(buf.size());
      stats.peak_buffer_nbytes = std::max(stats.peak_buffer_nbytes, static_cast<int64_t>(buf.size()));
    }
    ++stats.num_tensors;
  }
  writer->commit();
  stats.peak_buffer_nbytes += writer->max_buffered_nbytes();
  return stats;
}

std::string describe_checkpoint(const std::string& checkpoint_dir, bool entries) {
  CheckpointReader reader(checkpoint_dir);
  const CheckpointMetadata& m = reader.metadata();
  std::ostringstream os;
  os << "checkpoint      " << reader.path() << "\n"
     << "format version  " << m.format_version << "\n"
     << "created by      " << m.created_by << " (unix ms " << m.created_unix_ms << ")\n"
     << "world size      " << m.world_size << "\n"
     << "step            " << m.step << "\n";
  for (const auto& kv : m.user_metadata) os << "user metadata   " << kv.first << " = " << kv.second << "\n";
  int64_t total = 0;
  for (const auto& f : m.files) total += f.nbytes;
  os << "files           " << m.files.size() << " shard files, " << total << " bytes, checksum crc32 per "
     << m.checksum_block_nbytes << "-byte block\n";
  for (const auto& f : m.files)
    os << "  " << f.name << "  " << f.nbytes << " bytes  crc32 " << crc32_hex(f.crc32) << "\n";
  std::map<std::string, std::pair<int64_t, int64_t>> by_group;  // first key component -> (entries, bytes)
  for (const auto& e : m.entries) {
    const std::string group = e.key.substr(0, e.key.find('/'));
    by_group[group].first += 1;
    by_group[group].second += checked_nbytes(e.dtype, e.shape, e.key);
  }
  os << "entries         " << m.entries.size() << "\n";
  for (const auto& g : by_group)
    os << "  " << g.first << ": " << g.second.first << " tensors, " << g.second.second << " bytes\n";
  if (entries) {
    for (const auto& e : m.entries) {
      os << "  " << e.key << "  " << e.dtype << " " << shape_string(e.shape);
      if (e.attrs.count("tp_split_dim")) {
        try {
          os << "  tp pieces of " << entry_tp_layout(e.key, e.shape, e.attrs).describe();
        } catch (const std::exception& ex) {
          os << "  (bad tp attributes: " << ex.what() << ")";
        }
      }
      os << "  pieces:";
      for (const auto& p : e.pieces)
        os << " [" << p.elem_begin << "," << p.elem_end << ")@" << m.files[static_cast<size_t>(p.file)].name << "+"
           << p.byte_offset;
      os << "\n";
    }
  }
  return os.str();
}

}  // namespace bmt::checkpoint
