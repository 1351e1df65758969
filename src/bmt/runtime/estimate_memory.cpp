#include "bmt/runtime/estimate_memory.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "bmt/core/error.h"

namespace bmt {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Host memory of one training process besides what it allocates for training (LibTorch, CUDA and NCCL libraries,
// the data loader): measured 1.2-1.4 GiB in every bench/results row without offload.
constexpr double kRuntimeHostBytes = 1.3 * kGiB;

int64_t kv_dim(const ModelShape& m) { return (m.kv_heads > 0 ? m.kv_heads : m.heads) * (m.hidden / m.heads); }

// Parameters of one layer split over tp (their per-rank share is 1/tp) and replicated over tp (norms, some biases).
struct LayerParams {
  int64_t split = 0, replicated = 0;
};

LayerParams layer_params_of(const ModelShape& m) {
  const int64_t d = m.hidden, ff = m.ffn;
  if (m.arch == "llama") {
    const int64_t kv = kv_dim(m);
    return {d * d + 2 * d * kv + d * d + 3 * d * ff, 2 * d};  // wq wk wv wo, w1 w2 w3; two RMSNorm weights
  }
  // gpt: fused qkv (+bias), out, fc1 (+bias) and fc2 split; two LayerNorms and the row-parallel biases replicated.
  return {3 * d * d + 3 * d + d * d + d * ff + ff + ff * d, 4 * d + 2 * d};
}

LayerParams other_params_of(const ModelShape& m) {
  const int64_t d = m.hidden;
  if (m.arch == "llama") return {2 * m.vocab * d, d};  // embedding and head (vocab-parallel), final norm
  return {m.vocab * d, m.max_seq * d + 2 * d};          // tied embedding; positions and final LayerNorm replicated
}

// What pipeline stage 0 holds outside the layers: the input embeddings only (GPT: token and position tables; the
// tied copy, the final norm and the head live on the last stage).
LayerParams first_stage_params_of(const ModelShape& m) {
  const int64_t d = m.hidden;
  if (m.arch == "llama") return {m.vocab * d, 0};
  return {m.vocab * d, m.max_seq * d};
}

double per_rank(const LayerParams& p, int tp) { return static_cast<double>(p.split) / tp + static_cast<double>(p.replicated); }

// Bytes autograd keeps per token for one layer's backward (bf16/fp16 activations of the example layers; fp32 for
// fp32 parameters). With tp > 1 the layouts are sequence-parallel: the residual stream and norm outputs are split
// over tp, the all-gathered norm outputs that the column-parallel linears save are whole, the rest is split.
double layer_activation_bytes_per_token(const ModelShape& m, int tp, double abytes) {
  const double d = static_cast<double>(m.hidden), ff = static_cast<double>(m.ffn);
  const double heads = static_cast<double>(m.heads);
  double split = 0, whole = 0;
  if (m.arch == "llama") {
    const double kv = static_cast<double>(kv_dim(m));
    // x, norm out, h (after attention), norm2 out: residual-stream sized.
    split += 4 * d;
    // q k v, RoPE'd q k, attention output; gate, up, silu(gate), silu*up.
    split += (d + 2 * kv) + (d + kv) + d + 4 * ff;
  } else {
    split += 4 * d;                   // x, ln1 out, h, ln2 out
    split += 3 * d + d + 2 * ff;      // qkv, attention output, fc1 out, gelu out
  }
  if (tp > 1) whole += 2 * d;         // the two gathered norm outputs
  double bytes = abytes * (split / tp + whole);
  bytes += 4.0 * heads / tp;          // attention log-sum-exp (fp32)
  bytes += 2 * 2 * 4.0;               // two norms' fp32 statistics
  return bytes;
}

double param_bytes(const std::string& dtype) {
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp32") return 4;
  BMT_ERROR("estimate_memory: dtype '", dtype, "' is not one of bf16, fp16, fp32");
}

}  // namespace

int64_t ModelShape::layer_params() const {
  LayerParams p = layer_params_of(*this);
  return p.split + p.replicated;
}

int64_t ModelShape::other_params() const {
  LayerParams p = other_params_of(*this);
  return p.split + p.replicated;
}

MemoryEstimate estimate_memory(const ModelShape& m, const MemoryPlan& plan) {
  BMT_CHECK(m.arch == "gpt" || m.arch == "llama", "estimate_memory: arch '", m.arch, "' is not gpt or llama");
  BMT_CHECK(m.layers > 0 && m.hidden > 0 && m.heads > 0 && m.ffn > 0 && m.vocab > 0 && m.hidden % m.heads == 0,
            "estimate_memory: the shape needs layers, hidden, heads (dividing hidden), ffn and vocab > 0 (got layers ",
            m.layers, ", hidden ", m.hidden, ", heads ", m.heads, ", ffn ", m.ffn, ", vocab ", m.vocab, ")");
  BMT_CHECK(plan.world >= 1 && plan.tp >= 1 && plan.pp >= 1 && plan.world % (plan.tp * plan.pp) == 0,
            "estimate_memory: world ", plan.world, " is not a multiple of tp ", plan.tp, " x pp ", plan.pp);
  BMT_CHECK(plan.zero == 2 || plan.zero == 3, "estimate_memory: zero level ", plan.zero, " is not 2 or 3");
  BMT_CHECK(plan.batch >= 1 && plan.seq >= 1, "estimate_memory: batch and seq must be >= 1");
  BMT_CHECK(m.heads % plan.tp == 0 && m.ffn % plan.tp == 0, "estimate_memory: tp ", plan.tp,
            " must divide heads ", m.heads, " and ffn ", m.ffn);
  const double pbytes = param_bytes(plan.dtype);
  const bool half = pbytes == 2;
  const int tp = plan.tp, pp = plan.pp, dp = plan.world / (tp * pp);
  const int64_t layers_here = (m.layers + pp - 1) / pp;  // stage 0 (also holds the embedding)

  const double layer_p = per_rank(layer_params_of(m), tp);  // one layer's parameters on this tp rank
  // pp: stage 0 (the one estimated) holds only the input embeddings outside the layers
  const double other_p = per_rank(pp > 1 ? first_stage_params_of(m) : other_params_of(m), tp);
  const double params_here = layers_here * layer_p + other_p;
  const double shard = params_here / dp;  // ZeRO: this rank's share

  MemoryEstimate e;
  e.params_total = m.params();
  e.params_per_rank = static_cast<int64_t>(params_here);
  e.ranks_per_host = plan.ranks_per_host > 0 ? plan.ranks_per_host : std::min(plan.world, 8);

  // Parameters, fp32 main gradients, Adam (fp32 master copy for half parameters, two fp32 moments).
  const double grad_bytes = 4, adam_bytes = half ? 12 : 8;
  e.gpu.parameters = pbytes * shard;
  e.gpu.gradients = grad_bytes * shard;
  double on_gpu_adam = shard;
  if (plan.offload) {
    const int64_t k = std::min<int64_t>(plan.offload_gpu_blocks, layers_here);
    on_gpu_adam = k * layer_p / dp;
    const double offloaded = shard - on_gpu_adam;
    const double staging = offloaded * ((plan.offload_grad_bf16 ? 2 : 4) + pbytes);  // pinned gradient + parameter
    e.host.optimizer_states = e.ranks_per_host * adam_bytes * offloaded;
    e.host.buffers = e.ranks_per_host * staging;
  }
  e.gpu.optimizer_states = adam_bytes * on_gpu_adam;
  if (plan.step_in_backward && !plan.offload) {
    // Each Block's fp32 gradient shard lives from its reduction until its update is queued, then is freed: two
    // Blocks' at most (one reducing, one updating) plus the parameters outside Blocks, updated in step().
    e.gpu.gradients = grad_bytes * (other_p + std::min<double>(2.0, static_cast<double>(layers_here)) * layer_p) / dp;
  }
  e.host.runtime = e.ranks_per_host * kRuntimeHostBytes;

  // Activations of the micro-batches in flight (pipeline stage 0 holds pp of them under 1F1B).
  const double tokens = static_cast<double>(plan.batch) * plan.seq;
  const double abytes = pbytes;
  const double per_layer = tokens * layer_activation_bytes_per_token(m, tp, abytes);
  const double in_flight = pp;
  double act;
  if (plan.checkpointing) {
    const double inputs = tokens * abytes * m.hidden / tp;  // each Block's saved input (sequence-split under tp)
    act = in_flight * layers_here * inputs + per_layer;      // + the one Block being recomputed
  } else {
    act = in_flight * layers_here * per_layer;
  }
  act += in_flight * tokens * abytes * 4.0 * m.hidden / tp;  // embedding output, final norm input/output
  e.gpu.activations = act;

  // Buffers: gathered Blocks (a Block whose group has one rank aliases its shard: none), one Block's full gradient
  // while it is reduce-scattered, the gathered embedding and its gradient, the logits (vocab-parallel under tp; the
  // fused cross-entropy writes the gradient into them).
  double buf = 0;
  if (dp > 1) {
    const double gathered_blocks = plan.zero == 2 ? static_cast<double>(layers_here) : 2.0;  // ZeRO-3: + prefetch
    buf += gathered_blocks * layer_p * pbytes + layer_p * 4;
    buf += other_p * (pbytes + 4);
  }
  if (pp == 1) buf += tokens * static_cast<double>(m.vocab) / tp * abytes;  // (pp: the logits are the last stage's)
  e.gpu.buffers = buf;
  return e;
}

std::string format_memory_estimate(const ModelShape& m, const MemoryPlan& plan, const MemoryEstimate& e) {
  std::ostringstream os;
  char line[200];
  std::snprintf(line, sizeof line, "%s L%lld d%lld h%lld ff%lld vocab %lld: %.3fB parameters (%.3fB on one rank)\n",
                m.arch.c_str(), static_cast<long long>(m.layers), static_cast<long long>(m.hidden),
                static_cast<long long>(m.heads), static_cast<long long>(m.ffn), static_cast<long long>(m.vocab),
                e.params_total / 1e9, e.params_per_rank / 1e9);
  os << line;
  std::snprintf(line, sizeof line,
                "world %d tp %d pp %d zero %d, batch %lld x seq %lld, %s%s%s\n", plan.world, plan.tp, plan.pp,
                plan.zero, static_cast<long long>(plan.batch), static_cast<long long>(plan.seq), plan.dtype.c_str(),
                plan.checkpointing ? ", checkpointing" : "", plan.offload ? ", offload" : "");
  os << line;
  os << "                     per GPU (GiB)   per host (GiB, " << e.ranks_per_host << " ranks)\n";
  auto row = [&](const char* name, double g, double h) {
    std::snprintf(line, sizeof line, "  %-18s %12.2f %14.2f\n", name, g / kGiB, h / kGiB);
    os << line;
  };
  row("parameters", e.gpu.parameters, e.host.parameters);
  row("gradients", e.gpu.gradients, e.host.gradients);
  row("optimizer states", e.gpu.optimizer_states, e.host.optimizer_states);
  row("activations", e.gpu.activations, e.host.activations);
  row("buffers", e.gpu.buffers, e.host.buffers);
  row("runtime", e.gpu.runtime, e.host.runtime);
  row("total", e.gpu.total(), e.host.total());
  return os.str();
}

}  // namespace bmt
