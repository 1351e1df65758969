// PipelineTransformerBlockList::forward_autograd: BMTrain's forward-then-autograd pipeline interface over the same
// stages, transfers and Blocks as forward_backward (GPipe order: the loss lives outside the list, so every forward
// runs before any backward).
#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <optional>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/pipeline/pipeline.h"
#include "bmt/pipeline/pipeline_p2p_internal.h"
#include "bmt/runtime/stream_sync.h"

namespace bmt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What one call keeps from its forward for its backward.
struct PipeRun : torch::CustomClassHolder {
  int num_hidden = 1;
  int64_t local_rows = 0;  // b: rows of this stage's own batch
  std::vector<bool> batched;  // per input: split by rows (hidden states and extras with first dim b)
  std::vector<bool> wants_grad;  // per input: requires grad (gets a gradient back)
  std::vector<std::vector<at::Tensor>> inputs;   // per micro-batch: hidden states entering this stage (leaves)
  std::vector<std::vector<at::Tensor>> extras;   // per micro-batch: the extra args given to the layers
  std::vector<std::vector<at::Tensor>> outputs;  // per micro-batch: this stage's outputs (with graph)
  std::vector<std::vector<int64_t>> gathered_shapes;  // per input: shape after concatenating the stages
};

// Runs fn on link.stream (after the work queued on the compute stream, before the work queued later): every
// operation on the pipe communicator stays on one stream, as pipe_transfer's do.
template <typename Fn>
at::Tensor on_pipe_stream(const detail::PipeLink& link, Fn&& fn) {
  const std::optional<c10::Stream> calc = calc_stream(), pp = link.stream;
  stream_wait(pp, calc);
  at::Tensor out;
  {
    std::optional<c10::StreamGuard> guard;
    if (pp) guard.emplace(*pp);
    out = fn();
  }
  if (pp) out.record_stream(*calc);
  stream_wait(calc, pp);
  return out;
}

// The stages' tensors concatenated along dim 0 in stage order.
at::Tensor gather_stages(const at::Tensor& x, const detail::PipeLink& link) {
  core::Communicator& comm = *link.comm;
  at::Tensor c = x.detach().contiguous();
  at::Tensor all = on_pipe_stream(link, [&] { return distributed::raw_all_gather(c, comm); });
  if (link.stream) c.record_stream(*link.stream);
  return all.flatten(0, 1);
}

at::Tensor sum_stages(const at::Tensor& x, const detail::PipeLink& link) {
  core::Communicator& comm = *link.comm;
  at::Tensor c = x.contiguous();
  at::Tensor out = on_pipe_stream(link, [&] { return distributed::raw_all_reduce(c, core::ReduceOp::kSum, comm); });
  if (link.stream) c.record_stream(*link.stream);
  return out;
}

bool is_float(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

at::Tensor grad_or_zeros(const at::Tensor& x) {
  return x.grad().defined() ? x.grad() : at::zeros_like(x);
}

}  // namespace

struct PipeAutogradFn : torch::autograd::Function<PipeAutogradFn> {
  static variable_list forward(AutogradContext* ctx, int64_t self_ptr, int64_t num_hidden, CallContext context,
                               const at::Tensor& placeholder, at::TensorList inputs) {
    (void)placeholder;  // only makes the outputs require grad when no input does (parameters inside the layers)
    auto* self = reinterpret_cast<PipelineTransformerBlockList*>(self_ptr);
    const detail::PipeLink& link = *self->link_;
    const int H = static_cast<int>(num_hidden), M = self->micro_batches_, P = self->stages_, S = self->stage_;
    auto run = c10::make_intrusive<PipeRun>();
    run->num_hidden = H;
    run->local_rows = inputs[0].dim() > 0 ? inputs[0].size(0) : 0;
    const int64_t b = run->local_rows, rows = b * P;
    BMT_CHECK(b > 0, "PipelineTransformerBlockList: the hidden state needs a batch dimension (got shape ",
              inputs[0].sizes(), ")");
    BMT_CHECK(rows % M == 0, "PipelineTransformerBlockList: the stages' batches hold ", rows, " rows (", b,
              " per stage x ", P, " stages), not divisible by num_micro_batches ", M,
              "; choose a batch size or num_micro_batches so that they divide");
    const int64_t per_micro = rows / M;
    // Concatenate the stages' batches (every stage needs the batched extras; the first the hidden states too).
    std::vector<at::Tensor> full(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& x = inputs[i];
      const bool batched = static_cast<int>(i) < H || (x.dim() > 0 && x.size(0) == b);
      run->batched.push_back(batched);
      run->wants_grad.push_back(x.requires_grad() && is_float(x));
      if (batched) {
        BMT_CHECK(x.dim() > 0 && x.size(0) == b, "PipelineTransformerBlockList: hidden state ", i, " has shape ",
                  x.sizes(), " but the first has ", b, " rows; every hidden state needs the same batch size");
        full[i] = gather_stages(x, link);
      } else {
        BMT_CHECK(!x.requires_grad(), "PipelineTransformerBlockList: extra argument ", i - H, " (shape ", x.sizes(),
                  ") requires grad but has no batch dimension of ", b,
                  " rows; only per-row extras can carry gradients through the pipeline: give it a batch dimension "
                  "or detach it");
        full[i] = x;
      }
      run->gathered_shapes.push_back(full[i].sizes().vec());
    }
    core::Communicator& comm = *link.comm;
    for (int m = 0; m < M; ++m) {
      std::vector<at::Tensor> h, extra;
      if (S == 0) {
        for (int i = 0; i < H; ++i) h.push_back(full[i].narrow(0, m * per_micro, per_micro).detach());
      } else {
        detail::PipeTransfer t;
        t.recv_acts = H;
        t.act_from = S - 1;
        h = detail::pipe_transfer(link, t);
      }
      for (auto& x : h)
        if (is_float(x)) x.requires_grad_(true);
      for (size_t i = H; i < inputs.size(); ++i) {
        if (!run->batched[i]) {
          extra.push_back(full[i]);
          continue;
        }
        at::Tensor e = full[i].narrow(0, m * per_micro, per_micro).detach();
        if (inputs[i].requires_grad() && is_float(e)) e.requires_grad_(true);
        extra.push_back(e);
      }
      std::vector<at::Tensor> args = h;
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<at::Tensor> out;
      {
        at::AutoGradMode grad(ctx != nullptr);  // a graph only when a backward will follow
        out = self->list_->forward(std::move(args), H, false, context);
      }
      if (S + 1 < P) {
        detail::PipeTransfer t;
        for (auto& o : out) t.send_acts.push_back(o.detach());
        t.act_to = S + 1;
        detail::pipe_transfer(link, t);
      }
      run->inputs.push_back(std::move(h));
      run->extras.push_back(std::move(extra));
      run->outputs.push_back(std::move(out));
    }
    // The last stage's output goes to every stage; each keeps its own rows.
    variable_list result;
    for (int i = 0; i < H; ++i) {
      at::Tensor all;
      if (S == P - 1) {
        std::vector<at::Tensor> parts;
        for (auto& o : run->outputs) parts.push_back(o[static_cast<size_t>(i)].detach());
        all = at::cat(parts, 0);
        BMT_CHECK(all.sizes().vec() == run->gathered_shapes[static_cast<size_t>(i)] &&
                      all.scalar_type() == inputs[static_cast<size_t>(i)].scalar_type(),
                  "PipelineTransformerBlockList: hidden state ", i, " leaves the last layer with shape ", all.sizes(),
                  " and dtype ", all.scalar_type(), " but entered with ", at::IntArrayRef(run->gathered_shapes[i]),
                  " and ", inputs[static_cast<size_t>(i)].scalar_type(), "; the layers must keep them");
        all = all.contiguous();
      } else {
        all = at::empty(run->gathered_shapes[static_cast<size_t>(i)], inputs[static_cast<size_t>(i)].options());
      }
      if (P > 1) {
        at::Tensor src = all;
        all = on_pipe_stream(link, [&] { return distributed::raw_broadcast(src, P - 1, comm); });
      }
      result.push_back(all.narrow(0, S * b, b).clone());
    }
    if (ctx) {
      ctx->saved_data["self"] = self_ptr;
      ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    }
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto* self = reinterpret_cast<PipelineTransformerBlockList*>(ctx->saved_data["self"].toInt());
    auto run = c10::static_intrusive_pointer_cast<PipeRun>(ctx->saved_data["run"].toCapsule());
    const detail::PipeLink& link = *self->link_;
    const int H = run->num_hidden, M = self->micro_batches_, P = self->stages_, S = self->stage_;
    BMT_CHECK(static_cast<int>(run->outputs.size()) == M, "PipelineTransformerBlockList: backward ran twice over "
              "one forward, or num_micro_batches changed in between");
    const int64_t b = run->local_rows, per_micro = b * P / M;
    // Every stage's rows of the output gradient, for the last stage.
    std::vector<at::Tensor> out_grads;
    for (int i = 0; i < H; ++i) {
      at::Tensor g = grad_outputs[static_cast<size_t>(i)];
      if (!g.defined()) {
        std::vector<int64_t> shape = run->gathered_shapes[static_cast<size_t>(i)];
        shape[0] = b;
        g = at::zeros(shape, run->outputs[0][static_cast<size_t>(i)].options());
      }
      out_grads.push_back(P > 1 ? gather_stages(g, link) : g.contiguous());
    }
    std::optional<GradSyncGuard> defer;  // the Blocks reduce their gradients once, in the last backward
    for (int m = 0; m < M; ++m) {
      std::vector<at::Tensor>& outs = run->outputs[static_cast<size_t>(m)];
      std::vector<at::Tensor> grads;
      if (S == P - 1) {
        for (int i = 0; i < H; ++i) grads.push_back(out_grads[static_cast<size_t>(i)].narrow(0, m * per_micro, per_micro));
      } else {
        detail::PipeTransfer t;
        for (auto& o : outs) t.recv_grads.push_back(at::empty_like(o, at::MemoryFormat::Contiguous));
        t.grad_from = S + 1;
        detail::pipe_transfer(link, t);
        grads = t.recv_grads;
      }
      if (m == M - 1) defer.reset();
      else if (!defer) defer.emplace();
      std::vector<at::Tensor> o, g;
      for (size_t i = 0; i < outs.size(); ++i)
        if (outs[i].requires_grad()) {
          o.push_back(outs[i]);
          g.push_back(grads[i]);
        }
      if (!o.empty()) {
        at::AutoGradMode grad(true);
        torch::autograd::backward(o, g);
      }
      outs.clear();
      if (S > 0) {
        detail::PipeTransfer t;
        for (auto& x : run->inputs[static_cast<size_t>(m)]) t.send_grads.push_back(grad_or_zeros(x));
        t.grad_to = S - 1;
        detail::pipe_transfer(link, t);
      }
    }
    defer.reset();
    // Input gradients: the first stage's for the hidden states, every stage's for the batched extras; each stage
    // takes back its own rows.
    variable_list result(4);  // self, num_hidden, context, placeholder
    const size_t n_inputs = run->batched.size();
    for (size_t i = 0; i < n_inputs; ++i) {
      const bool hidden = static_cast<int>(i) < H;
      if (!run->batched[i] || !run->wants_grad[i]) {
        // (requires_grad of an input is the same on every stage: the stages run the same model code)
        result.emplace_back();
        continue;
      }
      at::Tensor full;
      if (hidden && S != 0) {
        full = at::zeros(run->gathered_shapes[i], run->inputs[0][i].options());
      } else {
        std::vector<at::Tensor> parts;
        for (int m = 0; m < M; ++m) {
          const at::Tensor& x = hidden ? run->inputs[static_cast<size_t>(m)][i]
                                       : run->extras[static_cast<size_t>(m)][i - static_cast<size_t>(H)];
          parts.push_back(x.requires_grad() ? grad_or_zeros(x) : at::zeros_like(x));
        }
        full = at::cat(parts, 0);
      }
      if (P > 1) full = sum_stages(full, link);
      result.push_back(full.narrow(0, S * b, b).clone());
    }
    run->inputs.clear();
    run->extras.clear();
    run->outputs.clear();
    return result;
  }
};

std::vector<at::Tensor> PipelineTransformerBlockList::forward_autograd(const std::vector<at::Tensor>& inputs,
                                                                       CallContext context) {
  const int H = options_.num_hidden;
  BMT_CHECK(static_cast<int>(inputs.size()) >= H, "PipelineTransformerBlockList: ", inputs.size(),
            " inputs given but num_hidden is ", H);
  if (!at::GradMode::is_enabled()) {
    // No graph: the same transfers, nothing kept.
    at::Tensor none = at::empty({0});
    return PipeAutogradFn::forward(nullptr, reinterpret_cast<int64_t>(this), H, std::move(context), none, inputs);
  }
  at::Tensor placeholder = at::empty({0});
  placeholder.set_requires_grad(true);
  return PipeAutogradFn::apply(reinterpret_cast<int64_t>(this), static_cast<int64_t>(H), std::move(context),
                               placeholder, at::TensorList(inputs));
}

}  // namespace bmt
