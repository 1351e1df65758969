#include "bmt/pipeline/pipeline.h"

#include <c10/core/StreamGuard.h>
#include <torch/autograd.h>

#include <chrono>
#include <memory>
#include <map>
#include <numeric>
#include <optional>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/pipeline/pipeline_p2p_internal.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#endif

namespace bmt {
namespace {

// Sums compute intervals: CUDA events on the current stream (read once at the end), else the host clock.
class BusyTimer {
 public:
  BusyTimer(bool on, const c10::Device& device) : on_(on), cuda_(device.is_cuda()) {}
  void start() {
    if (!on_) return;
#ifdef BMT_WITH_CUDA
    if (cuda_) {
      events_.emplace_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault),
                           std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
      events_.back().first->record();
      return;
    }
#endif
    t0_ = std::chrono::steady_clock::now();
  }
  void stop() {
    if (!on_) return;
#ifdef BMT_WITH_CUDA
    if (cuda_) {
      events_.back().second->record();
      return;
    }
#endif
    host_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  double seconds() {
    double s = host_s_;
#ifdef BMT_WITH_CUDA
    for (auto& e : events_) {
      e.second->synchronize();
      s += e.first->elapsed_time(*e.second) / 1e3;
    }
#endif
    return s;
  }

 private:
  bool on_;
  bool cuda_;  // events on the compute stream (else the host clock)
  double host_s_ = 0;
  std::chrono::steady_clock::time_point t0_;
#ifdef BMT_WITH_CUDA
  std::vector<std::pair<std::unique_ptr<at::cuda::CUDAEvent>, std::unique_ptr<at::cuda::CUDAEvent>>> events_;
#endif
};

bool is_float(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

// What one micro-batch keeps between its forward and its backward on this stage.
struct MicroState {
  std::vector<at::Tensor> inputs;   // received (leaves requiring grad) or produced by step.first
  std::vector<at::Tensor> outputs;  // this stage's outputs (with graph)
  at::Tensor loss;                  // last stage: the scaled loss to back-propagate
  std::vector<at::Tensor> input_grads;
  std::vector<at::Tensor> output_grads;
};

}  // namespace

std::vector<int64_t> PipelineTransformerBlockList::even_partition(int64_t num_layers, int stages) {
  std::vector<int64_t> p(static_cast<size_t>(stages), num_layers / stages);
  for (int64_t s = 0; s < num_layers % stages; ++s) ++p[static_cast<size_t>(s)];
  return p;
}

void PipelineTransformerBlockList::setup(int64_t num_layers) {
  const Config& cfg = config();
  stages_ = cfg.pipe_size;
  stage_ = cfg.pipe_rank;
  link_ = std::make_shared<const detail::PipeLink>(detail::PipeLink{cfg.pipe_comm, cfg.pp_comm_stream, cfg.device});
  num_layers_ = num_layers;
  BMT_CHECK(num_layers >= 0, "PipelineTransformerBlockList: negative layer count ", num_layers);
  BMT_CHECK(options_.num_hidden >= 1, "PipelineTransformerBlockList: num_hidden ", options_.num_hidden,
            " must be >= 1");
  std::vector<int64_t> part = options_.partition.empty() ? even_partition(num_layers, stages_) : options_.partition;
  BMT_CHECK(static_cast<int>(part.size()) == stages_, "PipelineTransformerBlockList: the partition has ",
            part.size(), " entries but pipe_size is ", stages_, "; give one layer count per stage");
  int64_t sum = 0;
  for (int64_t n : part) {
    BMT_CHECK(n >= 0, "PipelineTransformerBlockList: negative layer count in the partition");
    sum += n;
  }
  BMT_CHECK(sum == num_layers, "PipelineTransformerBlockList: the partition covers ", sum, " layers but the model has ",
            num_layers, "; make the per-stage counts sum to ", num_layers);
  starts_.assign(1, 0);
  for (int64_t n : part) starts_.push_back(starts_.back() + n);
  set_num_micro_batches(options_.num_micro_batches > 0 ? options_.num_micro_batches : cfg.num_micro_batches);
  if (stages_ > 1) {
    const bool ends = is_first_stage() || is_last_stage();
    tied_comm_ = cfg.pipe_comm->split(ends ? 0 : 1, stage_, ends ? "pipe_tied" : "pipe_middle");
  }
}

void PipelineTransformerBlockList::tie_first_last(const std::vector<at::Tensor>& params) {
  BMT_CHECK(is_first_stage() || is_last_stage(), "PipelineTransformerBlockList::tie_first_last: stage ", stage_,
            " is neither the first nor the last; only those two hold tied parameters");
  for (const auto& p : params) {
    tied_.push_back(p);
    if (stages_ > 1) set_replication(p, replication(p) * 2);
  }
}

void PipelineTransformerBlockList::register_local(std::vector<std::shared_ptr<Block>> local) {
  const int64_t begin = layer_range().first;
  for (size_t i = 0; i < local.size(); ++i) {
    BMT_CHECK(local[i] != nullptr, "PipelineTransformerBlockList: the Block of layer ", begin + i, " is null");
    register_module(std::to_string(begin + static_cast<int64_t>(i)), local[i]->module());
  }
  list_ = std::make_shared<TransformerBlockList>(std::move(local), options_.prefetch_depth);
}

PipelineTransformerBlockList::PipelineTransformerBlockList(int64_t num_layers, const BlockFactory& make_block,
                                                           PipelineOptions options)
    : options_(std::move(options)) {
  BMT_CHECK(make_block != nullptr, "PipelineTransformerBlockList: make_block is empty");
  setup(num_layers);
  std::vector<std::shared_ptr<Block>> local;
  for (int64_t l = layer_range().first; l < layer_range().second; ++l) local.push_back(make_block(l));
  register_local(std::move(local));
}

PipelineTransformerBlockList::PipelineTransformerBlockList(const std::vector<std::shared_ptr<Block>>& blocks,
                                                           PipelineOptions options)
    : options_(std::move(options)) {
  setup(static_cast<int64_t>(blocks.size()));
  register_local(std::vector<std::shared_ptr<Block>>(blocks.begin() + layer_range().first,
                                                     blocks.begin() + layer_range().second));
}

void PipelineTransformerBlockList::set_num_micro_batches(int m) {
  BMT_CHECK(m >= 1, "PipelineTransformerBlockList: num_micro_batches ", m, " must be >= 1");
  micro_batches_ = m;
}

std::pair<int64_t, int64_t> PipelineTransformerBlockList::get_range_by_stage_id(int s) const {
  BMT_CHECK(s >= 0 && s < stages_, "PipelineTransformerBlockList: stage ", s, " out of range [0, ", stages_, ")");
  return {starts_[static_cast<size_t>(s)], starts_[static_cast<size_t>(s) + 1]};
}

int PipelineTransformerBlockList::get_stage_by_layer_id(int64_t layer) const {
  BMT_CHECK(layer >= 0 && layer < num_layers_, "PipelineTransformerBlockList: layer ", layer, " out of range [0, ",
            num_layers_, ")");
  for (int s = 0; s < stages_; ++s)
    if (layer < starts_[static_cast<size_t>(s) + 1]) return s;
  return stages_ - 1;
}

at::Tensor PipelineTransformerBlockList::broadcast_loss(at::Tensor mean_loss) {
  const detail::PipeLink& link = *link_;
  at::Tensor t = is_last_stage() ? mean_loss.detach().to(at::kFloat).reshape({}).to(link.device).contiguous()
                                 : at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(link.device));
  // On the comm stream, like every other operation on pipe_comm: NCCL kernels of one communicator must not run
  // on two streams in an order that may differ between ranks.
  const std::optional<c10::Stream> calc = calc_stream(), pp = link.stream;
  stream_wait(pp, calc);
  at::Tensor out;
  {
    std::optional<c10::StreamGuard> guard;
    if (pp) guard.emplace(*pp);
    out = distributed::raw_broadcast(t, stages_ - 1, *link.comm);
  }
  if (pp) {
    t.record_stream(*pp);
    out.record_stream(*calc);
  }
  stream_wait(calc, pp);
  return out;
}

at::Tensor PipelineTransformerBlockList::forward_backward(const Step& step) {
  const detail::PipeLink& link = *link_;
  BMT_CHECK(!is_first_stage() || step.first, "PipelineTransformerBlockList::forward_backward: step.first is "
            "needed on the first stage (it makes micro-batch m's hidden states)");
  BMT_CHECK(!is_last_stage() || step.last, "PipelineTransformerBlockList::forward_backward: step.last is needed "
            "on the last stage (it computes micro-batch m's loss)");
  const int M = micro_batches_, H = options_.num_hidden;
  const int prev = stage_ - 1, next = is_last_stage() ? -1 : stage_ + 1;
  std::map<int, MicroState> live;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(link.device));
  // Gradients are reduced over the data-parallel group once, in the last backward.
  std::optional<GradSyncGuard> defer;
  int backwards_done = 0;
  double wait_s = 0;

  auto transfer = [&](detail::PipeTransfer& t) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = detail::pipe_transfer(link, t);
    wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  auto take_received = [&](int m, std::vector<at::Tensor> acts) {
    BMT_CHECK(static_cast<int>(acts.size()) == H, "pipeline: received ", acts.size(), " hidden states, expected ", H);
    for (auto& a : acts)
      if (is_float(a)) a.requires_grad_(true);
    live[m].inputs = std::move(acts);
  };
  auto grads_to_send = [&](int m) {
    MicroState& s = live.at(m);
    std::vector<at::Tensor> g;
    for (auto& x : s.inputs) g.push_back(x.grad().defined() ? x.grad() : at::zeros_like(x));
    return g;
  };
  auto grad_buffers = [&](int m) {
    MicroState& s = live.at(m);
    s.output_grads.clear();
    for (auto& o : s.outputs) s.output_grads.push_back(at::empty_like(o, at::MemoryFormat::Contiguous));
    return s.output_grads;
  };
  auto forward = [&](int m) {
    MicroState& s = live[m];
    if (is_first_stage()) {
      s.inputs = step.first(m);
      BMT_CHECK(static_cast<int>(s.inputs.size()) == H, "pipeline: step.first returned ", s.inputs.size(),
                " tensors but num_hidden is ", H);
    }
    std::vector<at::Tensor> args = s.inputs;
    if (step.extra_args)
      for (auto& e : step.extra_args(m)) args.push_back(e);
    s.outputs = list_->forward(args, H);
    if (is_last_stage()) {
      at::Tensor loss = step.last(m, s.outputs);
      BMT_CHECK(loss.defined() && loss.numel() == 1, "pipeline: step.last must return a scalar loss");
      loss_sum = loss_sum + loss.detach().to(at::kFloat).reshape({}).to(link.device);
      at::Tensor scaled = step.scale_loss ? step.scale_loss(loss) : loss;
      s.loss = scaled / static_cast<double>(M);
      s.outputs.clear();
    }
  };
  auto backward = [&](int m) {
    MicroState& s = live.at(m);
    if (backwards_done == M - 1) defer.reset();
    else if (!defer) defer.emplace();
    if (is_last_stage()) {
      s.loss.backward();
    } else {
      std::vector<at::Tensor> outs, grads;
      for (size_t i = 0; i < s.outputs.size(); ++i)
        if (s.outputs[i].requires_grad()) {
          outs.push_back(s.outputs[i]);
          grads.push_back(s.output_grads.at(i));
        }
      if (!outs.empty()) torch::autograd::backward(outs, grads);
    }
    ++backwards_done;
    s.outputs.clear();
    s.output_grads.clear();
    s.loss = at::Tensor();
  };

  BusyTimer busy(measure_busy_, link.device);
  for (const PipeAction& a : pipe_schedule(options_.schedule, stage_, stages_, M)) {
    detail::PipeTransfer t;
    switch (a.kind) {
      case PipeAction::kForward:
        busy.start();
        forward(a.micro);
        busy.stop();
        break;
      case PipeAction::kBackward:
        busy.start();
        backward(a.micro);
        busy.stop();
        break;
      case PipeAction::kRecvAct:
        t.recv_acts = H;
        t.act_from = prev;
        take_received(a.micro, transfer(t));
        break;
      case PipeAction::kSendAct:
        t.send_acts = live.at(a.micro).outputs;
        t.act_to = next;
        transfer(t);
        break;
      case PipeAction::kRecvGrad:
        t.recv_grads = grad_buffers(a.micro);
        t.grad_from = next;
        transfer(t);
        break;
      case PipeAction::kSendGrad:
        t.send_grads = grads_to_send(a.micro);
        t.grad_to = prev;
        transfer(t);
        live.erase(a.micro);
        break;
      case PipeAction::kSendActRecvGrad:
        t.send_acts = live.at(a.micro).outputs;
        t.act_to = next;
        t.recv_grads = grad_buffers(a.other);
        t.grad_from = next;
        transfer(t);
        break;
      case PipeAction::kSendGradRecvAct: {
        t.send_grads = grads_to_send(a.micro);
        t.grad_to = prev;
        t.recv_acts = H;
        t.act_from = prev;
        auto acts = transfer(t);
        live.erase(a.micro);
        take_received(a.other, std::move(acts));
        break;
      }
    }
    // Stage 0 keeps nothing after its backward (it has no gradient to send).
    if (a.kind == PipeAction::kBackward && is_first_stage()) live.erase(a.micro);
  }
  BMT_ASSERT(backwards_done == M, "pipeline schedule ran ", backwards_done, " backwards for ", M, " micro-batches");
  if (!tied_.empty() && stages_ > 1) {
    wait_for_gradient_reduction();
    at::NoGradGuard no_grad;
    for (const auto& p : tied_) {
      at::Tensor g = main_grad(p);
      BMT_CHECK(g.defined(), "pipeline: a tied parameter has no gradient after the backward");
      if (g.numel() > 0) g.copy_(distributed::raw_all_reduce(g, core::ReduceOp::kSum, *tied_comm_));
    }
  }
  last_wait_s_ = wait_s;
  last_busy_s_ = busy.seconds();
  return broadcast_loss(loss_sum / static_cast<double>(M));
}

at::Tensor PipelineTransformerBlockList::forward_only(const Step& step) {
  const detail::PipeLink& link = *link_;
  at::NoGradGuard no_grad;
  const int M = micro_batches_, H = options_.num_hidden;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(link.device));
  for (int m = 0; m < M; ++m) {
    std::vector<at::Tensor> h;
    if (is_first_stage()) {
      h = step.first(m);
    } else {
      detail::PipeTransfer t;
      t.recv_acts = H;
      t.act_from = stage_ - 1;
      h = detail::pipe_transfer(link, t);
    }
    std::vector<at::Tensor> args = h;
    if (step.extra_args)
      for (auto& e : step.extra_args(m)) args.push_back(e);
    std::vector<at::Tensor> out = list_->forward(args, H);
    if (is_last_stage()) {
      loss_sum = loss_sum + step.last(m, out).detach().to(at::kFloat).reshape({}).to(link.device);
    } else {
      detail::PipeTransfer t;
      t.send_acts = out;
      t.act_to = stage_ + 1;
      detail::pipe_transfer(link, t);
    }
  }
  return broadcast_loss(loss_sum / static_cast<double>(M));
}

}  // namespace bmt
