#include "bmt/checkpoint/json_internal.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Json parse_document() {
    skip_ws();
    Json v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    BMT_ERROR(what_, ": invalid JSON at byte ", pos_, ": ", msg);
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  void skip_ws() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c || at_end()) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  void expect_word(const char* w) {
    for (const char* p = w; *p; ++p) {
      if (at_end() || s_[pos_] != *p) fail(std::string("expected '") + w + "'");
      ++pos_;
    }
  }

  Json parse_value(int depth) {
    if (depth > Json::kMaxDepth) fail("nesting deeper than " + std::to_string(Json::kMaxDepth));
    if (at_end()) fail("unexpected end of input");
    char c = s_[pos_];
    switch (c) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return Json(parse_string());
      case 't': expect_word("true"); return Json(true);
      case 'f': expect_word("false"); return Json(false);
      case 'n': expect_word("null"); return Json();
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        fail(std::string("unexpected character '") + (c >= 0x20 && c < 0x7f ? std::string(1, c) : "?") + "'");
    }
  }

  Json parse_object(int depth) {
    expect('{');
    Json obj = Json::object();
    std::set<std::string> seen;
    skip_ws();
    if (peek() == '}' && !at_end()) {
      ++pos_;
      return obj;
    }
    while (true) {
      skip_ws();
      if (peek() != '"' || at_end()) fail("expected a string key");
      std::string key = parse_string();
      if (!seen.insert(key).second) fail("duplicate key \"" + key + "\"");
      skip_ws();
      expect(':');
      skip_ws();
      obj.obj_.emplace_back(std::move(key), parse_value(depth + 1));
      skip_ws();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect('}');
      return obj;
    }
  }

  Json parse_array(int depth) {
    expect('[');
    Json arr = Json::array();
    skip_ws();
    if (peek() == ']' && !at_end()) {
      ++pos_;
      return arr;
    }
    while (true) {
      skip_ws();
      arr.arr_.push_back(parse_value(depth + 1));
      skip_ws();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect(']');
      return arr;
    }
  }

  uint32_t parse_hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') fail("unpaired UTF-16 surrogate");
            pos_ += 2;
            uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("invalid UTF-16 low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("invalid escape");
      }
    }
  }

  Json parse_number() {
    const size_t start = pos_;
    bool is_int = true;
    if (peek() == '-') ++pos_;
    size_t digits = 0;
    while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, ++digits;
    if (digits == 0) fail("number without digits");
    if (!at_end() && s_[pos_] == '.') {
      is_int = false;
      ++pos_;
      size_t frac = 0;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, ++frac;
      if (frac == 0) fail("number without fraction digits");
    }
    if (!at_end() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      is_int = false;
      ++pos_;
      if (!at_end() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      size_t exp = 0;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, ++exp;
      if (exp == 0) fail("number without exponent digits");
    }
    std::string tok(s_.substr(start, pos_ - start));
    if (is_int) {
      bool neg = tok[0] == '-';
      uint64_t v = 0;
      bool overflow = false;
      for (size_t i = neg ? 1 : 0; i < tok.size(); ++i) {
        uint64_t d = static_cast<uint64_t>(tok[i] - '0');
        if (v > (UINT64_MAX - d) / 10) overflow = true;
        v = v * 10 + d;
      }
      const uint64_t limit = neg ? (uint64_t{1} << 63) : static_cast<uint64_t>(INT64_MAX);
      if (!overflow && v <= limit) return Json(neg ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v));
    }
    return Json(std::strtod(tok.c_str(), nullptr));
  }

  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;
};

Json Json::array(Array items) {
  Json j;
  j.type_ = Type::kArray;
  j.arr_ = std::move(items);
  return j;
}
Json Json::object(Object items) {
  Json j;
  j.type_ = Type::kObject;
  j.obj_ = std::move(items);
  return j;
}

Json Json::parse(std::string_view text, const std::string& what) { return JsonParser(text, what).parse_document(); }

namespace {
void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void dump_value(std::string& out, const Json& v) {
  switch (v.type()) {
    case Json::Type::kNull: out += "null"; break;
    case Json::Type::kBool: out += v.as_bool("") ? "true" : "false"; break;
    case Json::Type::kInt: out += std::to_string(v.as_int("")); break;
    case Json::Type::kDouble: {
      double d = v.as_double("");
      if (!std::isfinite(d)) {
        out += "null";  // JSON has no inf/nan
        break;
      }
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.17g", d);
      out += buf;
      if (std::string(buf).find_first_of(".eEn") == std::string::npos) out += ".0";  // stays a real number
      break;
    }
    case Json::Type::kString: dump_string(out, v.as_string("")); break;
    case Json::Type::kArray: {
      out += '[';
      bool first = true;
      for (const Json& item : v.as_array("")) {
        if (!first) out += ',';
        first = false;
        dump_value(out, item);
      }
      out += ']';
      break;
    }
    case Json::Type::kObject: {
      out += '{';
      bool first = true;
      for (const auto& kv : v.as_object("")) {
        if (!first) out += ',';
        first = false;
        dump_string(out, kv.first);
        out += ':';
        dump_value(out, kv.second);
      }
      out += '}';
      break;
    }
  }
}

const char* type_name(Json::Type t) {
  switch (t) {
    case Json::Type::kNull: return "null";
    case Json::Type::kBool: return "a boolean";
    case Json::Type::kInt: return "an integer";
    case Json::Type::kDouble: return "a real number";
    case Json::Type::kString: return "a string";
    case Json::Type::kArray: return "an array";
    case Json::Type::kObject: return "an object";
  }
  return "?";
}
}  // namespace

std::string Json::dump() const {
  std::string out;
  dump_value(out, *this);
  return out;
}

#define BMT_JSON_EXPECT(cond, ctx, want) \
  BMT_CHECK(cond, ctx, ": expected ", want, ", found ", type_name(type_))

int64_t Json::as_int(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kInt, ctx, "an integer");
  return int_;
}
double Json::as_double(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kInt || type_ == Type::kDouble, ctx, "a number");
  return type_ == Type::kInt ? static_cast<double>(int_) : double_;
}
bool Json::as_bool(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kBool, ctx, "a boolean");
  return int_ != 0;
}
const std::string& Json::as_string(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kString, ctx, "a string");
  return str_;
}
const Json::Array& Json::as_array(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kArray, ctx, "an array");
  return arr_;
}
const Json::Object& Json::as_object(const std::string& ctx) const {
  BMT_JSON_EXPECT(type_ == Type::kObject, ctx, "an object");
  return obj_;
}

const Json* Json::find(const std::string& key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& kv : obj_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

const Json& Json::at(const std::string& key, const std::string& ctx) const {
  as_object(ctx);
  const Json* v = find(key);
  BMT_CHECK(v != nullptr, ctx, ": missing field \"", key, "\"");
  return *v;
}

Json& Json::push_back(Json v) {
  BMT_ASSERT(type_ == Type::kArray, "push_back on a JSON ", type_name(type_));
  arr_.push_back(std::move(v));
  return arr_.back();
}

Json& Json::set(const std::string& key, Json v) {
  BMT_ASSERT(type_ == Type::kObject, "set on a JSON ", type_name(type_));
  for (auto& kv : obj_)
    if (kv.first == key) return kv.second = std::move(v);
  obj_.emplace_back(key, std::move(v));
  return obj_.back().second;
}

Json& Json::append(const std::string& key, Json v) {
  BMT_ASSERT(type_ == Type::kObject, "append on a JSON ", type_name(type_));
  obj_.emplace_back(key, std::move(v));
  return obj_.back().second;
}

}  // namespace bmt::checkpoint
