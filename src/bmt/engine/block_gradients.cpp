// Block: packing and reducing parameter gradients into the gradient shards, deferred reduction (GradSyncGuard)
// and the grad-ready hooks run after a Block's gradients are reduced.
#include <c10/core/StreamGuard.h>

#include <map>
#include <optional>
#include <utility>

#include "bmt/engine/block.h"
#include "bmt/engine/block_internal.h"
#include "bmt/core/kernels/accumulate_internal.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/param_meta_internal.h"
#include "bmt/params/parameter.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt {
namespace {

int g_grad_sync_disabled = 0;
struct RegisteredHook {
  GradReadyHook on_ready;
  GradTakeoverQuery takes_over;
};
std::map<int, RegisteredHook>& grad_ready_hooks() {
  static std::map<int, RegisteredHook> hooks;
  return hooks;
}
int g_next_hook_id = 0;
EnvSwitch g_handover_switch("BMT_GRADIENT_HANDOVER");

// dst += src (same numel). An fp32 CUDA destination with a contiguous half or fp32 source takes the vectorised
// kernel (torch's mixed-dtype add is an unvectorised casting loop, ~2x slower); everything else at::add_.
void accumulate_into(const at::Tensor& dst, const at::Tensor& src) {
#ifdef BMT_WITH_CUDA
  if (dst.is_cuda() && dst.scalar_type() == at::kFloat && dst.is_contiguous() && src.is_contiguous() &&
      src.device() == dst.device() &&
      (src.scalar_type() == at::kBFloat16 || src.scalar_type() == at::kHalf || src.scalar_type() == at::kFloat)) {
    core::kernels::accumulate_fp32_cuda(dst.data_ptr<float>(), src.data_ptr(), to_core_dtype(src.scalar_type()),
                                        dst.numel(), current_stream_handle(dst));
    return;
  }
#endif
  dst.add_(src);
}

// Points a parameter at its slice of its Block's gradient shard: the gradient the optimizers read (main_grad) and,
// when the shard has the parameter's dtype, its .grad (BMTrain's: the shard's gradient in place). A frozen parameter
// gets neither (torch leaves .grad alone for requires_grad=False), so clipping, inspection and the optimizers skip it.
void expose_gradient(const at::Tensor& param, const at::Tensor& view, bool as_own_grad) {
  if (!param.requires_grad()) {
    set_main_grad(param, at::Tensor());
    return;
  }
  set_main_grad(param, view);
  if (as_own_grad) param.mutable_grad() = view;
}

}  // namespace

void run_grad_ready_hooks(Block& block) {
  for (auto& kv : grad_ready_hooks()) kv.second.on_ready(block);
}

bool gradients_taken_over(const Block& block) {
  if (!g_handover_switch.enabled()) return false;
  for (auto& kv : grad_ready_hooks())
    if (kv.second.takes_over && kv.second.takes_over(block)) return true;
  return false;
}

void Block::hand_over_gradients(size_t gi, const std::vector<at::Tensor>& param_grads) {
  Group& g = *groups_[gi];
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = *slots_[i];
    if (s.group != gi) continue;
    at::Tensor grad;
    if (param_grads[i].defined()) grad = param_grads[i].reshape({-1});
    else if (s.param.requires_grad()) grad = at::zeros({s.numel}, s.param.options().requires_grad(false));
    set_main_grad(s.param, grad);  // the optimizer reads any float dtype (and takes a contiguous copy if need be)
  }
  g.grad_handed_over = true;
  g.grad_lazy = false;
}

void Block::adopt_handed_over_gradients(size_t gi) {
  Group& g = *groups_[gi];
  std::vector<at::Tensor> held(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i]->group == gi) held[i] = peek_main_grad(slots_[i]->param);
  g.grad_handed_over = false;
  at::Tensor& shard = grad_shard_of(gi);  // points the main gradients at the shard again
  shard.zero_();
  for (size_t i = 0; i < slots_.size(); ++i)
    if (held[i].defined()) shard.narrow(0, slots_[i]->offset, slots_[i]->numel).copy_(held[i].reshape({-1}));
  g.grad_fresh = false;
}

at::Tensor Block::packed_gradient(const Group& g, size_t gi, const std::vector<at::Tensor>& param_grads) const {
  // Every element is written once: parameter gradients (zeros where a parameter got none) and the alignment gaps.
  at::Tensor flat = at::empty({g.partition_numel * g.comm->size()}, g.grad_shard_options);
  int64_t filled = 0;  // slots of a group are laid out in increasing offsets
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = *slots_[i];
    if (s.group != gi) continue;
    if (s.offset > filled) flat.narrow(0, filled, s.offset - filled).zero_();
    at::Tensor dst = flat.narrow(0, s.offset, s.numel);
    if (param_grads[i].defined()) dst.copy_(param_grads[i].reshape({-1}));
    else dst.zero_();
    filled = s.offset + s.numel;
  }
  if (flat.numel() > filled) flat.narrow(0, filled, flat.numel() - filled).zero_();
  return flat;
}

at::Tensor& Block::grad_shard_of(size_t gi) {
  Group& g = *groups_[gi];
  if (!g.grad_released) return g.grad_shard;
  // Not zeroed: the reduction that asked for it writes every element (grad_fresh), sparing a memset of the shard.
  g.grad_shard = at::empty({g.partition_numel}, g.grad_shard_options);
  g.grad_released = false;
  g.grad_lazy = false;
  g.grad_fresh = true;
  memory::add_grad_bytes(g.grad_shard.nbytes());
  for (auto& s : slots_)
    if (s->group == gi)
      expose_gradient(s->param, g.grad_shard.narrow(0, s->local_begin, s->local_numel),
                      g.grad_shard.scalar_type() == g.dtype);
  return g.grad_shard;
}

void Block::release_gradients() {
  wait_for_gradient_reduction();  // the compute stream (whose allocations may reuse the bytes) after the reduction
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    g.grad_lazy = false;  // released before its first use: reads see no gradient, as after any release
    if (g.grad_handed_over) {
      for (auto& s : slots_)
        if (s->group == gi) set_main_grad(s->param, at::Tensor());
      g.grad_handed_over = false;
      continue;
    }
    if (g.grad_released || !g.grad_shard.defined()) continue;
    BMT_CHECK(!g.deferred_grad_full.defined(), "Block::release_gradients (", module_->name(), "): gradients of "
              "micro-batches accumulated under GradSyncGuard are not reduced yet; release them after the reduction");
    for (auto& s : slots_) {
      if (s->group != gi) continue;
      set_main_grad(s->param, at::Tensor());
      if (s->param.grad().defined()) s->param.mutable_grad().reset();
    }
    // Stream order makes this safe: the reduction (comm stream) was waited for by the update that read it, and
    // the caching allocator hands the bytes only to work queued after that update on the same stream.
    memory::add_grad_bytes(-g.grad_shard.nbytes());
    g.grad_shard = at::Tensor();
    g.grad_released = true;
  }
}

void Block::reduce_gradients(const std::vector<at::Tensor>& param_grads) {
  auto calc = calc_stream();
  auto comm_s = load_stream();
  std::optional<bool> taken_over;  // asked once per reduction, only where it matters
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    if (g.grad_handed_over) adopt_handed_over_gradients(gi);  // still held: accumulate into them
    if (grad_sync_enabled() && !g.grad_released) {
      // Every reduction points the parameters at the shard again, as BMTrain does after each backward: a .grad set
      // to None since (zero_grad(set_to_none=True)) comes back, and requires_grad changed since is honoured.
      for (auto& s : slots_)
        if (s->group == gi)
          expose_gradient(s->param, g.grad_shard.narrow(0, s->local_begin, s->local_numel),
                          g.grad_shard.scalar_type() == g.dtype);
    }
    const bool one_rank_direct = g.comm->size() == 1 && grad_sync_enabled() && g.grad_released &&
                                 !g.deferred_grad_full.defined() && g.tp_grad_reduce == TpGradReduce::kNone;
    if (one_rank_direct) {
      if (!taken_over) taken_over = gradients_taken_over(*this);
      if (*taken_over) {
        hand_over_gradients(gi, param_grads);
        continue;
      }
    }
    bool any = false;
    for (size_t i = 0; i < slots_.size(); ++i) any = any || (slots_[i]->group == gi && param_grads[i].defined());
    // A released shard comes back even without gradients (zeros), as a kept one would hold them: the optimizer
    // then updates these parameters exactly as it would without the release.
    bool fresh = false;
    if (grad_sync_enabled() && g.grad_released) {
      grad_shard_of(gi);
      fresh = std::exchange(g.grad_fresh, false);
    }
    if (!any && !g.deferred_grad_full.defined()) {
      if (fresh) g.grad_shard.zero_();
      continue;
    }
    const at::ScalarType rdt = c10::typeMetaToScalarType(g.grad_shard_options.dtype());
    const int ws = g.comm->size();
    if (ws == 1 && grad_sync_enabled() && !g.deferred_grad_full.defined() && g.tp_grad_reduce == TpGradReduce::kNone) {
      // One rank, nothing to reduce: accumulate straight into the shard (same layout), on the compute stream; a
      // fresh shard is written (copies, zeros for the alignment gaps and parameters without a gradient).
      int64_t filled = 0;
      for (size_t i = 0; i < slots_.size(); ++i) {
        const Slot& s = *slots_[i];
        if (s.group != gi) continue;
        at::Tensor dst = g.grad_shard.narrow(0, s.offset, s.numel);
        if (fresh) {
          if (s.offset > filled) g.grad_shard.narrow(0, filled, s.offset - filled).zero_();
          if (param_grads[i].defined()) dst.copy_(param_grads[i].reshape({-1}));
          else dst.zero_();
          filled = s.offset + s.numel;
        } else if (param_grads[i].defined()) {
          accumulate_into(dst, param_grads[i].reshape({-1}));
        }
      }
      if (fresh && g.grad_shard.numel() > filled) g.grad_shard.narrow(0, filled, g.grad_shard.numel() - filled).zero_();
      continue;
    }
    at::Tensor flat = packed_gradient(g, gi, param_grads);
    if (!grad_sync_enabled()) {
      if (!g.deferred_grad_full.defined()) {
        g.deferred_grad_full = flat;
        memory::add_grad_bytes(flat.nbytes());
      } else {
        g.deferred_grad_full.add_(flat);
      }
      continue;
    }
    if (g.deferred_grad_full.defined()) {
      flat.add_(g.deferred_grad_full);
      memory::add_grad_bytes(-g.deferred_grad_full.nbytes());
      g.deferred_grad_full = at::Tensor();
    }
    stream_wait(comm_s, calc);
    std::optional<c10::StreamGuard> guard;
    if (comm_s) {
      guard.emplace(*comm_s);
      flat.record_stream(*comm_s);
    }
    // A fresh shard takes the reduction directly (no copy); the comm stream waited for the compute stream, which
    // allocated it, and its readers wait for the reduction.
    at::Tensor mine = fresh ? g.grad_shard : at::empty({g.partition_numel}, flat.options());
    g.comm->reduce_scatter(flat.data_ptr(), mine.data_ptr(), g.partition_numel, to_core_dtype(rdt), options_.reduce_op,
                           comm_s ? comm_s->native_handle() : nullptr);
    reduce_over_tp(mine, g.tp_grad_reduce);  // on the comm stream (current under the guard)
    if (!fresh) g.grad_shard.add_(mine);
    // A script may read p.grad right after backward() (BMTrain's tests do): its stream must not race the comm
    // stream (seen on 2 H200s as checkpointed attention gradients read half-reduced).
    if (comm_s) wait_for_gradient_reduction_after_backward();
  }
}

int add_grad_ready_hook(GradReadyHook hook, GradTakeoverQuery takes_over) {
  grad_ready_hooks()[g_next_hook_id] = RegisteredHook{std::move(hook), std::move(takes_over)};
  return g_next_hook_id++;
}
void remove_grad_ready_hook(int id) { grad_ready_hooks().erase(id); }

GradSyncGuard::GradSyncGuard() { ++g_grad_sync_disabled; }
GradSyncGuard::~GradSyncGuard() { --g_grad_sync_disabled; }
bool grad_sync_enabled() { return g_grad_sync_disabled == 0; }

namespace detail {
bool gradient_handover_enabled() { return g_handover_switch.enabled(); }
void set_gradient_handover_enabled(bool on) { g_handover_switch.set(on); }
}  // namespace detail

}  // namespace bmt
