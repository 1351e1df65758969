#include "bmt/checkpoint/pt_pickle_internal.h"

#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <unordered_map>

#include "bmt/checkpoint/tensor_info.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

bool PickledTensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] != 1 && strides[k] != expected) return false;
    expected *= shape[k];
  }
  return true;
}

namespace {

constexpr size_t kMaxStack = 1 << 20, kMaxMemo = 1 << 20, kMaxValues = 1 << 24;

struct Value;
using Ptr = std::shared_ptr<Value>;
struct Value {
  enum Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kStorage, kTensor, kOpaque } kind = kNone;
  int64_t i = 0;
  std::string s, s2;  // string; global module (s) and name (s2)
  std::vector<Ptr> items;
  std::vector<std::pair<Ptr, Ptr>> entries;
  PickledTensor tensor;  // kStorage: dtype, key, numel; kTensor: everything but name
};

const std::map<std::string, std::string>& storage_dtypes() {
  static const std::map<std::string, std::string> m = {
      {"FloatStorage", "F32"}, {"DoubleStorage", "F64"}, {"HalfStorage", "F16"}, {"BFloat16Storage", "BF16"},
      {"LongStorage", "I64"},  {"IntStorage", "I32"},    {"ShortStorage", "I16"}, {"CharStorage", "I8"},
      {"ByteStorage", "U8"},   {"BoolStorage", "BOOL"},  {"Float8_e4m3fnStorage", "F8_E4M3"},
      {"Float8_e5m2Storage", "F8_E5M2"}};
  return m;
}

// Every value is registered in all_, and the destructor empties every container before releasing them: memo
// references can build cycles (a list appended to itself) and deep nests, neither of which may leak or recurse.
class Machine {
 public:
  Machine(std::string_view b, const std::string& what) : b_(b), what_(what) {}
  ~Machine() {
    stack_.clear();
    memo_.clear();
    for (const Ptr& v : all_) {
      v->items.clear();
      v->entries.clear();
    }
  }
  Machine(const Machine&) = delete;
  Machine& operator=(const Machine&) = delete;

  Ptr run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;                    // PROTO
        case 0x95: bytes(8); break;                // FRAME
        case '.': return pop(at);                  // STOP
        case '(': marks_.push_back(stack_.size()); break;
        case '}': push(make(Value::kDict)); break;
        case ']': push(make(Value::kList)); break;
        case ')': push(make(Value::kTuple)); break;
        case 't': push(container(Value::kTuple, pop_mark(at))); break;
        case 'l': push(container(Value::kList, pop_mark(at))); break;
        case 0x85: case 0x86: case 0x87: {        // TUPLE1..3
          std::vector<Ptr> items(static_cast<size_t>(op - 0x84));
          for (size_t k = items.size(); k-- > 0;) items[k] = pop(at);
          push(container(Value::kTuple, std::move(items)));
          break;
        }
        case 'd': {
          auto d = make(Value::kDict);
          add_pairs(*d, pop_mark(at), at);
          push(d);
          break;
        }
        case 'X': str(le(4)); break;
        case 0x8c: str(le(1)); break;
        case 0x8d: str(le(8)); break;
        case 'T': str(le(4)); break;
        case 'U': str(le(1)); break;
        case 'B': str(le(4)); break;
        case 'C': str(le(1)); break;
        case 'J': integer(static_cast<int32_t>(static_cast<uint32_t>(le(4)))); break;
        case 'K': integer(static_cast<int64_t>(le(1))); break;
        case 'M': integer(static_cast<int64_t>(le(2))); break;
        case 0x8a: long_int(le(1), at); break;
        case 0x8b: long_int(le(4), at); break;
        case 'G': {
          uint64_t bits = 0;
          for (int k = 0; k < 8; ++k) bits = (bits << 8) | u8();
          auto v = make(Value::kFloat);
          v->i = static_cast<int64_t>(bits);
          push(v);
          break;
        }
        case 0x88: case 0x89: {
          auto v = make(Value::kBool);
          v->i = op == 0x88;
          push(v);
          break;
        }
        case 'N': push(make(Value::kNone)); break;
        case 'c': {
          auto v = make(Value::kGlobal);
          v->s = line();
          v->s2 = line();
          push(v);
          break;
        }
        case 0x93: {                                // STACK_GLOBAL
          auto name = pop(at), module = pop(at);
          if (name->kind != Value::kStr || module->kind != Value::kStr) fail(at, "STACK_GLOBAL needs two strings");
          auto v = make(Value::kGlobal);
          v->s = module->s;
          v->s2 = name->s;
          push(v);
          break;
        }
        case 'q': memo_put(le(1), at); break;
        case 'r': memo_put(le(4), at); break;
        case 0x94: memo_put(memo_.size(), at); break;
        case 'h': memo_get(le(1), at); break;
        case 'j': memo_get(le(4), at); break;
        case 'R': case 0x81: {                      // REDUCE, NEWOBJ
          auto args = pop(at), fn = pop(at);
          push(reduce(*fn, *args, at));
          break;
        }
        case 'Q': push(persistent(*pop(at), at)); break;
        case 's': {
          auto v = pop(at), k = pop(at);
          add_pairs(top_dict(at), {k, v}, at);
          break;
        }
        case 'u': {
          auto items = pop_mark(at);
          add_pairs(top_dict(at), std::move(items), at);
          break;
        }
        case 'a': {
          auto v = pop(at);
          top_list(at).items.push_back(v);
          break;
        }
        case 'e': {
          auto items = pop_mark(at);
          auto& l = top_list(at).items;
          l.insert(l.end(), items.begin(), items.end());
          break;
        }
        case 'b': pop(at); break;                   // BUILD: attributes (e.g. _metadata) are ignored
        case '0': pop(at); break;                   // POP
        case '1': pop_mark(at); break;              // POP_MARK
        case '2': push(peek(at)); break;            // DUP
        default: fail(at, "unsupported pickle opcode 0x" + hex(op));
      }
    }
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& msg) const {
    BMT_ERROR(what_, ": cannot read the pickled data at byte ", at, ": ", msg);
  }
  static std::string hex(uint8_t v) {
    const char* d = "0123456789abcdef";
    return std::string{d[v >> 4], d[v & 15]};
  }
  uint8_t u8() {
    if (pos_ >= b_.size()) fail(pos_, "unexpected end of data (truncated?)");
    return static_cast<uint8_t>(b_[pos_++]);
  }
  std::string_view bytes(uint64_t n) {
    if (n > b_.size() - pos_) fail(pos_, "a length of " + std::to_string(n) + " runs past the end");
    std::string_view v = b_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  uint64_t le(int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; ++k) v |= static_cast<uint64_t>(u8()) << (8 * k);
    return v;
  }
  std::string line() {
    const size_t nl = b_.find('\n', pos_);
    if (nl == std::string_view::npos || nl - pos_ > 256) fail(pos_, "bad GLOBAL name");
    std::string s(b_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return s;
  }
  Ptr make(Value::Kind k) {
    if (all_.size() >= kMaxValues) fail(pos_, "too many values");
    auto v = std::make_shared<Value>();
    v->kind = k;
    all_.push_back(v);
    return v;
  }
  void push(Ptr v) {
    if (stack_.size() >= kMaxStack) fail(pos_, "stack too deep");
    stack_.push_back(std::move(v));
  }
  Ptr pop(size_t at) {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail(at, "stack underflow");
    Ptr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  Ptr peek(size_t at) {
    if (stack_.empty()) fail(at, "stack underflow");
    return stack_.back();
  }
  std::vector<Ptr> pop_mark(size_t at) {
    if (marks_.empty()) fail(at, "no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Ptr> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Ptr container(Value::Kind k, std::vector<Ptr> items) {
    auto v = make(k);
    v->items = std::move(items);
    return v;
  }
  void str(uint64_t n) {
    auto v = make(Value::kStr);
    v->s = std::string(bytes(n));
    push(v);
  }
  void integer(int64_t x) {
    auto v = make(Value::kInt);
    v->i = x;
    push(v);
  }
  void long_int(uint64_t n, size_t at) {
    if (n > 8) fail(at, "integer wider than 64 bits");
    std::string_view d = bytes(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(d[k])) << (8 * k);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(d[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    integer(static_cast<int64_t>(v));
  }
  void memo_put(uint64_t idx, size_t at) {
    if (memo_.size() >= kMaxMemo && !memo_.count(idx)) fail(at, "memo too large");
    memo_[idx] = peek(at);
  }
  void memo_get(uint64_t idx, size_t at) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) fail(at, "memo key " + std::to_string(idx) + " was never stored");
    push(it->second);
  }
  Value& top_dict(size_t at) {
    Ptr t = peek(at);
    if (t->kind != Value::kDict) fail(at, "SETITEM(S) on a non-dict");
    return *t;
  }
  Value& top_list(size_t at) {
    Ptr t = peek(at);
    if (t->kind != Value::kList) fail(at, "APPEND(S) on a non-list");
    return *t;
  }
  void add_pairs(Value& d, std::vector<Ptr> items, size_t at) {
    if (items.size() % 2) fail(at, "odd number of dict items");
    for (size_t k = 0; k < items.size(); k += 2) d.entries.emplace_back(items[k], items[k + 1]);
  }
  std::vector<int64_t> ints(const Value& v, size_t at, const char* what) {
    if (v.kind != Value::kTuple && v.kind != Value::kList) fail(at, std::string(what) + " must be a tuple");
    std::vector<int64_t> out;
    for (const Ptr& x : v.items) {
      if (x->kind != Value::kInt) fail(at, std::string(what) + " must hold integers");
      out.push_back(x->i);
    }
    return out;
  }
  Ptr persistent(const Value& pid, size_t at) {
    const auto& it = pid.items;
    if (pid.kind != Value::kTuple || it.size() != 5 || it[0]->kind != Value::kStr || it[0]->s != "storage" ||
        it[1]->kind != Value::kGlobal || it[2]->kind != Value::kStr || it[4]->kind != Value::kInt)
      fail(at, "unsupported persistent id (expected ('storage', type, key, location, numel))");
    auto dt = storage_dtypes().find(it[1]->s2);
    if (it[1]->s != "torch" || dt == storage_dtypes().end()) fail(at, "unsupported storage type " + it[1]->s + "." + it[1]->s2);
    if (it[4]->i < 0) fail(at, "negative storage size");
    auto v = make(Value::kStorage);
    v->tensor.dtype = dt->second;
    v->tensor.storage_key = it[2]->s;
    v->tensor.storage_numel = it[4]->i;
    return v;
  }
  Ptr reduce(const Value& fn, const Value& args, size_t at) {
    if (fn.kind != Value::kGlobal || args.kind != Value::kTuple) {
      auto v = make(Value::kOpaque);
      v->s = "a call of a non-global";
      return v;
    }
    const std::string name = fn.s + "." + fn.s2;
    const auto& a = args.items;
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      if (a.size() < 4 || a[0]->kind != Value::kStorage || a[1]->kind != Value::kInt) fail(at, "bad " + name + " arguments");
      auto v = make(Value::kTensor);
      v->tensor = a[0]->tensor;
      v->tensor.storage_offset = a[1]->i;
      v->tensor.shape = ints(*a[2], at, "tensor size");
      v->tensor.strides = ints(*a[3], at, "tensor stride");
      check_geometry(v->tensor, at);
      return v;
    }
    if ((name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") &&
        !a.empty() && a[0]->kind == Value::kTensor)
      return a[0];
    if (name == "collections.OrderedDict" && a.empty()) return make(Value::kDict);
    auto v = make(Value::kOpaque);
    v->s = name;
    return v;
  }
  void check_geometry(const PickledTensor& t, size_t at) {
    if (t.shape.size() != t.strides.size() || t.shape.size() > 64) fail(at, "tensor size and stride differ in length");
    if (t.storage_offset < 0) fail(at, "negative storage offset");
    const int64_t numel = checked_numel(t.shape, what_);
    if (numel == 0) return;
    int64_t last = t.storage_offset;  // the largest element index touched
    for (size_t k = 0; k < t.shape.size(); ++k) {
      if (t.strides[k] < 0) fail(at, "negative strides are not supported");
      const int64_t span = t.shape[k] - 1;
      if (t.strides[k] != 0 && span > (std::numeric_limits<int64_t>::max() - last) / t.strides[k])
        fail(at, "tensor extent overflows");
      last += span * t.strides[k];
    }
    if (last >= t.storage_numel) fail(at, "tensor elements lie outside its storage of " + std::to_string(t.storage_numel));
  }

  std::string_view b_;
  const std::string& what_;
  size_t pos_ = 0;
  std::vector<Ptr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ptr> memo_;
  std::vector<Ptr> all_;
};

}  // namespace

std::vector<PickledTensor> parse_torch_pickle(std::string_view bytes, const std::string& what) {
  Machine machine(bytes, what);
  Ptr root = machine.run();
  BMT_CHECK(root->kind == Value::kDict, what, ": expected a dict of tensors at the top level of the pickle");
  std::vector<PickledTensor> out;
  for (const auto& kv : root->entries) {
    BMT_CHECK(kv.first->kind == Value::kStr, what, ": dict keys must be strings");
    BMT_CHECK(kv.second->kind == Value::kTensor, what, ": the value of \"", kv.first->s, "\" is not a tensor",
              kv.second->kind == Value::kOpaque ? " (" + kv.second->s + ")" : std::string());
    PickledTensor t = kv.second->tensor;
    t.name = kv.first->s;
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace bmt::checkpoint
