#include "bmt/engine/block.h"
#include "bmt/engine/block_internal.h"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <map>
#include <tuple>
#include <mutex>

#include "bmt/core/error.h"
#include "bmt/engine/inspect.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/param_meta_internal.h"
#include "bmt/params/parameter.h"
#include "bmt/params/pending_update.h"
#include "bmt/engine/recompute_keep.h"
#include "bmt/runtime/stream_capture.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt {
namespace {

constexpr int64_t kAlignBytes = 512;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

at::ScalarType grad_dtype_for(at::ScalarType param, at::ScalarType reduce) {
  return at::promote_types(param, reduce);
}

struct RngState {
  at::Tensor cpu;
  at::Tensor device;
};

RngState save_rng() {
  RngState s;
  s.cpu = at::detail::getDefaultCPUGenerator().get_state();
  const Config& cfg = config();
  // Under CUDA graph capture the device generator's state cannot be read (and a replay would not re-run this host
  // code anyway): CudaGraphStep turns graphs off when a recomputing step draws device random numbers.
  if (cfg.device.is_cuda() && !current_stream_capturing(cfg.device))
    s.device = at::globalContext().defaultGenerator(cfg.device).get_state();
  return s;
}

std::atomic<int64_t> g_recompute_count{0};

void restore_rng(const RngState& s) {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_state(s.cpu);
  if (s.device.defined()) {
    at::Generator dev = at::globalContext().defaultGenerator(config().device);
    std::lock_guard<std::mutex> dev_lock(dev.mutex());
    dev.set_state(s.device);
  }
}

// Frees the bytes of t's storage but keeps the storage object, so that views autograd saved in forward
// (ZeRO-3 without checkpointing) stay valid handles and see the data again once the storage is refilled.
void free_bytes(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));  // the allocator honours record_stream uses
  impl->set_nbytes(0);
}

// `view` (a cached view, possibly undefined) was taken of `source`: the same storage object (the view holds it, so
// it cannot be a new storage at a reused address), dtype and device.
bool views_source(const at::Tensor& view, const at::Tensor& source) {
  return view.defined() && source.defined() &&
         view.storage().unsafeGetStorageImpl() == source.storage().unsafeGetStorageImpl() &&
         source.storage_offset() == 0 && view.scalar_type() == source.scalar_type();
}

// Every bit of t is zero (a parameter shard nobody wrote since it was created). -0.0 counts as written.
bool bitwise_zero(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (!t.is_cpu() || !t.is_contiguous()) return !at::ne(t.detach().view(at::kByte), 0).any().item<bool>();
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  return std::all_of(bytes, bytes + t.nbytes(), [](unsigned char b) { return b == 0; });
}

}  // namespace

namespace detail {
int64_t block_recompute_count() { return g_recompute_count.load(); }
}  // namespace detail

struct Block::CallState : torch::CustomClassHolder {
  std::vector<at::Tensor> inputs;        // as given (recompute)
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> graph_inputs;   // no-checkpoint: detached leaves the graph starts from
  std::vector<at::Tensor> graph_outputs;  // no-checkpoint: outputs with their graph
  RngState rng;
  CallContext context;
  inspect::detail::RecordSpan inspect_span;  // checkpointing: what the first run recorded (the recompute replays it)
  detail::KeptValues kept;                   // checkpointing: what ops kept for the recompute (recompute_keep.h)
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BlockFn : torch::autograd::Function<BlockFn> {
  // Inputs travel as a TensorList: a std::vector would not be recognised as tensors by autograd.
  static variable_list forward(AutogradContext* ctx, int64_t block_ptr, at::TensorList all_inputs) {
    auto* block = reinterpret_cast<Block*>(block_ptr);
    auto state = c10::make_intrusive<Block::CallState>();
    state->context = Block::current_call_context();
    std::vector<at::Tensor> inputs(all_inputs.begin(), all_inputs.end() - 1);  // drop the anchor
    auto outs = block->run_forward(*state, inputs);
    ctx->saved_data["block"] = block_ptr;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->saved_data["n_inputs"] = static_cast<int64_t>(inputs.size());
    for (auto& o : outs)
      if (!at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) ctx->mark_non_differentiable({o});
    return outs;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto* block = reinterpret_cast<Block*>(ctx->saved_data["block"].toInt());
    auto state = c10::static_intrusive_pointer_cast<Block::CallState>(ctx->saved_data["state"].toCapsule());
    auto grads = block->run_backward(*state, grad_outputs);
    variable_list result;
    result.push_back(at::Tensor());  // block_ptr
    for (auto& g : grads) result.push_back(g);
    result.push_back(at::Tensor());  // anchor
    ctx->saved_data.erase("state");
    return result;
  }
};

}  // namespace

Block::Block(std::shared_ptr<torch::nn::Module> module, BlockForward forward, BlockOptions options)
    : module_(std::move(module)), forward_fn_(std::move(forward)), options_(options) {
  const Config& cfg = config();
  zero_level_ = options_.zero_level == 0 ? cfg.zero_level : options_.zero_level;
  BMT_CHECK(zero_level_ == 2 || zero_level_ == 3, "Block: zero_level ", zero_level_,
            " is not supported; use 2 (keep gathered parameters from forward to backward) or 3 (gather twice)");
  BMT_CHECK(module_ != nullptr && forward_fn_, "Block: module and forward function must be set");
  BMT_CHECK(at::isFloatingType(options_.reduce_dtype), "Block: reduce_dtype must be a floating type");
  anchor_ = at::zeros({}, at::TensorOptions().device(cfg.device)).requires_grad_(true);
  build_storage();
}

Block::~Block() {
  try {
    wait_pending_updates();  // nothing may still write into the shards we are about to free
  } catch (...) {
  }
  for (auto& s : slots_) {
    if (ParamMeta* m = find_meta(s->param)) m->block = nullptr;
    forget_param(s->param);
  }
  memory::add_shard_bytes(-shard_nbytes());
  memory::add_grad_bytes(-grad_nbytes());
  memory::add_full_bytes(-full_nbytes());
}

void Block::build_storage() {
  std::map<std::tuple<int, core::Communicator*, int>, size_t> group_of;
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    ParamMeta* m = find_meta(p);
    BMT_CHECK(m != nullptr, "Block: parameter '", item.key(), "' (shape ", p.sizes(), ") is a plain tensor; every "
              "parameter inside a Block must be a bmt::DistributedParameter (use bmt::nn layers or create it with "
              "bmt::DistributedParameter)");
    BMT_CHECK(m->block == nullptr, "Block: parameter '", item.key(), "' already belongs to another Block (a module "
              "wrapped twice, or a parameter shared between two Blocks); wrap each module once and do not share "
              "parameters across Blocks");
    auto key = std::make_tuple(static_cast<int>(m->dtype), m->comm.get(), static_cast<int>(m->tp_grad_reduce));
    auto it = group_of.find(key);
    if (it == group_of.end()) {
      it = group_of.emplace(key, groups_.size()).first;
      auto g = std::make_unique<Group>();
      g->dtype = m->dtype;
      g->comm = m->comm;
      g->tp_grad_reduce = m->tp_grad_reduce;
      groups_.push_back(std::move(g));
    }
    Group& g = *groups_[it->second];
    auto slot = std::make_unique<Slot>();
    slot->param = p;
    slot->name = item.key();
    slot->group = it->second;
    slot->numel = m->full_numel;
    slot->shape = m->full_shape;
    slot->offset = g.used_numel;
    g.used_numel = round_up(g.used_numel + m->full_numel, kAlignBytes / static_cast<int64_t>(c10::elementSize(g.dtype)));
    slots_.push_back(std::move(slot));
  }
  const auto dev = config().device;
  for (auto& g : groups_) {
    const int ws = g->comm->size();
    g->partition_numel = (g->used_numel + ws - 1) / ws;
    g->shard = at::zeros({g->partition_numel}, at::TensorOptions().dtype(g->dtype).device(dev));
    // The gradient shard (fp32: twice a bf16 shard) waits for its first use, so building a model holds only the
    // parameter shards.
    g->grad_shard_options = at::TensorOptions().dtype(grad_dtype_for(g->dtype, options_.reduce_dtype)).device(dev);
  }
  at::NoGradGuard no_grad;
  // Groups some rank already wrote into (agreed over the group: a rank with values needs the others in the gathers).
  std::vector<bool> written(groups_.size(), false);
  for (auto& s : slots_)
    if (!written[s->group] && !bitwise_zero(s->param)) written[s->group] = true;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    core::Communicator& comm = *groups_[gi]->comm;
    if (comm.size() == 1) continue;
    at::Tensor flag = at::full({1}, written[gi] ? 1.0f : 0.0f, at::TensorOptions().device(dev));
    comm.all_reduce(flag.data_ptr(), flag.data_ptr(), 1, core::DType::kFloat32, core::ReduceOp::kMax,
                    current_stream_handle(flag));
    written[gi] = flag.item<float>() != 0.0f;
  }
  for (auto& s : slots_) {
    Group& g = *groups_[s->group];
    const int64_t part_begin = g.partition_numel * g.comm->rank();
    const int64_t lo = std::max(part_begin, s->offset);
    const int64_t hi = std::min(part_begin + g.partition_numel, s->offset + s->numel);
    s->local_begin = hi > lo ? lo - part_begin : 0;
    s->local_numel = std::max<int64_t>(0, hi - lo);
    // Move the current (per-parameter sharded) value into the packed layout, one full parameter at a time. A group
    // nobody wrote yet (a model built before init_parameters) is zeros, as the new shard already is.
    if (written[s->group]) {
      at::Tensor full = gather_full(s->param).reshape({-1});
      if (s->local_numel > 0)
        g.shard.narrow(0, s->local_begin, s->local_numel).copy_(full.narrow(0, lo - s->offset, s->local_numel));
    }
    ParamMeta& m = meta_of(s->param);
    m.block = this;
    m.shard_begin = s->local_numel > 0 ? lo - s->offset : 0;
    m.shard_end = m.shard_begin + s->local_numel;
    set_lazy_main_grad(s->param, [this, gi = s->group] {
      Group& group = *groups_[gi];
      if (!group.grad_lazy) return;
      grad_shard_of(gi).zero_();  // no gradient accumulated yet
      group.grad_fresh = false;
    });
    set_replication(s->param, replication_of(m, config().zero_size));
  }
  point_at_shard();
  memory::add_shard_bytes(shard_nbytes());
  memory::add_grad_bytes(grad_nbytes());
#if defined(__GLIBC__)
  // The per-parameter shards just replaced go back to glibc's heap, which keeps their pages while longer-lived
  // allocations sit between them: building llama-7b's layers on CPU grew ~30 MB per layer above the shards.
  if (dev.is_cpu()) malloc_trim(0);
#endif
}

int64_t Block::shard_nbytes() const {
  int64_t n = 0;
  for (auto& g : groups_) n += g->shard.nbytes();
  return n;
}
int64_t Block::full_nbytes() const {
  int64_t n = 0;
  for (auto& g : groups_)
    if (g->owns_full()) n += g->full.nbytes();
  return n;
}
int64_t Block::gathered_storage_nbytes() const {
  int64_t n = 0;
  for (auto& g : groups_)
    if (g->full_store.defined()) n += static_cast<int64_t>(g->full_store.storage().nbytes());
  return n;
}
int64_t Block::grad_nbytes() const {
  int64_t n = 0;
  for (auto& g : groups_) {
    if (g->grad_shard.defined()) n += g->grad_shard.nbytes();
    if (g->deferred_grad_full.defined()) n += g->deferred_grad_full.nbytes();
  }
  return n;
}

at::Tensor Block::materialize_full(Group& g) {
  const int64_t numel = g.partition_numel * g.comm->size();
  if (!g.full_store.defined()) {
    g.full_store = at::empty({numel}, g.shard.options());
    return g.full_store;
  }
  c10::StorageImpl* impl = g.full_store.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(numel) * g.full_store.element_size();
  if (impl->nbytes() == 0) {  // freed by release(): allocate again (on the current stream) into the same storage
    impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
    impl->set_nbytes(nbytes);
  }
  return g.full_store;
}

void Block::prefetch() {
  if (num_pending_updates() > 0)
    for (auto& s : slots_)
      if (auto update = find_pending_update(s->param); update && !update->host_done()) return;
  gather_buffers();
}

void Block::wait_pending_updates() {
  if (num_pending_updates() == 0) return;
  for (auto& s : slots_) wait_pending_update(s->param);
}

void Block::gather_buffers() {
  if (buffers_ready_) return;
  wait_pending_updates();  // host, and on CUDA the compute stream waits for the copies back (ordered before comm)
  auto calc = calc_stream();
  auto comm_s = load_stream();
  stream_wait(comm_s, calc);  // the shards may have just been updated by the optimizer
  for (auto& g : groups_) {
    const int ws = g->comm->size();
    if (ws == 1) {
      // One rank: the shard is the whole buffer. Aliasing it costs no copy and no memory, and views autograd
      // saves in forward point at storage that lives anyway.
      g->full = g->shard;
      continue;
    }
    std::optional<c10::StreamGuard> guard;
    if (comm_s) guard.emplace(*comm_s);
    g->full = materialize_full(*g);
    g->comm->all_gather(g->shard.data_ptr(), g->full.data_ptr(), g->partition_numel, to_core_dtype(g->dtype),
                        comm_s ? comm_s->native_handle() : nullptr);
    if (comm_s) {
      g->ready.emplace(comm_s->device_type());
      g->ready->record(*comm_s);
    }
  }
  buffers_ready_ = true;
  memory::add_full_bytes(full_nbytes());
}

void Block::gather() {
  gather_buffers();
  point_at_full();
}

void Block::point_at_full() {
  auto calc = calc_stream();
  for (auto& g : groups_) {
    if (g->ready && calc) {
      g->ready->block(*calc);
      g->full.record_stream(*calc);
      g->ready.reset();
    }
  }
  for (auto& s : slots_) {
    Group& g = *groups_[s->group];
    if (!views_source(s->full_view, g.full))
      s->full_view = g.full.narrow(0, s->offset, s->numel).view(s->shape);
    s->param.set_data(s->full_view);
  }
  gathered_ = true;
}

void Block::point_at_shard() {
  for (auto& s : slots_) {
    Group& g = *groups_[s->group];
    if (!views_source(s->shard_view, g.shard)) s->shard_view = g.shard.narrow(0, s->local_begin, s->local_numel);
    s->param.set_data(s->shard_view);
  }
  gathered_ = false;
}

void Block::release() {
  point_at_shard();
  if (!buffers_ready_) return;
  memory::add_full_bytes(-full_nbytes());
  for (auto& g : groups_) {
    if (g->owns_full()) free_bytes(g->full);
    g->full = at::Tensor();
    g->ready.reset();
  }
  buffers_ready_ = false;
}

namespace {
thread_local CallContext current_context;

// Makes a call context current for the scope (restoring the previous one: forward functions may nest Blocks).
class ContextScope {
 public:
  explicit ContextScope(const CallContext& c) : previous_(std::move(current_context)) { current_context = c; }
  ~ContextScope() { current_context = std::move(previous_); }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CallContext previous_;
};
}  // namespace

const CallContext& Block::current_call_context() { return current_context; }

std::vector<at::Tensor> Block::call_forward_fn(const std::vector<at::Tensor>& inputs, const CallContext& context) {
  ContextScope scope(context);
  return forward_fn_(inputs);
}

std::vector<at::Tensor> Block::forward(const std::vector<at::Tensor>& inputs, CallContext context) {
  bool any_grad = false;
  for (auto& t : inputs) any_grad = any_grad || (t.defined() && t.requires_grad());
  bool param_grad = false;
  for (auto& s : slots_) param_grad = param_grad || s->param.requires_grad();
  if (!at::GradMode::is_enabled() || (!any_grad && !param_grad)) {
    // Inference: gather, run, free. No graph, no recompute.
    gather();
    std::vector<at::Tensor> out;
    try {
      at::NoGradGuard guard;
      out = call_forward_fn(inputs, context);
    } catch (...) {
      release();
      throw;
    }
    release();
    return out;
  }
  variable_list args(inputs.begin(), inputs.end());
  args.push_back(anchor_);
  ContextScope scope(context);  // BlockFn::forward keeps it in the call's state
  return BlockFn::apply(reinterpret_cast<int64_t>(this), at::TensorList(args));
}

std::vector<at::Tensor> Block::run_forward(CallState& state, const std::vector<at::Tensor>& inputs) {
  state.inputs = inputs;
  for (auto& t : inputs) state.input_requires_grad.push_back(t.defined() && t.requires_grad());
  gather();
  if (options_.use_checkpoint) state.rng = save_rng();  // only a recompute draws the same numbers again
  std::vector<at::Tensor> out;
  try {
    if (options_.use_checkpoint) {
      const auto mark = inspect::detail::mark();
      const bool keep = options_.keep_for_recompute && detail::keep_for_recompute_enabled();
      detail::RecomputeScope phase(keep ? RecomputePhase::kFirstRun : RecomputePhase::kNone, keep ? &state.kept : nullptr);
      out = call_forward_fn(inputs, state.context);  // grad mode is off inside an autograd Function's forward
      state.inspect_span = inspect::detail::span_since(mark);
    } else {
      at::AutoGradMode enable(true);
      for (size_t i = 0; i < inputs.size(); ++i) {
        at::Tensor t = inputs[i].defined() ? inputs[i].detach() : inputs[i];
        if (state.input_requires_grad[i]) t.requires_grad_(true);
        state.graph_inputs.push_back(t);
      }
      state.graph_outputs = call_forward_fn(state.graph_inputs, state.context);
      for (auto& o : state.graph_outputs) out.push_back(o.detach());
    }
  } catch (...) {
    release();
    throw;
  }
  if (zero_level_ == 3) release();
  else point_at_shard();  // ZeRO-2: keep the full buffers for the backward
  return out;
}

std::vector<at::Tensor> Block::run_backward(CallState& state, const std::vector<at::Tensor>& grad_outputs) {
  gather();
  if (prev_in_list_ && prev_in_list_->zero_level_ == 3) prev_in_list_->prefetch();  // overlap on GPU
  std::vector<at::Tensor> graph_inputs, outputs;
  if (options_.use_checkpoint) {
    g_recompute_count.fetch_add(1);
    RngState now = save_rng();
    restore_rng(state.rng);
    at::AutoGradMode enable(true);
    for (size_t i = 0; i < state.inputs.size(); ++i) {
      at::Tensor t = state.inputs[i].defined() ? state.inputs[i].detach() : state.inputs[i];
      if (state.input_requires_grad[i]) t.requires_grad_(true);
      graph_inputs.push_back(t);
    }
    {
      inspect::detail::ReplayScope replay(state.inspect_span);  // record_tensor: hooks only, no second record
      detail::RecomputeScope phase(RecomputePhase::kRecompute, &state.kept);
      outputs = call_forward_fn(graph_inputs, state.context);
    }
    state.kept.values.clear();  // what was not taken (the graph holds what was)
    restore_rng(now);
  } else {
    graph_inputs = state.graph_inputs;
    outputs = state.graph_outputs;
  }
  std::vector<at::Tensor> outs, gouts, targets;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined() || !outputs[i].requires_grad()) continue;
    outs.push_back(outputs[i]);
    gouts.push_back(i < grad_outputs.size() && grad_outputs[i].defined() ? grad_outputs[i] : at::zeros_like(outputs[i]));
  }
  std::vector<int> input_index;
  for (size_t i = 0; i < graph_inputs.size(); ++i)
    if (state.input_requires_grad[i]) {
      input_index.push_back(static_cast<int>(i));
      targets.push_back(graph_inputs[i]);
    }
  std::vector<size_t> slot_index;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i]->param.requires_grad()) {
      slot_index.push_back(i);
      targets.push_back(slots_[i]->param);
    }
  std::vector<at::Tensor> grads;
  if (!outs.empty() && !targets.empty())
    grads = torch::autograd::grad(outs, targets, gouts, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
  else
    grads.resize(targets.size());
  state.graph_inputs.clear();
  state.graph_outputs.clear();
  point_at_shard();
  std::vector<at::Tensor> param_grads(slots_.size());
  for (size_t k = 0; k < slot_index.size(); ++k) param_grads[slot_index[k]] = grads[input_index.size() + k];
  reduce_gradients(param_grads);
  release();
  if (grad_sync_enabled()) run_grad_ready_hooks(*this);
  std::vector<at::Tensor> input_grads(state.inputs.size());
  for (size_t k = 0; k < input_index.size(); ++k) input_grads[input_index[k]] = grads[k];
  return input_grads;
}

at::Tensor Block::gather_param_copy(const at::Tensor& param) {
  for (auto& s : slots_) {
    if (!s->param.is_same(param)) continue;
    bool had = buffers_ready_;
    gather_buffers();
    auto calc = calc_stream();
    Group& g = *groups_[s->group];
    if (g.ready && calc) {
      g.ready->block(*calc);
      g.full.record_stream(*calc);  // release() below must not let the allocator reuse it before the clone ran
    }
    at::Tensor copy = g.full.narrow(0, s->offset, s->numel).view(s->shape).clone();
    if (!had) release();
    return copy;
  }
  BMT_ASSERT(false, "parameter not found in its Block");
}

void Block::scatter_param(const at::Tensor& param, const at::Tensor& full) {
  wait_pending_update(param);  // an update still running would overwrite (or race with) the new value
  for (auto& s : slots_) {
    if (!s->param.is_same(param)) continue;
    Group& g = *groups_[s->group];
    const int64_t part_begin = g.partition_numel * g.comm->rank();
    const int64_t lo = part_begin + s->local_begin;
    if (s->local_numel > 0)
      g.shard.narrow(0, s->local_begin, s->local_numel)
          .copy_(full.reshape({-1}).narrow(0, lo - s->offset, s->local_numel));
    return;
  }
  BMT_ASSERT(false, "parameter not found in its Block");
}

}  // namespace bmt
