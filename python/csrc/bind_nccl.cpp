// bmtrain._C: buffer-level collectives for python/bmtrain/nccl (BMTrain's `bmtrain.nccl` API): each writes the
// caller's destination buffer in place, on the engine's communicators (NCCL on GPUs, Gloo on CPU ranks), enqueued
// on the current stream of the buffers' device as BMTrain's calls are.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bmt/core/error.h"
#include "bmt/runtime/tensor_adapter_internal.h"
#include "py_support.h"

namespace bmt::python {
namespace {

using Comm = std::shared_ptr<core::Communicator>;

core::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum") return core::ReduceOp::kSum;
  if (op == "prod") return core::ReduceOp::kProd;
  if (op == "max") return core::ReduceOp::kMax;
  if (op == "min") return core::ReduceOp::kMin;
  if (op == "avg") return core::ReduceOp::kAvg;
  BMT_ERROR("bmtrain.nccl: unknown reduction '", op, "' (use sum, prod, max, min or avg)");
}

core::Communicator& comm_of(const Comm& comm, const char* op) {
  BMT_CHECK(comm != nullptr, "bmtrain.nccl.", op, ": the communicator is None (pass bmt.config['comm'] or another "
            "communicator from bmt.config)");
  return *comm;
}

// Checks a buffer pair of one collective: same dtype and device, contiguous, on the communicator's kind of device.
void check_pair(const at::Tensor& src, const at::Tensor& dst, const core::Communicator& comm, const char* op) {
  BMT_CHECK(src.scalar_type() == dst.scalar_type(), "bmtrain.nccl.", op, ": src is ", src.scalar_type(),
            " but dst is ", dst.scalar_type(), " (both buffers must have one dtype)");
  BMT_CHECK(src.device() == dst.device(), "bmtrain.nccl.", op, ": src is on ", src.device(), " but dst on ",
            dst.device());
  check_comm_tensor(src, comm, op, "src");
  check_comm_tensor(dst, comm, op, "dst");
}

core::DType dtype_of(const at::Tensor& t) { return to_core_dtype(t.scalar_type()); }

}  // namespace

void bind_nccl(py::module_& m) {
  py::module_ n = m.def_submodule("nccl", "in-place buffer collectives for bmtrain.nccl");
  n.def(
      "all_reduce",
      [](const at::Tensor& src, const at::Tensor& dst, const std::string& op, const Comm& comm) {
        core::Communicator& c = comm_of(comm, "allReduce");
        check_pair(src, dst, c, "allReduce");
        BMT_CHECK(src.numel() == dst.numel(), "bmtrain.nccl.allReduce: src has ", src.numel(), " elements but dst ",
                  dst.numel());
        c.all_reduce(src.data_ptr(), dst.data_ptr(), src.numel(), dtype_of(src), reduce_op(op),
                     current_stream_handle(src));
      },
      py::arg("src"), py::arg("dst"), py::arg("op"), py::arg("comm"), py::call_guard<py::gil_scoped_release>());
  n.def(
      "broadcast",
      [](const at::Tensor& src, const at::Tensor& dst, int root, const Comm& comm) {
        core::Communicator& c = comm_of(comm, "broadcast");
        check_pair(src, dst, c, "broadcast");
        BMT_CHECK(src.numel() == dst.numel(), "bmtrain.nccl.broadcast: src has ", src.numel(), " elements but dst ",
                  dst.numel());
        BMT_CHECK(root >= 0 && root < c.size(), "bmtrain.nccl.broadcast: root ", root, " is not a rank of '", c.name(),
                  "' (size ", c.size(), ")");
        c.broadcast(src.data_ptr(), dst.data_ptr(), src.numel(), dtype_of(src), root, current_stream_handle(src));
      },
      py::arg("src"), py::arg("dst"), py::arg("root"), py::arg("comm"), py::call_guard<py::gil_scoped_release>());
  n.def(
      "all_gather",
      [](const at::Tensor& src, const at::Tensor& dst, const Comm& comm) {
        core::Communicator& c = comm_of(comm, "allGather");
        check_pair(src, dst, c, "allGather");
        BMT_CHECK(dst.numel() == src.numel() * c.size(), "bmtrain.nccl.allGather: dst has ", dst.numel(),
                  " elements; it must hold src's ", src.numel(), " times the group size ", c.size());
        c.all_gather(src.data_ptr(), dst.data_ptr(), src.numel(), dtype_of(src), current_stream_handle(src));
      },
      py::arg("src"), py::arg("dst"), py::arg("comm"), py::call_guard<py::gil_scoped_release>());
  n.def(
      "reduce_scatter",
      [](const at::Tensor& src, const at::Tensor& dst, const std::string& op, const Comm& comm) {
        core::Communicator& c = comm_of(comm, "reduceScatter");
        check_pair(src, dst, c, "reduceScatter");
        BMT_CHECK(src.numel() == dst.numel() * c.size(), "bmtrain.nccl.reduceScatter: src has ", src.numel(),
                  " elements; it must hold dst's ", dst.numel(), " times the group size ", c.size());
        c.reduce_scatter(src.data_ptr(), dst.data_ptr(), dst.numel(), dtype_of(src), reduce_op(op),
                         current_stream_handle(src));
      },
      py::arg("src"), py::arg("dst"), py::arg("op"), py::arg("comm"), py::call_guard<py::gil_scoped_release>());
  // ops: (is_send, buffer, peer) run as one batch (ncclGroupStart/End around sends and receives).
  n.def(
      "batch_p2p",
      [](const std::vector<std::tuple<bool, at::Tensor, int>>& ops, const Comm& comm) {
        core::Communicator& c = comm_of(comm, "send/recv");
        std::vector<core::P2POp> batch;
        core::StreamHandle stream = nullptr;
        for (const auto& [is_send, buf, peer] : ops) {
          check_comm_tensor(buf, c, is_send ? "send" : "recv", "buffer");
          BMT_CHECK(peer >= 0 && peer < c.size() && peer != c.rank(), "bmtrain.nccl.", is_send ? "send" : "recv",
                    ": peer ", peer, " is not another rank of '", c.name(), "' (rank ", c.rank(), " of ", c.size(), ")");
          batch.push_back(core::P2POp{is_send, buf.data_ptr(), static_cast<size_t>(buf.numel()), dtype_of(buf), peer});
          stream = current_stream_handle(buf);
        }
        if (!batch.empty()) c.batch_p2p(batch, stream);
      },
      py::arg("ops"), py::arg("comm"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace bmt::python
