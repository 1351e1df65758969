#include "export/safetensors.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bmt/core/error.h"

namespace examples {

const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: BMT_ERROR("safetensors: unsupported dtype ", c10::toString(t));
  }
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string safetensors_header(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) h += (first ? "" : ",") + json_quote(k) + ":" + json_quote(v), first = false;
    h += "}";
  }
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    h += std::string(h.size() > 1 ? "," : "") + json_quote(name) + ":{\"dtype\":\"" + safetensors_dtype(t.scalar_type()) +
         "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) h += (d ? "," : "") + std::to_string(t.size(d));
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + nbytes) + "]}";
    offset += nbytes;
  }
  return h + "}";
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  for (size_t i = 0; i < tensors.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      BMT_CHECK(tensors[i].first != tensors[j].first, "safetensors: duplicate tensor name '", tensors[i].first, "'");
  std::string header = safetensors_header(tensors, metadata);
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t n = header.size();
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(n >> (8 * i));  // little-endian
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    BMT_CHECK(f.good(), "safetensors: cannot write '", tmp, "'");
    f.write(reinterpret_cast<const char*>(prefix), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& item : tensors) {
      at::Tensor t = item.second.detach().cpu().contiguous();  // little-endian host (x86-64, aarch64)
      f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * t.element_size()));
    }
    f.flush();
    BMT_CHECK(f.good(), "safetensors: writing '", tmp, "' failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace examples
