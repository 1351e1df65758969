// Our JSON value type (typed accessors whose errors name the field) over nlohmann-json, which does the
// reading and writing. The value tree stays ours because callers read it through accessors that say which file
// field is wrong; nlohmann's SAX parser builds it directly (no intermediate DOM), and we add what the readers of
// untrusted files need on top of it: a nesting limit, duplicate-key rejection and int64-exact integers.
// Kept ours for speed: only that value type (converting a whole nlohmann DOM into it would copy every header twice,
// and a safetensors header of a large model holds tens of thousands of entries). The text format is unchanged:
// compact, insertion-ordered objects, so files written before load as they did.
#include "bmt/checkpoint/json_internal.h"

#include <cmath>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

namespace {
// nlohmann's parse error text → the phrase our readers' messages (and tests) use, nlohmann's detail kept after it.
std::string describe_parse_error(const std::string& what_text) {
  std::string detail = what_text;
  if (auto p = detail.find("] "); p != std::string::npos && detail.rfind("[json.exception", 0) == 0)
    detail = detail.substr(p + 2);
  if (auto p = detail.find(": "); p != std::string::npos && detail.rfind("parse error", 0) == 0)
    detail = detail.substr(p + 2);
  auto has = [&](const char* s) { return detail.find(s) != std::string::npos; };
  const char* phrase = nullptr;
  if (has("; expected end of input")) phrase = "unexpected trailing characters";
  // 3.11.2 says "unexpected end of input" for an empty document, 3.11.3 "attempting to parse an empty input".
  else if (has("unexpected end of input") || has("empty input")) phrase = "unexpected end of input";
  else if (has("missing closing quote")) phrase = "unterminated string";
  else if (has("surrogate")) phrase = "unpaired UTF-16 surrogate";
  else if (has("after backslash") || has("'\\u' must be followed")) phrase = "invalid escape";
  else if (has("control character")) phrase = "control character in string";
  else if (has("invalid number") || has("expected digit")) phrase = "number without digits";
  else if (has("syntax error")) phrase = "unexpected character";
  return phrase ? std::string(phrase) + " (" + detail + ")" : detail;
}
}  // namespace

// SAX consumer for nlohmann::json::sax_parse that builds our tree (friend of Json).
class JsonParser {
 public:
  using NJ = nlohmann::json;
  explicit JsonParser(const std::string& what) : what_(what) {}
  Json take() { return std::move(root_); }

  bool null() { return put(Json()); }
  bool boolean(bool v) { return put(Json(v)); }
  bool number_integer(NJ::number_integer_t v) { return put(Json(static_cast<int64_t>(v))); }
  bool number_unsigned(NJ::number_unsigned_t v) {
    // Past int64: a double (as the old reader did), so as_int() reports it instead of wrapping.
    if (v > static_cast<uint64_t>(INT64_MAX)) return put(Json(static_cast<double>(v)));
    return put(Json(static_cast<int64_t>(v)));
  }
  bool number_float(NJ::number_float_t v, const NJ::string_t&) { return put(Json(static_cast<double>(v))); }
  bool string(NJ::string_t& v) { return put(Json(std::move(v))); }
  bool binary(NJ::binary_t&) { BMT_ERROR(what_, ": invalid JSON: binary value"); }
  bool start_object(std::size_t) { return open(Json::object()); }
  bool key(NJ::string_t& k) {
    if (!keys_.back().insert(k).second) BMT_ERROR(what_, ": invalid JSON: duplicate key \"", k, "\"");
    key_ = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t byte, const std::string&, const nlohmann::detail::exception& e) {
    BMT_ERROR(what_, ": invalid JSON at byte ", byte == 0 ? 0 : byte - 1, ": ", describe_parse_error(e.what()));
  }

 private:
  // Stores v where the document is at: the root, the open array's end, or the open object's pending key.
  Json* place(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& top = *stack_.back();
    if (top.type_ == Json::Type::kArray) {
      top.arr_.push_back(std::move(v));
      return &top.arr_.back();
    }
    top.obj_.emplace_back(std::move(key_), std::move(v));
    return &top.obj_.back().second;
  }
  bool put(Json v) {
    place(std::move(v));
    return true;
  }
  bool open(Json container) {
    if (stack_.size() >= static_cast<size_t>(Json::kMaxDepth))
      BMT_ERROR(what_, ": invalid JSON: nesting deeper than ", Json::kMaxDepth);
    stack_.push_back(place(std::move(container)));  // ancestors stay put: only the open container grows
    keys_.emplace_back();
    return true;
  }
  bool close() {
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }

  const std::string& what_;
  Json root_;
  std::vector<Json*> stack_;
  std::vector<std::unordered_set<std::string>> keys_;
  std::string key_;
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

Json Json::parse(std::string_view text, const std::string& what) {
  JsonParser sax(what);
  nlohmann::json::sax_parse(text.begin(), text.end(), &sax, nlohmann::json::input_format_t::json, /*strict=*/true,
                            /*ignore_comments=*/false);
  return sax.take();
}

namespace {
nlohmann::ordered_json to_nlohmann(const Json& v) {
  switch (v.type()) {
    case Json::Type::kNull: return nullptr;
    case Json::Type::kBool: return v.as_bool("");
    case Json::Type::kInt: return v.as_int("");
    case Json::Type::kDouble: {
      const double d = v.as_double("");
      if (!std::isfinite(d)) return nullptr;  // JSON has no inf/nan
      return d;
    }
    case Json::Type::kString: return v.as_string("");
    case Json::Type::kArray: {
      nlohmann::ordered_json a = nlohmann::ordered_json::array();
      for (const Json& item : v.as_array("")) a.push_back(to_nlohmann(item));
      return a;
    }
    case Json::Type::kObject: {
      nlohmann::ordered_json o = nlohmann::ordered_json::object();
      // ordered_json's operator[] would search the keys; ours are unique already.
      for (const auto& kv : v.as_object("")) o.get_ref<nlohmann::ordered_json::object_t&>().emplace_back(kv.first, to_nlohmann(kv.second));
      return o;
    }
  }
  return nullptr;
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
  try {
    // Compact, insertion order, non-ASCII as UTF-8; strings that are not UTF-8 are an error (no file we
    // write has them: names come from module paths).
    return to_nlohmann(*this).dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& e) {
    BMT_ERROR("JSON dump: ", e.what(), " (a key or string value is not valid UTF-8; rename it)");
  }
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
