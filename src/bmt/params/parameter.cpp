#include "bmt/params/parameter.h"

#include <torch/autograd.h>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt {
namespace {

int64_t partition_numel(int64_t full_numel, int world) { return (full_numel + world - 1) / world; }

at::Tensor make_shard(const ParamMeta& m, bool requires_grad) {
  at::Tensor t = at::zeros({m.shard_end - m.shard_begin},
                           at::TensorOptions().dtype(m.dtype).device(config().device));
  t.set_requires_grad(requires_grad);
  return t;
}

// All-gathers a standalone (non-Block) parameter into its full shape.
at::Tensor raw_gather(const at::Tensor& param, const ParamMeta& m) {
  core::Communicator& comm = *m.comm;
  const int64_t part = partition_numel(m.full_numel, comm.size());
  at::Tensor padded = at::zeros({part}, param.options().requires_grad(false));
  if (param.numel() > 0) padded.narrow(0, 0, param.numel()).copy_(param.detach());
  at::Tensor full = at::empty({part * comm.size()}, padded.options());
  comm.all_gather(padded.data_ptr(), full.data_ptr(), part, to_core_dtype(m.dtype), current_stream_handle(full));
  return full.narrow(0, 0, m.full_numel).view(m.full_shape);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GatherParamFn : torch::autograd::Function<GatherParamFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& param) {
    ctx->saved_data["impl"] = reinterpret_cast<int64_t>(param.unsafeGetTensorImpl());
    ctx->save_for_backward({param});
    return raw_gather(param, meta_of(param));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor param = ctx->get_saved_variables()[0];
    const ParamMeta& m = meta_of(param);
    core::Communicator& comm = *m.comm;
    const int64_t part = partition_numel(m.full_numel, comm.size());
    at::ScalarType acc = at::kFloat;
    if (m.dtype == at::kDouble) acc = at::kDouble;
    at::Tensor flat = at::zeros({part * comm.size()}, grads[0].options().dtype(acc));
    flat.narrow(0, 0, m.full_numel).copy_(grads[0].reshape({-1}));
    at::Tensor mine = at::empty({part}, flat.options());
    comm.reduce_scatter(flat.data_ptr(), mine.data_ptr(), part, to_core_dtype(acc), core::ReduceOp::kSum,
                        current_stream_handle(flat));
    reduce_over_tp(mine, m.tp_grad_reduce);
    at::Tensor g = ensure_main_grad(param);
    if (g.numel() > 0) g.add_(mine.narrow(0, 0, g.numel()));
    return {at::Tensor()};
  }
};

}  // namespace

void reduce_over_tp(at::Tensor& grad_shard, TpGradReduce reduce) {
  if (reduce == TpGradReduce::kNone || !is_initialized() || config().tp_size == 1) return;
  core::Communicator& tp = *config().tp_comm;
  const core::ReduceOp op = reduce == TpGradReduce::kSum ? core::ReduceOp::kSum : core::ReduceOp::kAvg;
  tp.all_reduce(grad_shard.data_ptr(), grad_shard.data_ptr(), grad_shard.numel(),
                to_core_dtype(grad_shard.scalar_type()), op, current_stream_handle(grad_shard));
}

at::Tensor DistributedParameter(at::IntArrayRef full_shape, at::ScalarType dtype, InitMethod init_method,
                                bool requires_grad, std::shared_ptr<core::Communicator> comm) {
  const Config& cfg = config();
  auto m = std::make_shared<ParamMeta>();
  m->full_shape = full_shape.vec();
  m->full_numel = 1;
  for (int64_t d : full_shape) {
    BMT_CHECK(d >= 0, "DistributedParameter: negative dimension in shape ", full_shape);
    m->full_numel *= d;
  }
  m->dtype = dtype;
  m->comm = comm ? std::move(comm) : cfg.tp_zero_comm;
  const int64_t part = partition_numel(m->full_numel, m->comm->size());
  m->shard_begin = std::min(m->full_numel, part * m->comm->rank());
  m->shard_end = std::min(m->full_numel, m->shard_begin + part);
  m->init_method = std::move(init_method);
  // Replicated over the tp group when the sharding group does not span it.
  if (cfg.tp_size > 1 && m->comm->size() * cfg.tp_size <= cfg.zero_size)
    m->tp_grad_reduce = cfg.sequence_parallel ? TpGradReduce::kSum : TpGradReduce::kAvg;
  at::Tensor t = make_shard(*m, requires_grad);
  set_replication(t, replication_of(*m, cfg.zero_size));
  register_meta(t, std::move(m));
  return t;
}

at::Tensor TensorParallelParameter(at::IntArrayRef logical_shape, int split_dim, at::ScalarType dtype,
                                   InitMethod init_method, bool requires_grad, const std::string& who,
                                   int64_t split_groups) {
  const Config& cfg = config();
  const std::string name = who.empty() ? std::string("TensorParallelParameter") : who;
  BMT_CHECK(split_dim >= 0 && split_dim < static_cast<int>(logical_shape.size()), name, ": split dimension ",
            split_dim, " is out of range for shape ", logical_shape);
  const int64_t n = logical_shape[static_cast<size_t>(split_dim)];
  BMT_CHECK(split_groups >= 1 && n % split_groups == 0, name, ": dimension ", split_dim, " of shape ", logical_shape,
            " cannot be cut into ", split_groups, " equal blocks");
  BMT_CHECK(split_groups == 1 || n / split_groups % cfg.tp_size == 0, name, " (rank ", cfg.rank, "): dimension ",
            split_dim, " of shape ", logical_shape, " holds ", split_groups, " blocks of ", n / split_groups,
            ", which tp_size ", cfg.tp_size, " does not divide; choose a tp_size that divides it");
  BMT_CHECK(n % cfg.tp_size == 0, name, " (rank ", cfg.rank, "): dimension ", split_dim, " of shape ",
            logical_shape, " has size ", n, ", which tp_size ", cfg.tp_size, " does not divide; choose a tp_size "
            "that divides it (or pad the size)");
  std::vector<int64_t> piece = logical_shape.vec();
  piece[static_cast<size_t>(split_dim)] = n / cfg.tp_size;
  at::Tensor t = DistributedParameter(piece, dtype, std::move(init_method), requires_grad, cfg.tp_zero_comm);
  ParamMeta& m = meta_of(t);
  m.tp_split_dim = split_dim;
  m.tp_split_groups = split_groups;
  m.tp_size = cfg.tp_size;
  m.tp_rank = cfg.tp_rank;
  m.tp_grad_reduce = TpGradReduce::kNone;
  set_replication(t, replication_of(m, cfg.zero_size));
  return t;
}

void set_tp_grad_reduce(const at::Tensor& param, TpGradReduce reduce) {
  ParamMeta& m = meta_of(param);
  BMT_CHECK(m.block == nullptr, "set_tp_grad_reduce: the parameter of shape ", at::IntArrayRef(m.full_shape),
            " is already inside a Block; set it before wrapping the module");
  if (m.is_tp_split() || m.tp_grad_reduce == TpGradReduce::kNone) return;
  BMT_CHECK(reduce != TpGradReduce::kNone, "set_tp_grad_reduce: a tp-replicated parameter needs kSum or kAvg");
  m.tp_grad_reduce = reduce;
}

void set_tp_grad_reduce(torch::nn::Module& module, TpGradReduce reduce) {
  for (auto& item : module.named_parameters(true))
    if (is_distributed_param(item.value())) set_tp_grad_reduce(item.value(), reduce);
}

at::Tensor DistributedParameter(const at::Tensor& full, bool requires_grad, std::shared_ptr<core::Communicator> comm) {
  at::Tensor t = DistributedParameter(full.sizes(), full.scalar_type(), nullptr, requires_grad, std::move(comm));
  scatter_full(t, full);
  return t;
}

void adopt_distributed_parameter(const at::Tensor& target, const at::Tensor& created) {
  const ParamMeta* source = find_meta(created);
  BMT_CHECK(source != nullptr, "adopt_distributed_parameter: the source tensor is not a DistributedParameter");
  BMT_CHECK(source->block == nullptr, "adopt_distributed_parameter: the source parameter already belongs to a Block");
  BMT_CHECK(find_meta(target) == nullptr, "adopt_distributed_parameter: the target is already a DistributedParameter");
  std::shared_ptr<ParamMeta> meta = take_meta(created);
  target.set_data(created);  // the target's own TensorImpl now holds the shard
  register_meta(target, meta);
  set_replication(target, replication_of(*meta, config().zero_size));
}

void reshard_distributed_parameter(const at::Tensor& param, std::shared_ptr<core::Communicator> comm) {
  BMT_CHECK(comm != nullptr, "reshard_distributed_parameter: no communicator given");
  const ParamMeta& old = meta_of(param);
  BMT_CHECK(old.block == nullptr, "reshard_distributed_parameter: the parameter already belongs to a Block; "
            "reshard it before wrapping its module in a Block");
  BMT_CHECK(!old.is_tp_split(), "reshard_distributed_parameter: tensor-parallel pieces cannot move groups");
  at::Tensor full;
  {
    at::NoGradGuard no_grad;
    full = raw_gather(param, old).clone();
  }
  at::Tensor created = DistributedParameter(full, false, std::move(comm));
  std::shared_ptr<ParamMeta> meta = take_meta(created);
  std::shared_ptr<ParamMeta> previous = take_meta(param);
  meta->init_method = previous->init_method;
  meta->grad_dtype = previous->grad_dtype;
  const bool requires_grad = param.requires_grad();
  param.set_data(created);
  param.set_requires_grad(requires_grad);
  register_meta(param, meta);
  set_replication(param, replication_of(*meta, config().zero_size));
}

at::Tensor gathered(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  if (m.block && m.block->is_gathered()) return param;  // the Block already points it at the full tensor
  BMT_CHECK(m.block == nullptr, "parameter of shape ", at::IntArrayRef(m.full_shape),
            " belongs to a Block that is not running: call the Block (or bmt::state_dict) instead of gathering it");
  if (!at::GradMode::is_enabled() || !param.requires_grad()) {
    at::NoGradGuard guard;
    return raw_gather(param, m);
  }
  return GatherParamFn::apply(param);
}

at::Tensor gather_full(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  at::NoGradGuard guard;
  if (m.block) return m.block->gather_param_copy(param);
  return raw_gather(param, m).clone();
}

void scatter_full(const at::Tensor& param, const at::Tensor& full) {
  ParamMeta& m = meta_of(param);
  BMT_CHECK(full.numel() == m.full_numel, "scatter_full: value has shape ", full.sizes(), " but the parameter has ",
            at::IntArrayRef(m.full_shape));
  at::NoGradGuard guard;
  if (m.block) {
    m.block->scatter_param(param, full);
    return;
  }
  if (param.numel() > 0)
    param.copy_(full.reshape({-1}).narrow(0, m.shard_begin, m.shard_end - m.shard_begin));
}

at::Tensor gather_logical(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  at::Tensor piece = gather_full(param);
  if (!m.is_tp_split()) return piece;
  at::NoGradGuard guard;
  at::Tensor all = distributed::raw_all_gather(piece.contiguous(), *config().tp_comm);  // (tp, *piece)
  return logical_from_pieces(m, all.unbind(0));
}

at::Tensor logical_from_pieces(const ParamMeta& m, const std::vector<at::Tensor>& pieces) {
  BMT_CHECK(!pieces.empty(), "logical_from_pieces: no pieces");
  if (!m.is_tp_split()) return pieces[0];
  BMT_CHECK(static_cast<int>(pieces.size()) == m.tp_size, "logical_from_pieces: ", pieces.size(),
            " pieces for tp_size ", m.tp_size);
  const int dim = m.tp_split_dim;
  const int64_t c = m.full_shape[static_cast<size_t>(dim)] / m.tp_split_groups;  // one block's slice per rank
  std::vector<at::Tensor> parts;
  for (int64_t g = 0; g < m.tp_split_groups; ++g)
    for (const at::Tensor& p : pieces) parts.push_back(p.narrow(dim, g * c, c));
  return at::cat(parts, dim);
}

at::Tensor piece_of_logical(const ParamMeta& m, const at::Tensor& logical, int tp_rank) {
  if (!m.is_tp_split()) return logical;
  const int dim = m.tp_split_dim;
  const int64_t c = m.full_shape[static_cast<size_t>(dim)] / m.tp_split_groups;
  if (m.tp_split_groups == 1) return logical.narrow(dim, c * tp_rank, c);
  std::vector<at::Tensor> parts;
  for (int64_t g = 0; g < m.tp_split_groups; ++g) parts.push_back(logical.narrow(dim, (g * m.tp_size + tp_rank) * c, c));
  return at::cat(parts, dim);
}

void scatter_logical(const at::Tensor& param, const at::Tensor& logical) {
  ParamMeta& m = meta_of(param);
  const std::vector<int64_t> want = m.logical_shape();
  BMT_CHECK(logical.sizes().vec() == want, "scatter_logical: value has shape ", logical.sizes(),
            " but the parameter's logical shape is ", at::IntArrayRef(want));
  if (!m.is_tp_split()) return scatter_full(param, logical);
  scatter_full(param, piece_of_logical(m, logical, m.tp_rank).contiguous());
}

at::Tensor ensure_main_grad(const at::Tensor& param) {
  at::Tensor g = main_grad(param);
  ParamMeta& m = meta_of(param);
  at::ScalarType gt = (m.dtype == at::kHalf || m.dtype == at::kBFloat16) ? at::kFloat : m.dtype;
  if (m.grad_dtype) gt = *m.grad_dtype;
  if (g.defined()) {
    // .grad is the shard (same dtype) but was set to None (zero_grad(set_to_none=True), `p.grad = None`): the
    // gradient it held is discarded, as torch does, and .grad points at the shard again.
    if (gt == m.dtype && !param.grad().defined()) {
      g.zero_();
      param.mutable_grad() = g;
    }
    return g;
  }
  g = at::zeros({param.numel()}, param.options().dtype(gt).requires_grad(false));
  set_main_grad(param, g);
  if (gt == m.dtype) param.mutable_grad() = g;
  return g;
}

}  // namespace bmt
