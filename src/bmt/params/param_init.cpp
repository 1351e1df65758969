#include "bmt/params/param_init.h"

#include <algorithm>
#include <cmath>

#include <torch/nn/init.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/core/philox.h"
#include "bmt/runtime/init.h"
#include "bmt/params/init_method_internal.h"
#include "bmt/params/parameter.h"
#include "bmt/params/pending_update.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt {
namespace {

using detail::BuiltinInit;

// torch's fan computation (torch.nn.init._calculate_fan_in_and_fan_out) over the logical shape.
double xavier_std(const BuiltinInit& b, at::IntArrayRef shape) {
  BMT_CHECK(shape.size() >= 2, "xavier initialisation needs a tensor of at least 2 dimensions, got shape ", shape,
            "; use bmt::init::normal or uniform for it");
  int64_t receptive = 1;
  for (size_t d = 2; d < shape.size(); ++d) receptive *= shape[d];
  const double fan_in = static_cast<double>(shape[1] * receptive), fan_out = static_cast<double>(shape[0] * receptive);
  return b.a * std::sqrt(2.0 / (fan_in + fan_out));
}

core::RandomStream stream_for(const BuiltinInit& b, at::IntArrayRef logical_shape, uint64_t seed,
                              const std::string& name) {
  core::RandomStream s;
  s.seed = seed;
  s.stream = core::stream_of_name(name.data(), name.size());
  switch (b.kind) {
    case BuiltinInit::Kind::kNormal: s.dist = core::RandomDist::kNormal, s.shift = b.a, s.scale = b.b; break;
    case BuiltinInit::Kind::kUniform: s.dist = core::RandomDist::kUniform, s.shift = b.a, s.scale = b.b - b.a; break;
    case BuiltinInit::Kind::kXavierNormal:
      s.dist = core::RandomDist::kNormal, s.shift = 0.0, s.scale = xavier_std(b, logical_shape);
      break;
    case BuiltinInit::Kind::kXavierUniform: {  // U(-a, a), a = sqrt(3) * std
      const double bound = std::sqrt(3.0) * xavier_std(b, logical_shape);
      s.dist = core::RandomDist::kUniform, s.shift = -bound, s.scale = 2.0 * bound;
      break;
    }
    case BuiltinInit::Kind::kConstant: BMT_ASSERT(false, "constant initialisers have no random stream");
  }
  return s;
}

// Where element j of this tp rank's piece (flattened full_shape) sits in the flattened logical tensor, and how many
// elements from j on stay contiguous there. Not split: the identity.
struct PieceLayout {
  bool split = false;
  int64_t inner = 1, piece_dim = 1, block = 1, tp_size = 1, tp_rank = 0;

  explicit PieceLayout(const ParamMeta& m) {
    if (!m.is_tp_split()) return;
    split = true;
    const size_t d = static_cast<size_t>(m.tp_split_dim);
    for (size_t k = d + 1; k < m.full_shape.size(); ++k) inner *= m.full_shape[k];
    piece_dim = m.full_shape[d];
    block = piece_dim / m.tp_split_groups;  // one split group's slice per rank
    tp_size = m.tp_size;
    tp_rank = m.tp_rank;
  }
  int64_t logical_index(int64_t j, int64_t* run) const {
    if (!split) {
      *run = INT64_MAX;
      return j;
    }
    const int64_t outer = j / (piece_dim * inner), rem = j % (piece_dim * inner);
    const int64_t k = rem / inner, q = rem % inner;
    const int64_t group = k / block, within = k % block;
    *run = block * inner - (within * inner + q);
    const int64_t logical_k = (group * tp_size + tp_rank) * block + within;
    return (outer * piece_dim * tp_size + logical_k) * inner + q;
  }
};

// Piece elements [begin, end) into out[0, end - begin) (host memory of `dtype`).
void fill_piece_range(const PieceLayout& layout, const core::RandomStream& s, int64_t begin, int64_t end,
                      core::DType dtype, char* out) {
  const size_t esize = core::dtype_nbytes(dtype);
  for (int64_t j = begin; j < end;) {
    int64_t run = 0;
    const int64_t logical = layout.logical_index(j, &run);
    const int64_t n = std::min(run, end - j);
    core::random_fill(s, logical, n, dtype, out + static_cast<size_t>(j - begin) * esize);
    j += n;
  }
}

// Elements per task: big enough to amortise a task, small enough to balance over the cores and to bound the host
// staging buffer of device shards.
constexpr int64_t kChunkNumel = int64_t{1} << 20;

void fill_stream(const PieceLayout& layout, const core::RandomStream& s, int64_t begin, int64_t end,
                 at::Tensor dst) {
  const core::DType dtype = to_core_dtype(dst.scalar_type());
  if (dst.is_cpu()) {
    char* base = static_cast<char*>(dst.data_ptr());
    const size_t esize = core::dtype_nbytes(dtype);
    // Our pool, not at::parallel_for: ATen's OpenMP backend runs its loop inline in code built without -fopenmp
    // (ours), which left a 6.7B-parameter init single-threaded (238 s of setup on the H200 machine's 16 cores).
    core::kernels::ThreadPool::global().parallel_for(end - begin, kChunkNumel, [&](int64_t lo, int64_t hi) {
      fill_piece_range(layout, s, begin + lo, begin + hi, dtype, base + static_cast<size_t>(lo) * esize);
    });
    return;
  }
  // Device shard: generate on the host one chunk at a time and copy it over.
  const int64_t chunk = 16 * kChunkNumel;
  at::Tensor host = at::empty({std::min(chunk, end - begin)}, dst.options().device(at::kCPU));
  for (int64_t lo = begin; lo < end; lo += chunk) {
    const int64_t n = std::min(chunk, end - lo);
    at::Tensor part = host.narrow(0, 0, n);
    fill_stream(layout, s, lo, lo + n, part);
    dst.narrow(0, lo - begin, n).copy_(part);
  }
}

uint64_t seed_or_default(const InitParametersOptions& o) { return o.seed ? *o.seed : config().seed; }

void init_full_with_torch(const at::Tensor& p, const ParamMeta& m) {
  // The whole logical tensor on every rank, so the random stream matches the unsplit model's.
  at::Tensor full = at::empty(m.logical_shape(), at::TensorOptions().dtype(m.dtype).device(config().device));
  m.init_method(full);
  scatter_logical(p, full);
}

}  // namespace

namespace detail {
void BuiltinInit::operator()(at::Tensor& full) const {
  switch (kind) {
    case Kind::kNormal: torch::nn::init::normal_(full, a, b); return;
    case Kind::kUniform: torch::nn::init::uniform_(full, a, b); return;
    case Kind::kConstant: torch::nn::init::constant_(full, a); return;
    case Kind::kXavierNormal: torch::nn::init::xavier_normal_(full, a); return;
    case Kind::kXavierUniform: torch::nn::init::xavier_uniform_(full, a); return;
  }
}
}  // namespace detail

// Built-ins are BuiltinInit values (not lambdas) so that init_parameters can recognise them.
namespace init {
using detail::BuiltinInit;
InitMethod normal(double mean, double std) { return BuiltinInit{BuiltinInit::Kind::kNormal, mean, std}; }
InitMethod uniform(double low, double high) { return BuiltinInit{BuiltinInit::Kind::kUniform, low, high}; }
InitMethod constant(double value) { return BuiltinInit{BuiltinInit::Kind::kConstant, value, 0.0}; }
InitMethod zeros() { return constant(0.0); }
InitMethod ones() { return constant(1.0); }
InitMethod xavier_normal() { return xavier_normal(1.0); }
InitMethod xavier_normal(double gain) { return BuiltinInit{BuiltinInit::Kind::kXavierNormal, gain, 0.0}; }
InitMethod xavier_uniform(double gain) { return BuiltinInit{BuiltinInit::Kind::kXavierUniform, gain, 0.0}; }
}  // namespace init

bool is_builtin_init(const InitMethod& init) { return detail::builtin_of(init) != nullptr; }

void init_shard(const at::Tensor& param, const InitMethod& init, uint64_t seed, const std::string& name) {
  const BuiltinInit* b = detail::builtin_of(init);
  BMT_CHECK(b != nullptr, "init_shard: parameter '", name, "' has a custom init method; only bmt::init's "
            "initialisers fill shards directly (init_parameters runs custom ones on the full tensor)");
  ParamMeta& m = meta_of(param);
  BMT_CHECK(m.block == nullptr || !m.block->is_gathered(), "init_shard: parameter '", name,
            "' belongs to a Block that is running; initialise parameters outside forward and backward");
  at::NoGradGuard guard;
  at::Tensor dst = param.detach();
  BMT_ASSERT(dst.numel() == m.shard_end - m.shard_begin && dst.is_contiguous(),
             "init_shard: the shard of '", name, "' does not match its element range");
  if (dst.numel() == 0) return;
  if (b->kind == BuiltinInit::Kind::kConstant) {
    dst.fill_(b->a);
    return;
  }
  fill_stream(PieceLayout(m), stream_for(*b, m.logical_shape(), seed, name), m.shard_begin, m.shard_end, dst);
}

at::Tensor init_logical(const InitMethod& init, at::IntArrayRef logical_shape, at::ScalarType dtype, uint64_t seed,
                        const std::string& name) {
  const BuiltinInit* b = detail::builtin_of(init);
  BMT_CHECK(b != nullptr, "init_logical: '", name, "' has a custom init method, not one of bmt::init's");
  at::Tensor full = at::empty(logical_shape, at::TensorOptions().dtype(dtype));
  if (b->kind == BuiltinInit::Kind::kConstant) return full.fill_(b->a);
  ParamMeta whole;  // not split: piece index = logical index
  fill_stream(PieceLayout(whole), stream_for(*b, logical_shape, seed, name), 0, full.numel(), full.view({-1}));
  return full;
}

void init_parameters(torch::nn::Module& module) { init_parameters(module, InitParametersOptions{}); }

void init_parameters(torch::nn::Module& module, const InitParametersOptions& options) {
  wait_all_pending_updates();  // an asynchronous optimizer step would overwrite the new values
  const uint64_t seed = seed_or_default(options);
  at::NoGradGuard guard;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    ParamMeta* m = find_meta(p);
    if (!m || !m->init_method) continue;
    if (!options.torch_generator && is_builtin_init(m->init_method)) init_shard(p, m->init_method, seed, item.key());
    else init_full_with_torch(p, *m);
  }
  seed_per_data_parallel_rank();
}

void init_parameters_by_name(torch::nn::Module& module, uint64_t seed) {
  wait_all_pending_updates();
  at::NoGradGuard guard;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    ParamMeta* m = find_meta(p);
    if (!m || !m->init_method) continue;
    if (is_builtin_init(m->init_method)) {
      init_shard(p, m->init_method, seed, item.key());
      continue;
    }
    // Custom: torch's generator, seeded from the seed and the name (FNV-1a).
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : item.key()) h = (h ^ c) * 1099511628211ull;
    at::manual_seed((h ^ (seed * 0x9E3779B97F4A7C15ull)) & ((uint64_t{1} << 63) - 1));
    init_full_with_torch(p, *m);
  }
  at::manual_seed(seed);
  seed_per_data_parallel_rank();
}

}  // namespace bmt
