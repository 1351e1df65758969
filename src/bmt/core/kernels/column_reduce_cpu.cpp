// CPU twin of the column reductions: plain loops with fp64 sums (the reference the CUDA test compares with), and
// the partition plan both variants share.
#include <algorithm>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/float_elements_cpu_internal.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"

namespace bmt::core::kernels {
namespace {

// Stage 1 of the CUDA variant: blocks of 32 column lanes x 8 row lanes, each column lane holding one 16-byte vector.
constexpr int64_t kTargetBlocks = 512;  // a fixed number, not the device's SM count: results must not depend on it
constexpr int64_t kRowLanes = 8;

double load_as_double(const void* p, DType dtype, int64_t i) {
  return load_float_element(p, dtype, i, "column reductions");
}

void store_from_double(void* p, DType dtype, int64_t i, double v) {
  store_float_element(p, dtype, i, v, "column reductions");
}

void check_shape(int64_t rows, int64_t cols, const char* op) {
  BMT_CHECK(rows >= 0 && cols >= 0, op, ": negative shape [", rows, ", ", cols, "]");
}

}  // namespace

ColumnReducePlan column_reduce_plan(int64_t rows, int64_t cols, DType dtype) {
  ColumnReducePlan p;
  if (rows <= 0 || cols <= 0) return p;
  const int64_t tile_cols = 32 * (dtype == DType::kFloat32 ? 4 : 8);
  const int64_t tiles = (cols + tile_cols - 1) / tile_cols;
  const int64_t max_slabs = (rows + kRowLanes - 1) / kRowLanes;  // at least one row per row lane
  const int64_t want = std::max<int64_t>(1, std::min(max_slabs, (kTargetBlocks + tiles - 1) / tiles));
  p.rows_per_slab = (rows + want - 1) / want;
  p.slabs = (rows + p.rows_per_slab - 1) / p.rows_per_slab;
  return p;
}

int64_t column_reduce_workspace_numel(int64_t rows, int64_t cols, DType dtype) {
  return column_reduce_plan(rows, cols, dtype).slabs * std::max<int64_t>(cols, 0);
}

int64_t column_sum_amax_partials(int64_t rows, int64_t cols, DType dtype) {
  if (rows <= 0 || cols <= 0) return 0;
  const int64_t tile_cols = 32 * (dtype == DType::kFloat32 ? 4 : 8);
  return column_reduce_plan(rows, cols, dtype).slabs * ((cols + tile_cols - 1) / tile_cols);
}

void column_sum_cpu(const void* dy, DType dtype, int64_t rows, int64_t cols, void* out, DType out_dtype) {
  check_shape(rows, cols, "column_sum_cpu");
  std::vector<double> sum(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) sum[static_cast<size_t>(c)] += load_as_double(dy, dtype, r * cols + c);
  for (int64_t c = 0; c < cols; ++c) store_from_double(out, out_dtype, c, sum[static_cast<size_t>(c)]);
}

void dgelu_column_sum_cpu(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols, void* dgrad,
                          void* out, DType out_dtype) {
  check_shape(rows, cols, "dgelu_column_sum_cpu");
  std::vector<double> sum(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      const double g = load_as_double(dy, dtype, i) * gelu_tanh_grad(static_cast<float>(load_as_double(pre, dtype, i)));
      store_from_double(dgrad, dtype, i, g);
      sum[static_cast<size_t>(c)] += load_as_double(dgrad, dtype, i);  // the stored (rounded) value
    }
  }
  for (int64_t c = 0; c < cols; ++c) store_from_double(out, out_dtype, c, sum[static_cast<size_t>(c)]);
}

void layer_norm_param_grads_cpu(const void* dy, const void* x, DType dtype, const float* mean, const float* rstd,
                                int64_t rows, int64_t cols, void* dgamma, void* dbeta, DType out_dtype) {
  check_shape(rows, cols, "layer_norm_param_grads_cpu");
  std::vector<double> g(static_cast<size_t>(cols), 0.0), b(static_cast<size_t>(cols), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double d = load_as_double(dy, dtype, r * cols + c);
      const double xhat = (load_as_double(x, dtype, r * cols + c) - mean[r]) * rstd[r];
      g[static_cast<size_t>(c)] += d * xhat;
      b[static_cast<size_t>(c)] += d;
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    if (dgamma) store_from_double(dgamma, out_dtype, c, g[static_cast<size_t>(c)]);
    if (dbeta) store_from_double(dbeta, out_dtype, c, b[static_cast<size_t>(c)]);
  }
}

}  // namespace bmt::core::kernels
