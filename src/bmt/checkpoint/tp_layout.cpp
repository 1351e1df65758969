#include "bmt/checkpoint/tp_layout.h"

#include <algorithm>
#include <sstream>

#include "bmt/checkpoint/tensor_info.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

std::vector<int64_t> TpLayout::piece_shape() const {
  std::vector<int64_t> s = logical_shape;
  if (is_split()) s[static_cast<size_t>(split_dim)] /= tp_size;
  return s;
}

int64_t TpLayout::piece_numel() const {
  int64_t n = 1;
  for (int64_t d : piece_shape()) n *= d;
  return n;
}

std::vector<int64_t> TpLayout::stored_shape() const {
  if (!is_split()) return logical_shape;
  std::vector<int64_t> s = piece_shape();
  s.insert(s.begin(), tp_size);
  return s;
}

std::vector<int64_t> TpLayout::real_shape() const {
  if (split_groups <= 1) return logical_shape;
  std::vector<int64_t> s = logical_shape;
  const size_t g = static_cast<size_t>(split_dim - 1);
  s[g] *= s[g + 1];
  s.erase(s.begin() + static_cast<int64_t>(g) + 1);
  return s;
}

bool TpLayout::operator==(const TpLayout& o) const {
  if (logical_shape != o.logical_shape || is_split() != o.is_split() || split_groups != o.split_groups) return false;
  return !is_split() || (split_dim == o.split_dim && tp_size == o.tp_size);
}

std::string TpLayout::describe() const {
  std::string s = shape_string(real_shape());
  if (is_split() && split_groups > 1)
    s += " (split along dim " + std::to_string(split_dim - 1) + " in " + std::to_string(split_groups) +
         " blocks over tp " + std::to_string(tp_size) + ")";
  else if (is_split())
    s += " (split along dim " + std::to_string(split_dim) + " over tp " + std::to_string(tp_size) + ")";
  return s;
}

TpLayout unsplit_layout(std::vector<int64_t> logical_shape) {
  TpLayout l;
  l.logical_shape = std::move(logical_shape);
  return l;
}

TpLayout split_layout(const std::vector<int64_t>& real_shape, int split_dim, int tp_size, int groups) {
  TpLayout l;
  l.logical_shape = real_shape;
  l.split_dim = split_dim;
  l.tp_size = tp_size;
  if (groups > 1) {
    const size_t d = static_cast<size_t>(split_dim);
    BMT_ASSERT(d < real_shape.size() && real_shape[d] % groups == 0, "grouped split of ", shape_string(real_shape));
    l.logical_shape[d] = groups;
    l.logical_shape.insert(l.logical_shape.begin() + static_cast<int64_t>(d) + 1, real_shape[d] / groups);
    l.split_dim = split_dim + 1;
    l.split_groups = groups;
  }
  return l;
}

bool align_unsplit(TpLayout& a, const TpLayout& b) {
  if (a.real_shape() != b.real_shape()) return false;
  if (!a.is_split() && a.split_groups <= 1) a.logical_shape = b.logical_shape;
  return true;
}

namespace {

std::string join_shape(const std::vector<int64_t>& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out;
}

int64_t parse_int(const std::string& key, const std::string& what, const std::string& v) {
  BMT_CHECK(!v.empty() && v.size() <= 18 && v.find_first_not_of("0123456789") == std::string::npos,
            "checkpoint entry ", key, ": attribute ", what, " = \"", v, "\" is not a non-negative integer");
  return std::stoll(v);
}

}  // namespace

void add_tp_attrs(const TpLayout& layout, std::map<std::string, std::string>& attrs) {
  if (!layout.is_split()) return;
  attrs["tp_split_dim"] = std::to_string(layout.split_dim);
  attrs["tp_size"] = std::to_string(layout.tp_size);
  attrs["logical_shape"] = join_shape(layout.logical_shape);
  if (layout.split_groups > 1) attrs["tp_split_groups"] = std::to_string(layout.split_groups);
}

TpLayout entry_tp_layout(const std::string& key, const std::vector<int64_t>& stored_shape,
                         const std::map<std::string, std::string>& attrs) {
  auto dim_it = attrs.find("tp_split_dim");
  if (dim_it == attrs.end()) return unsplit_layout(stored_shape);
  auto get = [&](const char* name) -> const std::string& {
    auto it = attrs.find(name);
    BMT_CHECK(it != attrs.end(), "checkpoint entry ", key, ": has tp_split_dim but no ", name, " attribute");
    return it->second;
  };
  TpLayout l;
  l.split_dim = static_cast<int>(std::min<int64_t>(parse_int(key, "tp_split_dim", dim_it->second), 1 << 20));
  l.tp_size = static_cast<int>(std::min<int64_t>(parse_int(key, "tp_size", get("tp_size")), 1 << 30));
  const std::string& ls = get("logical_shape");
  if (!ls.empty()) {
    size_t pos = 0;
    while (true) {
      const size_t comma = ls.find(',', pos);
      l.logical_shape.push_back(parse_int(key, "logical_shape", ls.substr(pos, comma - pos)));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  BMT_CHECK(l.tp_size >= 1 && l.split_dim < static_cast<int>(l.logical_shape.size()), "checkpoint entry ", key,
            ": tp_split_dim ", l.split_dim, " / tp_size ", l.tp_size, " do not fit logical shape ",
            shape_string(l.logical_shape));
  checked_numel(l.logical_shape, "logical shape of " + key);
  BMT_CHECK(l.logical_shape[static_cast<size_t>(l.split_dim)] % l.tp_size == 0, "checkpoint entry ", key,
            ": tp_size ", l.tp_size, " does not divide dimension ", l.split_dim, " of logical shape ",
            shape_string(l.logical_shape));
  if (auto g = attrs.find("tp_split_groups"); g != attrs.end()) {
    l.split_groups = static_cast<int>(std::min<int64_t>(parse_int(key, "tp_split_groups", g->second), 1 << 20));
    BMT_CHECK(l.split_groups >= 1 && l.split_dim >= 1 &&
                  l.logical_shape[static_cast<size_t>(l.split_dim - 1)] == l.split_groups,
              "checkpoint entry ", key, ": tp_split_groups ", l.split_groups, " does not match logical shape ",
              shape_string(l.logical_shape), " split along dim ", l.split_dim);
  }
  BMT_CHECK(l.stored_shape() == stored_shape, "checkpoint entry ", key, ": stored shape ", shape_string(stored_shape),
            " is not the stacked tp pieces ", shape_string(l.stored_shape()), " of ", l.describe());
  return l;
}

namespace {

struct Range {
  int64_t lo = 0, hi = 0;
};

// The box of piece `r` of `l` in logical coordinates.
std::vector<Range> piece_box(const TpLayout& l, int r) {
  std::vector<Range> box;
  for (int64_t s : l.logical_shape) box.push_back({0, s});
  if (l.is_split()) {
    const int64_t n = l.logical_shape[static_cast<size_t>(l.split_dim)] / l.tp_size;
    box[static_cast<size_t>(l.split_dim)] = {n * r, n * (r + 1)};
  }
  return box;
}

int64_t row_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// The target region: the rows of piece tp_rank touched by [begin, end), in logical coordinates; `offset` is
// `begin` relative to the region's first element.
std::vector<Range> target_region(const TpLayout& target, int tp_rank, int64_t begin, int64_t end, int64_t& offset) {
  std::vector<Range> box = piece_box(target, target.is_split() ? tp_rank : 0);
  const std::vector<int64_t> piece = target.piece_shape();
  BMT_ASSERT(!piece.empty(), "tp re-cut of a 0-dim tensor");
  const int64_t rn = row_numel(piece);
  BMT_ASSERT(rn > 0 && 0 <= begin && begin < end && end <= target.piece_numel(), "tp re-cut: range [", begin, ", ",
             end, ") of a piece of ", target.piece_numel(), " elements");
  const int64_t rlo = begin / rn, rhi = (end + rn - 1) / rn;
  box[0] = {box[0].lo + rlo, box[0].lo + rhi};
  offset = begin - rlo * rn;
  return box;
}

}  // namespace

at::Tensor assemble_piece_range(const TpLayout& source, const TpLayout& target, int tp_rank, int64_t begin,
                                int64_t end, at::ScalarType dtype, const PieceReader& read_source) {
  BMT_ASSERT(source.logical_shape == target.logical_shape, "tp re-cut between different logical shapes");
  const auto cpu = at::TensorOptions().dtype(dtype);
  if (begin >= end) return at::empty({0}, cpu);
  int64_t offset = 0;
  const std::vector<Range> T = target_region(target, tp_rank, begin, end, offset);
  const size_t nd = T.size();
  std::vector<int64_t> region_shape;
  for (const Range& r : T) region_shape.push_back(r.hi - r.lo);
  at::Tensor region = at::empty(region_shape, cpu);
  const std::vector<int64_t> src_piece = source.piece_shape();
  const int64_t src_rn = row_numel(src_piece);
  int64_t covered = 0;
  for (int j = 0; j < (source.is_split() ? source.tp_size : 1); ++j) {
    const std::vector<Range> S = piece_box(source, j);
    std::vector<Range> I(nd);
    bool empty = false;
    for (size_t k = 0; k < nd; ++k) {
      I[k] = {std::max(T[k].lo, S[k].lo), std::min(T[k].hi, S[k].hi)};
      empty = empty || I[k].lo >= I[k].hi;
    }
    if (empty) continue;
    // Source piece rows I[0] (contiguous), then the other dims narrowed.
    const int64_t r0 = I[0].lo - S[0].lo, r1 = I[0].hi - S[0].lo;
    at::Tensor rows = read_source(j, r0 * src_rn, r1 * src_rn);
    std::vector<int64_t> rows_shape = src_piece;
    rows_shape[0] = r1 - r0;
    at::Tensor src = rows.view(rows_shape), dst = region;
    int64_t n = 1;
    for (size_t k = 0; k < nd; ++k) {
      const int64_t len = I[k].hi - I[k].lo;
      n *= len;
      if (k > 0) src = src.narrow(static_cast<int64_t>(k), I[k].lo - S[k].lo, len);
      dst = dst.narrow(static_cast<int64_t>(k), I[k].lo - T[k].lo, len);
    }
    dst.copy_(src);
    covered += n;
  }
  BMT_ASSERT(covered == region.numel(), "tp re-cut covered ", covered, " of ", region.numel(), " elements");
  return region.view({-1}).narrow(0, offset, end - begin);
}

std::pair<int64_t, int64_t> logical_span(const TpLayout& target, int tp_rank, int64_t begin, int64_t end) {
  if (begin >= end) return {0, 0};
  int64_t offset = 0;
  const std::vector<Range> T = target_region(target, tp_rank, begin, end, offset);
  const int64_t rn = row_numel(target.logical_shape);
  return {T[0].lo * rn, T[0].hi * rn};
}

at::Tensor logical_rows(const TpLayout& source, int64_t row_begin, int64_t row_end, at::ScalarType dtype,
                        const PieceReader& read_source) {
  const int64_t rn = row_numel(source.logical_shape);
  return assemble_piece_range(source, unsplit_layout(source.logical_shape), 0, row_begin * rn, row_end * rn, dtype,
                              read_source);
}

}  // namespace bmt::checkpoint
