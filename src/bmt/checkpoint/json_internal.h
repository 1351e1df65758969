// A small JSON value with a strict, bounded parser and a writer (torch-free), for the safetensors header and the
// sharded checkpoint's metadata file.
//
// Parser invariants (it reads untrusted files, and is fuzzed):
//  * never reads outside [text, text + size); nesting deeper than kMaxDepth, duplicate object keys, trailing
//    garbage, invalid escapes / UTF-16 surrogates, control characters in strings and numbers without digits are
//    errors (bmt::core::Error naming `what` and the byte offset), never crashes;
//  * integers without fraction/exponent that fit int64 are kept exact (kInt); other numbers are kDouble.
// Objects keep their insertion order (dump() writes them in that order).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bmt::checkpoint {

class Json {
 public:
  enum class Type { kNull, kBool, kInt, kDouble, kString, kArray, kObject };
  static constexpr int kMaxDepth = 64;
  using Object = std::vector<std::pair<std::string, Json>>;
  using Array = std::vector<Json>;

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool b) : type_(Type::kBool), int_(b ? 1 : 0) {}
  Json(int v) : type_(Type::kInt), int_(v) {}
  Json(int64_t v) : type_(Type::kInt), int_(v) {}
  Json(uint32_t v) : type_(Type::kInt), int_(v) {}
  Json(double v) : type_(Type::kDouble), double_(v) {}
  Json(const char* s) : type_(Type::kString), str_(s) {}
  Json(std::string s) : type_(Type::kString), str_(std::move(s)) {}
  static Json array(Array items = {});
  static Json object(Object items = {});

  // Throws bmt::core::Error("<what>: invalid JSON at byte N: ...").
  static Json parse(std::string_view text, const std::string& what);
  // Compact (no spaces) UTF-8 output; doubles with 17 significant digits.
  std::string dump() const;

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_int() const { return type_ == Type::kInt; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  // Typed accessors; `ctx` names the value in the error message ("metadata: files[2].nbytes").
  int64_t as_int(const std::string& ctx) const;
  double as_double(const std::string& ctx) const;  // ints convert
  bool as_bool(const std::string& ctx) const;
  const std::string& as_string(const std::string& ctx) const;
  const Array& as_array(const std::string& ctx) const;
  const Object& as_object(const std::string& ctx) const;

  // Object access: find returns nullptr when absent; at throws naming ctx and key.
  const Json* find(const std::string& key) const;
  const Json& at(const std::string& key, const std::string& ctx) const;

  // Building.
  Json& push_back(Json v);                           // arrays
  Json& set(const std::string& key, Json v);         // objects (replaces an existing key)
  Json& append(const std::string& key, Json v);      // objects, O(1): the caller guarantees the key is new

 private:
  Type type_ = Type::kNull;
  int64_t int_ = 0;
  double double_ = 0;
  std::string str_;
  Array arr_;
  Object obj_;
  friend class JsonParser;
};

}  // namespace bmt::checkpoint
