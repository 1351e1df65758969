#include "bmt/checkpoint/metadata.h"

#include <cstdio>
#include <limits>
#include <set>
#include <unordered_map>

#include "bmt/checkpoint/crc32_internal.h"
#include "bmt/checkpoint/json_internal.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {
namespace {

constexpr const char* kMagic = "BMTCKPT";

bool safe_file_name(const std::string& n) {
  return !n.empty() && n.size() <= 255 && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

uint32_t as_u32(const Json& j, const std::string& ctx) {
  int64_t v = j.as_int(ctx);
  BMT_CHECK(v >= 0 && v <= 0xFFFFFFFFll, ctx, ": ", v, " is not a 32-bit checksum");
  return static_cast<uint32_t>(v);
}

Json string_map(const std::map<std::string, std::string>& m) {
  Json o = Json::object();
  for (const auto& kv : m) o.append(kv.first, kv.second);
  return o;
}

std::map<std::string, std::string> read_string_map(const Json& j, const std::string& ctx) {
  std::map<std::string, std::string> m;
  for (const auto& kv : j.as_object(ctx)) m[kv.first] = kv.second.as_string(ctx + "." + kv.first);
  return m;
}

}  // namespace

int CheckpointMetadata::find_entry(const std::string& key) const {
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].key == key) return static_cast<int>(i);
  return -1;
}

int64_t checksum_block_count(int64_t nbytes, int64_t block_nbytes) {
  return nbytes == 0 ? 0 : (nbytes - 1) / block_nbytes + 1;
}

std::string serialize_metadata(const CheckpointMetadata& m) {
  Json root = Json::object();
  root.append("format_version", m.format_version);
  root.append("world_size", m.world_size);
  root.append("step", m.step);
  root.append("created_by", m.created_by);
  root.append("created_unix_ms", m.created_unix_ms);
  root.append("user_metadata", string_map(m.user_metadata));
  root.append("checksum", Json::object({{"algorithm", Json("crc32")}, {"block_nbytes", Json(m.checksum_block_nbytes)}}));
  Json files = Json::array();
  for (const ShardFileInfo& f : m.files) {
    Json blocks = Json::array();
    for (uint32_t c : f.block_crc32) blocks.push_back(c);
    files.push_back(Json::object({{"name", Json(f.name)}, {"nbytes", Json(f.nbytes)}, {"crc32", Json(f.crc32)},
                                  {"block_crc32", std::move(blocks)}}));
  }
  root.append("files", std::move(files));
  Json entries = Json::array();
  for (const EntryMeta& e : m.entries) {
    Json shape = Json::array(), pieces = Json::array();
    for (int64_t d : e.shape) shape.push_back(d);
    for (const Piece& p : e.pieces)
      pieces.push_back(Json::array({Json(p.file), Json(p.byte_offset), Json(p.elem_begin), Json(p.elem_end)}));
    entries.push_back(Json::object({{"key", Json(e.key)}, {"dtype", Json(e.dtype)}, {"shape", std::move(shape)},
                                    {"attrs", string_map(e.attrs)}, {"pieces", std::move(pieces)}}));
  }
  root.append("entries", std::move(entries));
  std::string json = root.dump();
  char line[96];
  std::snprintf(line, sizeof line, "%s %d %s %zu\n", kMagic, m.format_version,
                crc32_hex(crc32(json.data(), json.size())).c_str(), json.size());
  return line + json;
}

CheckpointMetadata parse_metadata(std::string_view bytes, const std::string& what) {
  // Header line.
  const size_t nl = bytes.find('\n');
  BMT_CHECK(nl != std::string_view::npos && nl < 96, what, ": not a bmtrain checkpoint metadata file (no header line)");
  const std::string line(bytes.substr(0, nl));
  char magic[16] = {};
  int version = 0;
  char crc_hex[16] = {};
  unsigned long long json_nbytes = 0;
  int consumed = 0;
  int got = std::sscanf(line.c_str(), "%15s %d %15s %llu%n", magic, &version, crc_hex, &json_nbytes, &consumed);
  BMT_CHECK(got >= 1 && std::string(magic) == kMagic, what, ": not a bmtrain checkpoint metadata file (bad magic)");
  BMT_CHECK(got >= 2, what, ": corrupted header line");
  BMT_CHECK(version == kFormatVersion, what, ": unknown checkpoint format version ", version, " (this build of bmtrain "
            "reads version ", kFormatVersion, "); use the bmtrain release that wrote it, or a newer one");
  BMT_CHECK(got == 4 && static_cast<size_t>(consumed) == line.size() && std::string(crc_hex).size() == 8, what,
            ": corrupted header line");
  const std::string_view json = bytes.substr(nl + 1);
  BMT_CHECK(json.size() == json_nbytes, what, ": truncated or corrupted: the header announces ", json_nbytes,
            " bytes of JSON, the file has ", json.size());
  BMT_CHECK(crc32_hex(crc32(json.data(), json.size())) == crc_hex, what, ": checksum mismatch (the metadata file is "
            "corrupted)");

  Json root = Json::parse(json, what);
  CheckpointMetadata m;
  m.format_version = static_cast<int>(root.at("format_version", what).as_int(what + ": format_version"));
  BMT_CHECK(m.format_version == version, what, ": format_version in the JSON differs from the header line");
  const int64_t ws = root.at("world_size", what).as_int(what + ": world_size");
  BMT_CHECK(ws >= 1 && ws <= (1 << 24), what, ": bad world_size ", ws);
  m.world_size = static_cast<int>(ws);
  m.step = root.at("step", what).as_int(what + ": step");
  BMT_CHECK(m.step >= 0, what, ": bad step ", m.step, " (a checkpoint's step is never negative: the file was edited "
            "or written by something else; re-save the checkpoint)");
  m.created_by = root.at("created_by", what).as_string(what + ": created_by");
  m.created_unix_ms = root.at("created_unix_ms", what).as_int(what + ": created_unix_ms");
  m.user_metadata = read_string_map(root.at("user_metadata", what), what + ": user_metadata");
  const Json& ck = root.at("checksum", what);
  BMT_CHECK(ck.at("algorithm", what + ": checksum").as_string(what + ": checksum.algorithm") == "crc32", what,
            ": unsupported checksum algorithm");
  m.checksum_block_nbytes = ck.at("block_nbytes", what + ": checksum").as_int(what + ": checksum.block_nbytes");
  BMT_CHECK(m.checksum_block_nbytes > 0, what, ": checksum.block_nbytes must be positive");

  std::set<std::string> names;
  for (const Json& f : root.at("files", what).as_array(what + ": files")) {
    const std::string ctx = what + ": files[" + std::to_string(m.files.size()) + "]";
    ShardFileInfo fi;
    fi.name = f.at("name", ctx).as_string(ctx + ".name");
    BMT_CHECK(safe_file_name(fi.name), ctx, ": unsafe file name \"", fi.name, "\"");
    BMT_CHECK(fi.name != kMetadataFileName && names.insert(fi.name).second, ctx, ": duplicate file name ", fi.name);
    fi.nbytes = f.at("nbytes", ctx).as_int(ctx + ".nbytes");
    BMT_CHECK(fi.nbytes >= 0, ctx, ": negative nbytes");
    fi.crc32 = as_u32(f.at("crc32", ctx), ctx + ".crc32");
    const auto& blocks = f.at("block_crc32", ctx).as_array(ctx + ".block_crc32");
    BMT_CHECK(static_cast<int64_t>(blocks.size()) == checksum_block_count(fi.nbytes, m.checksum_block_nbytes), ctx,
              ": has ", blocks.size(), " block checksums, expected ", checksum_block_count(fi.nbytes, m.checksum_block_nbytes));
    for (const Json& b : blocks) fi.block_crc32.push_back(as_u32(b, ctx + ".block_crc32"));
    m.files.push_back(std::move(fi));
  }

  std::unordered_map<std::string, int> keys;
  for (const Json& e : root.at("entries", what).as_array(what + ": entries")) {
    const std::string ctx = what + ": entries[" + std::to_string(m.entries.size()) + "]";
    EntryMeta em;
    em.key = e.at("key", ctx).as_string(ctx + ".key");
    BMT_CHECK(keys.emplace(em.key, static_cast<int>(m.entries.size())).second, ctx, ": duplicate key \"", em.key, "\"");
    const std::string ectx = what + ": entry \"" + em.key + "\"";
    em.dtype = e.at("dtype", ctx).as_string(ctx + ".dtype");
    for (const Json& d : e.at("shape", ctx).as_array(ctx + ".shape")) em.shape.push_back(d.as_int(ectx + ".shape"));
    BMT_CHECK(em.shape.size() <= 64, ectx, ": too many dimensions");
    checked_nbytes(em.dtype, em.shape, ectx);
    const int64_t numel = checked_numel(em.shape, ectx);
    const int64_t elem = dtype_element_nbytes(em.dtype);
    em.attrs = read_string_map(e.at("attrs", ctx), ectx + ".attrs");
    int64_t prev_end = 0;
    for (const Json& pj : e.at("pieces", ctx).as_array(ctx + ".pieces")) {
      const auto& a = pj.as_array(ectx + ".pieces[]");
      BMT_CHECK(a.size() == 4, ectx, ": a piece must be [file, byte offset, begin, end]");
      Piece p;
      const int64_t file = a[0].as_int(ectx + ".pieces[].file");
      BMT_CHECK(file >= 0 && file < static_cast<int64_t>(m.files.size()), ectx, ": piece names file index ", file,
                " but there are ", m.files.size(), " files");
      p.file = static_cast<int>(file);
      p.byte_offset = a[1].as_int(ectx + ".pieces[].byte_offset");
      p.elem_begin = a[2].as_int(ectx + ".pieces[].begin");
      p.elem_end = a[3].as_int(ectx + ".pieces[].end");
      BMT_CHECK(prev_end <= p.elem_begin && p.elem_begin < p.elem_end && p.elem_end <= numel, ectx, ": piece [",
                p.elem_begin, ", ", p.elem_end, ") is empty, overlaps the previous one, is out of order or lies outside "
                "the ", numel, " elements");
      prev_end = p.elem_end;
      const int64_t nbytes = (p.elem_end - p.elem_begin) * elem;  // <= numel * elem, checked above
      const int64_t fsize = m.files[p.file].nbytes;
      BMT_CHECK(p.byte_offset >= 0 && p.byte_offset <= fsize && nbytes <= fsize - p.byte_offset, ectx, ": piece at "
                "byte ", p.byte_offset, " (", nbytes, " bytes) lies outside ", m.files[p.file].name, " (", fsize, " bytes)");
      em.pieces.push_back(p);
    }
    m.entries.push_back(std::move(em));
  }
  return m;
}

}  // namespace bmt::checkpoint
