#include "bmt/checkpoint/slice_plan.h"

#include <algorithm>
#include <cstdio>
#include <unordered_map>

#include "bmt/checkpoint/json_internal.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

std::string encode_decls(const std::vector<SliceDecl>& decls) {
  Json arr = Json::array();
  for (const SliceDecl& d : decls) {
    Json shape = Json::array(), attrs = Json::object();
    for (int64_t s : d.shape) shape.push_back(s);
    for (const auto& kv : d.attrs) attrs.append(kv.first, kv.second);
    arr.push_back(Json::array({Json(d.key), Json(d.dtype), std::move(shape), std::move(attrs), Json(d.begin), Json(d.end)}));
  }
  return arr.dump();
}

std::vector<SliceDecl> decode_decls(const std::string& bytes) {
  const std::string ctx = "slice declarations";
  std::vector<SliceDecl> out;
  const Json root = Json::parse(bytes, ctx);
  for (const Json& j : root.as_array(ctx)) {
    const auto& a = j.as_array(ctx);
    BMT_ASSERT(a.size() == 6, "bad slice declaration");
    SliceDecl d;
    d.key = a[0].as_string(ctx);
    d.dtype = a[1].as_string(ctx);
    for (const Json& s : a[2].as_array(ctx)) d.shape.push_back(s.as_int(ctx));
    for (const auto& kv : a[3].as_object(ctx)) d.attrs[kv.first] = kv.second.as_string(ctx);
    d.begin = a[4].as_int(ctx);
    d.end = a[5].as_int(ctx);
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<PlannedEntry> plan_pieces(const std::vector<std::vector<SliceDecl>>& per_rank) {
  std::vector<PlannedEntry> plan;
  std::unordered_map<std::string, size_t> index;
  std::vector<std::string> conflicts;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    for (const SliceDecl& d : per_rank[r]) {
      const int64_t numel = checked_numel(d.shape, "entry " + d.key);
      BMT_ASSERT(0 <= d.begin && d.begin <= d.end && d.end <= numel, "rank ", r, " declares [", d.begin, ", ", d.end,
                 ") of ", d.key, " with ", numel, " elements");
      auto it = index.find(d.key);
      if (it == index.end()) {
        it = index.emplace(d.key, plan.size()).first;
        PlannedEntry e;
        e.info = d;
        e.info.begin = e.info.end = 0;
        e.numel = numel;
        plan.push_back(std::move(e));
      }
      PlannedEntry& e = plan[it->second];
      if (e.info.dtype != d.dtype || e.info.shape != d.shape || e.info.attrs != d.attrs) {
        conflicts.push_back(d.key + ": rank " + std::to_string(r) + " has " + d.dtype + " " + shape_string(d.shape) +
                            ", a lower rank has " + e.info.dtype + " " + shape_string(e.info.shape));
        continue;
      }
      // Add the parts of [begin, end) no lower rank wrote (pieces so far are disjoint and sorted).
      int64_t lo = d.begin;
      std::vector<PlannedPiece> added;
      for (const PlannedPiece& p : e.pieces) {
        if (lo >= d.end) break;
        if (p.end <= lo) continue;
        if (p.begin > lo) added.push_back({static_cast<int>(r), lo, std::min(p.begin, d.end)});
        lo = std::max(lo, p.end);
      }
      if (lo < d.end) added.push_back({static_cast<int>(r), lo, d.end});
      e.pieces.insert(e.pieces.end(), added.begin(), added.end());
      std::sort(e.pieces.begin(), e.pieces.end(),
                [](const PlannedPiece& a, const PlannedPiece& b) { return a.begin < b.begin; });
    }
  }
  if (!conflicts.empty()) {
    std::string msg = "checkpoint: ranks disagree about the shape or dtype of " + std::to_string(conflicts.size()) +
                      " entries:";
    for (const auto& c : conflicts) msg += "\n  " + c;
    BMT_ERROR(msg);
  }
  return plan;
}

FileLayout layout_shard_files(const std::vector<PlannedEntry>& plan, int world_size) {
  FileLayout out;
  out.file_nbytes.assign(static_cast<size_t>(world_size), 0);
  for (const PlannedEntry& e : plan) {
    EntryMeta m;
    m.key = e.info.key;
    m.dtype = e.info.dtype;
    m.shape = e.info.shape;
    m.attrs = e.info.attrs;
    const int64_t elem = dtype_element_nbytes(e.info.dtype);
    for (const PlannedPiece& p : e.pieces) {
      BMT_ASSERT(p.rank >= 0 && p.rank < world_size, "piece of rank ", p.rank, " in a world of ", world_size);
      int64_t& pos = out.file_nbytes[static_cast<size_t>(p.rank)];
      pos = (pos + kPieceAlignNbytes - 1) / kPieceAlignNbytes * kPieceAlignNbytes;
      m.pieces.push_back(Piece{p.rank, pos, p.begin, p.end});
      pos += (p.end - p.begin) * elem;
    }
    out.entries.push_back(std::move(m));
  }
  return out;
}

std::string shard_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.bin", rank);
  return buf;
}

}  // namespace bmt::checkpoint
