#include "bmt/runtime/distributed.h"

#include <torch/autograd.h>

#include "bmt/core/error.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt::distributed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using core::ReduceOp;

core::Communicator* comm_of(AutogradContext* ctx) {
  return reinterpret_cast<core::Communicator*>(ctx->saved_data["comm"].toInt());
}

}  // namespace

// Non-differentiable building blocks (also used by the tensor-parallel ops).
at::Tensor raw_all_gather(const at::Tensor& x_in, core::Communicator& comm) {
  at::Tensor x = x_in.contiguous();
  check_comm_tensor(x, comm, "all_gather", "input");
  std::vector<int64_t> shape{comm.size()};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, x.options());
  comm.all_gather(x.data_ptr(), out.data_ptr(), x.numel(), to_core_dtype(x.scalar_type()), current_stream_handle(x));
  return out;
}

at::Tensor raw_reduce_scatter(const at::Tensor& x_in, ReduceOp op, core::Communicator& comm) {
  at::Tensor x = x_in.contiguous();
  check_comm_tensor(x, comm, "reduce_scatter", "input");
  BMT_CHECK(x.dim() >= 1 && x.size(0) % comm.size() == 0, "reduce_scatter on '", comm.name(), "' (rank ",
            comm.rank(), "): dim 0 of the input (shape ", x.sizes(), ") must be divisible by the group size ",
            comm.size());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] /= comm.size();
  at::Tensor out = at::empty(shape, x.options());
  comm.reduce_scatter(x.data_ptr(), out.data_ptr(), out.numel(), to_core_dtype(x.scalar_type()), op,
                      current_stream_handle(x));
  return out;
}

at::Tensor raw_all_reduce(const at::Tensor& x_in, ReduceOp op, core::Communicator& comm) {
  at::Tensor x = x_in.contiguous();
  check_comm_tensor(x, comm, "all_reduce", "input");
  at::Tensor out = at::empty_like(x);
  comm.all_reduce(x.data_ptr(), out.data_ptr(), x.numel(), to_core_dtype(x.scalar_type()), op,
                  current_stream_handle(x));
  return out;
}

at::Tensor raw_broadcast(const at::Tensor& x_in, int root, core::Communicator& comm) {
  at::Tensor x = x_in.contiguous();
  check_comm_tensor(x, comm, "broadcast", "input");
  at::Tensor out = at::empty_like(x);
  comm.broadcast(x.data_ptr(), out.data_ptr(), x.numel(), to_core_dtype(x.scalar_type()), root,
                 current_stream_handle(x));
  return out;
}

namespace {

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t comm_ptr) {
    ctx->saved_data["comm"] = comm_ptr;
    return raw_all_gather(x, *reinterpret_cast<core::Communicator*>(comm_ptr));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor g = raw_reduce_scatter(grads[0], ReduceOp::kSum, *comm_of(ctx));
    return {g.squeeze(0), at::Tensor()};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t op, int64_t comm_ptr) {
    ctx->saved_data["comm"] = comm_ptr;
    ctx->saved_data["op"] = op;
    return raw_reduce_scatter(x, static_cast<ReduceOp>(op), *reinterpret_cast<core::Communicator*>(comm_ptr));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    core::Communicator& comm = *comm_of(ctx);
    at::Tensor g = raw_all_gather(grads[0], comm);
    g = g.reshape({-1});
    std::vector<int64_t> shape(grads[0].sizes().begin(), grads[0].sizes().end());
    shape[0] *= comm.size();
    g = g.view(shape);
    if (static_cast<ReduceOp>(ctx->saved_data["op"].toInt()) == ReduceOp::kAvg) g = g / comm.size();
    return {g, at::Tensor(), at::Tensor()};
  }
};

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t op, int64_t comm_ptr) {
    ctx->saved_data["comm"] = comm_ptr;
    ctx->saved_data["op"] = op;
    at::Tensor out = raw_all_reduce(x, static_cast<ReduceOp>(op), *reinterpret_cast<core::Communicator*>(comm_ptr));
    auto rop = static_cast<ReduceOp>(op);
    if (rop == ReduceOp::kMax || rop == ReduceOp::kMin) ctx->save_for_backward({x, out});
    if (rop == ReduceOp::kProd) ctx->save_for_backward({x});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    core::Communicator& comm = *comm_of(ctx);
    auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    at::Tensor g = raw_all_reduce(grads[0], ReduceOp::kSum, comm);
    switch (op) {
      case ReduceOp::kSum: break;
      case ReduceOp::kAvg: g = g / comm.size(); break;
      case ReduceOp::kMax:
      case ReduceOp::kMin: {
        // Ties share the gradient evenly (torch's amax/amin convention): with k ranks holding the extreme,
        // each gets 1/k, so the gradients still sum to the derivative of the output.
        auto saved = ctx->get_saved_variables();
        at::Tensor holds = (saved[0] == saved[1]).to(g.scalar_type());
        at::Tensor holders = raw_all_reduce(holds, ReduceOp::kSum, comm);
        g = g * holds / holders;
        break;
      }
      case ReduceOp::kProd: {
        // d out / d x_me = product of the other ranks' inputs. out / x_me is wrong where x_me == 0 (0/0), so
        // count the zeros of each element over the ranks and multiply the non-zero factors separately:
        //   no zero: nonzero_prod / x_me;  one zero: nonzero_prod on the rank holding it, 0 elsewhere;  more: 0.
        auto saved = ctx->get_saved_variables();
        const at::Tensor& x = saved[0];
        at::Tensor is_zero = x == 0;
        at::Tensor zeros = raw_all_reduce(is_zero.to(at::kLong), ReduceOp::kSum, comm);
        at::Tensor x_nz = at::where(is_zero, at::ones_like(x), x);
        at::Tensor nonzero_prod = raw_all_reduce(x_nz, ReduceOp::kProd, comm);
        at::Tensor others = at::where(zeros == 0, nonzero_prod / x_nz,
                                      at::where(is_zero & (zeros == 1), nonzero_prod, at::zeros_like(x)));
        g = g * others.to(g.scalar_type());
        break;
      }
    }
    return {g, at::Tensor(), at::Tensor()};
  }
};

struct BroadcastFn : torch::autograd::Function<BroadcastFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t root, int64_t comm_ptr) {
    ctx->saved_data["comm"] = comm_ptr;
    ctx->saved_data["root"] = root;
    return raw_broadcast(x, static_cast<int>(root), *reinterpret_cast<core::Communicator*>(comm_ptr));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    core::Communicator& comm = *comm_of(ctx);
    at::Tensor g = raw_all_reduce(grads[0], ReduceOp::kSum, comm);
    if (comm.rank() != ctx->saved_data["root"].toInt()) g = at::zeros_like(g);
    return {g, at::Tensor(), at::Tensor()};
  }
};

int64_t ptr_of(core::Communicator& comm) { return reinterpret_cast<int64_t>(&comm); }

constexpr int kMaxDims = 16;

}  // namespace

at::Tensor all_gather(const at::Tensor& x, core::Communicator& comm) { return AllGatherFn::apply(x, ptr_of(comm)); }

at::Tensor reduce_scatter(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm) {
  BMT_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "reduce_scatter supports sum and avg, not ",
            core::reduce_op_name(op));
  return ReduceScatterFn::apply(x, static_cast<int64_t>(op), ptr_of(comm));
}

at::Tensor all_reduce(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm) {
  return AllReduceFn::apply(x, static_cast<int64_t>(op), ptr_of(comm));
}

at::Tensor broadcast(const at::Tensor& x, int root, core::Communicator& comm) {
  return BroadcastFn::apply(x, root, ptr_of(comm));
}

void send_activations(const at::Tensor& x_in, int peer, core::Communicator& comm) {
  at::Tensor x = x_in.contiguous();
  check_comm_tensor(x, comm, "send_activations", "input");
  BMT_CHECK(x.dim() <= kMaxDims, "send_activations: at most ", kMaxDims, " dims, got ", x.dim());
  // Metadata: [ndim, dtype, shape...], padded to a fixed size so the receiver knows how much to expect.
  at::Tensor meta = at::zeros({kMaxDims + 2}, at::TensorOptions().dtype(at::kLong));
  meta[0] = x.dim();
  meta[1] = static_cast<int64_t>(to_core_dtype(x.scalar_type()));
  for (int64_t d = 0; d < x.dim(); ++d) meta[d + 2] = x.size(d);
  meta = meta.to(x.device());
  auto stream = current_stream_handle(x);
  comm.send(meta.data_ptr(), meta.numel(), core::DType::kInt64, peer, stream);
  comm.send(x.data_ptr(), x.numel(), to_core_dtype(x.scalar_type()), peer, stream);
}

at::Tensor recv_activations(int peer, core::Communicator& comm, const at::Device& device) {
  at::Tensor meta = at::zeros({kMaxDims + 2}, at::TensorOptions().dtype(at::kLong).device(device));
  auto stream = current_stream_handle(meta);
  comm.recv(meta.data_ptr(), meta.numel(), core::DType::kInt64, peer, stream);
  at::Tensor meta_cpu = meta.to(at::kCPU);  // host sync: the shape is needed to allocate
  auto* m = meta_cpu.data_ptr<int64_t>();
  BMT_CHECK(m[0] >= 0 && m[0] <= kMaxDims, "recv_activations from rank ", peer, ": corrupt metadata (ndim ", m[0],
            ")");
  BMT_CHECK(m[1] >= 0 && m[1] <= static_cast<int64_t>(core::DType::kFloat64), "recv_activations from rank ", peer,
            ": corrupt metadata (dtype code ", m[1], ")");
  std::vector<int64_t> shape(m + 2, m + 2 + m[0]);
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(to_scalar_type(static_cast<core::DType>(m[1]))).device(device));
  comm.recv(out.data_ptr(), out.numel(), static_cast<core::DType>(m[1]), peer, stream);
  return out;
}

}  // namespace bmt::distributed

namespace bmt {

void synchronize() {
  const Config& cfg = config();
#ifdef BMT_WITH_CUDA
  if (cfg.device.is_cuda()) {
    if (cfg.calc_stream) cfg.comm->synchronize(cfg.calc_stream->native_handle());
    if (cfg.load_stream) cfg.comm->synchronize(cfg.load_stream->native_handle());
  }
#endif
  cfg.comm->barrier();
}

at::Tensor sum_loss(const at::Tensor& loss) {
  return distributed::all_reduce(loss, core::ReduceOp::kAvg, *config().comm);
}

at::Tensor gather_result(const at::Tensor& x) {
  at::Tensor g = distributed::all_gather(x.to(config().device), *config().comm);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  BMT_CHECK(!shape.empty(), "gather_result needs a tensor with at least one dimension");
  shape[0] *= config().world_size;
  return g.reshape(shape).to(x.device());
}

}  // namespace bmt
