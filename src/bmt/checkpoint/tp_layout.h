// Tensor-parallel layout of checkpoint entries, and the re-cutting of tp pieces when the tp size changes.
//
// A TP-split parameter (parameter.h: logical shape L cut along split_dim into tp_size equal pieces) is stored in a
// sharded checkpoint as ONE entry whose global shape is the stacked pieces (tp_size, *piece_shape), with attrs
//   "tp_split_dim" (d), "tp_size" (t), "logical_shape" ("16,8")
// so piece r is the contiguous element range [r * piece_numel, (r + 1) * piece_numel) and each rank's ZeRO shard of
// its piece is one contiguous range. Its optimizer states (exp_avg, exp_avg_sq, fp32 master) use the same layout.
// Entries without these attrs (replicated parameters, dp-only models, checkpoints written before tensor
// parallelism) are stored with their logical shape: the unsplit layout (tp_size 1).
// For split_dim 0 the stacked layout's flattened order equals the logical tensor's (only the shape differs).
// Grouped splits (a fused Q/K/V weight: dimension d holds G equal blocks, each split over tp; parameter.h's
// tp_split_groups) are plain splits of an expanded shape: dimension d becomes (G, n/G) and the split is along
// d + 1, so `logical_shape` is the expanded shape, `split_groups` = G (attr "tp_split_groups"), and real_shape()
// merges the two dimensions back (the shape consolidated files and state_dict use; the flattened order is the same).
// An unsplit entry whose shape equals a grouped layout's real shape is re-cut through the expanded shape
// (align_unsplit).
//
// assemble_piece_range builds elements [begin, end) of the flattened piece `tp_rank` of a target layout from the
// pieces of a source layout with the same logical shape (any split dim and tp size, or unsplit): it reads, piece by
// piece, only the source rows overlapping the rows of the target piece that [begin, end) touches, slices and copies
// them into place. Memory: the touched rows of the target piece plus one source piece's overlapping rows.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace bmt::checkpoint {

struct TpLayout {
  std::vector<int64_t> logical_shape;
  int split_dim = -1;  // -1: not split
  int tp_size = 1;
  int split_groups = 1;  // > 1: logical_shape is expanded, dimension split_dim - 1 holds the groups

  // The user-visible shape (logical_shape with a grouped split's two dimensions merged).
  std::vector<int64_t> real_shape() const;
  bool is_split() const { return split_dim >= 0 && tp_size > 1; }
  std::vector<int64_t> piece_shape() const;  // logical_shape when not split
  int64_t piece_numel() const;
  // The entry's global shape: (tp_size, *piece_shape) when split, else logical_shape.
  std::vector<int64_t> stored_shape() const;
  bool operator==(const TpLayout& o) const;
  // "[16, 8]" or "[16, 8] (split along dim 1 over tp 2)".
  std::string describe() const;
};

TpLayout unsplit_layout(std::vector<int64_t> logical_shape);
// A split of `real_shape` along `split_dim` over tp, in `groups` equal blocks (groups 1: a plain split).
TpLayout split_layout(const std::vector<int64_t>& real_shape, int split_dim, int tp_size, int groups);
// When `a` is unsplit and its shape is `b`'s real shape, gives `a` b's (possibly expanded) logical shape, so the
// two can be re-cut into each other. Returns whether the real shapes match.
bool align_unsplit(TpLayout& a, const TpLayout& b);
// Adds the tp attrs of a split layout (nothing for an unsplit one).
void add_tp_attrs(const TpLayout& layout, std::map<std::string, std::string>& attrs);
// The layout an entry was stored with; inconsistent tp attrs (a dimension out of range, a stored shape that is not
// (tp, *piece) of the logical shape) throw naming `key`.
TpLayout entry_tp_layout(const std::string& key, const std::vector<int64_t>& stored_shape,
                         const std::map<std::string, std::string>& attrs);

// Elements [src_begin, src_end) of the flattened source piece `piece` (1-D, `dtype`).
using PieceReader = std::function<at::Tensor(int piece, int64_t src_begin, int64_t src_end)>;

// Elements [begin, end) of the flattened piece `tp_rank` of `target` (1-D CPU tensor of `dtype`) from `source`'s
// pieces (same logical shape; read_source is called once per overlapping source piece, in piece order).
at::Tensor assemble_piece_range(const TpLayout& source, const TpLayout& target, int tp_rank, int64_t begin,
                                int64_t end, at::ScalarType dtype, const PieceReader& read_source);

// The smallest element range of the flattened LOGICAL tensor (an unsplit source) that assemble_piece_range reads
// for these arguments: whole logical rows (dim 0).
std::pair<int64_t, int64_t> logical_span(const TpLayout& target, int tp_rank, int64_t begin, int64_t end);

// The logical tensor's rows [row_begin, row_end) (dim 0), flattened, from a split source's pieces (each piece read
// for the same rows): what consolidated writers stream for split_dim > 0.
at::Tensor logical_rows(const TpLayout& source, int64_t row_begin, int64_t row_end, at::ScalarType dtype,
                        const PieceReader& read_source);

}  // namespace bmt::checkpoint
