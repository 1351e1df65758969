// bmtrain._C: initialisation, the configuration, communicators, collectives, memory statistics, exceptions.
#include <c10/util/Exception.h>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/memory_stats.h"
#include "py_support.h"

namespace bmt::python {
namespace {

core::ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return core::ReduceOp::kSum;
  if (op == "avg" || op == "mean") return core::ReduceOp::kAvg;
  if (op == "max") return core::ReduceOp::kMax;
  if (op == "min") return core::ReduceOp::kMin;
  if (op == "prod") return core::ReduceOp::kProd;
  BMT_ERROR("unknown reduce op '", op, "': use sum, avg, max, min or prod");
}

core::Communicator& comm_or_world(const std::shared_ptr<core::Communicator>& comm) {
  return comm ? *comm : *config().comm;
}

py::object stream_tuple(const std::optional<c10::Stream>& s) {
  if (!s) return py::none();
  return py::make_tuple(s->id(), static_cast<int>(s->device_index()), static_cast<int>(s->device_type()));
}

py::dict config_dict() {
  const Config& c = config();
  py::dict d;
  d["initialized"] = c.initialized;
  d["rank"] = c.rank;
  d["world_size"] = c.world_size;
  d["local_rank"] = c.local_rank;
  d["local_size"] = c.local_size;
  d["zero_rank"] = c.zero_rank;
  d["zero_size"] = c.zero_size;
  d["tp_rank"] = c.tp_rank;
  d["tp_size"] = c.tp_size;
  d["tp_zero_rank"] = c.tp_zero_rank;
  d["tp_zero_size"] = c.tp_zero_size;
  d["pipe_rank"] = c.pipe_rank;
  d["pipe_size"] = c.pipe_size;
  d["num_micro_batches"] = c.num_micro_batches;
  d["zero_level"] = c.zero_level;
  d["sequence_parallel"] = c.sequence_parallel;
  d["seed"] = c.seed;
  d["backend"] = backend_name(c.backend);
  d["timeout_s"] = static_cast<double>(c.timeout.count()) / 1000.0;
  d["device"] = c.device.str();
  d["master_addr"] = c.master_addr;
  d["master_port"] = c.master_port;
  d["comm"] = c.comm;
  d["zero_comm"] = c.zero_comm;
  d["tp_comm"] = c.tp_comm;
  d["tp_zero_comm"] = c.tp_zero_comm;
  d["pipe_comm"] = c.pipe_comm;
  d["pp_comm_stream"] = stream_tuple(c.pp_comm_stream);
  d["calc_stream"] = stream_tuple(c.calc_stream);
  d["load_stream"] = stream_tuple(c.load_stream);
  d["tp_comm_stream"] = stream_tuple(c.tp_comm_stream);
  return d;
}

}  // namespace

void bind_init(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::IndexError& e) {
      py::set_error(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::ValueError& e) {
      py::set_error(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      py::set_error(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {  // torch's own errors: the message without the C++ backtrace
      py::set_error(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  // A collective that failed or timed out (a dead or stuck peer): bmtrain.DistError, a RuntimeError.
  py::register_exception<core::DistError>(m, "DistError", PyExc_RuntimeError);

  py::class_<core::Communicator, std::shared_ptr<core::Communicator>>(m, "Communicator")
      .def("rank", &core::Communicator::rank)
      .def("size", &core::Communicator::size)
      .def_property_readonly("name", &core::Communicator::name)
      .def_property_readonly("backend", [](const core::Communicator& c) { return std::string(c.backend_name()); })
      .def("barrier", &core::Communicator::barrier, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](const core::Communicator& c) {
        return core::concat("<bmtrain Communicator '", c.name(), "' rank ", c.rank(), " of ", c.size(), " (",
                            c.backend_name(), ")>");
      });

  m.def(
      "init_distributed",
      [](uint64_t seed, int tp_size, int pipe_size, int zero_level, const std::string& backend, double timeout_s,
         bool sequence_parallel, bool quiet, int num_micro_batches) {
        InitOptions o;
        o.seed = seed;
        o.tp_size = tp_size;
        o.pipe_size = pipe_size;
        o.num_micro_batches = num_micro_batches;
        o.zero_level = zero_level;
        o.backend = parse_backend(backend);
        if (timeout_s > 0) o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        o.sequence_parallel = sequence_parallel;
        o.quiet = quiet;
        py::gil_scoped_release release;
        init_distributed(o);
      },
      py::arg("seed") = 0, py::arg("tp_size") = 1, py::arg("pipe_size") = 1, py::arg("zero_level") = 3,
      py::arg("backend") = "auto", py::arg("timeout_s") = 0.0, py::arg("sequence_parallel") = true,
      py::arg("quiet") = false, py::arg("num_micro_batches") = 0);
  m.def("is_initialized", &is_initialized);
  m.def("config", &config_dict);
  m.def("finalize", &finalize, py::arg("barrier") = true, py::call_guard<py::gil_scoped_release>());
  m.def("seed_per_data_parallel_rank", &seed_per_data_parallel_rank);

  m.def("synchronize", &synchronize, py::call_guard<py::gil_scoped_release>());
  m.def("sum_loss", &sum_loss, py::call_guard<py::gil_scoped_release>());
  m.def("gather_result", &gather_result, py::call_guard<py::gil_scoped_release>());

  // Collectives: differentiable (our gradient convention, bmt/distributed.h) and raw. comm None = the world.
  using Comm = std::shared_ptr<core::Communicator>;
  m.def("all_gather", [](const at::Tensor& x, Comm comm) { return distributed::all_gather(x, comm_or_world(comm)); },
        py::arg("x"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("reduce_scatter",
        [](const at::Tensor& x, const std::string& op, Comm comm) {
          return distributed::reduce_scatter(x, parse_op(op), comm_or_world(comm));
        },
        py::arg("x"), py::arg("op") = "sum", py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("all_reduce",
        [](const at::Tensor& x, const std::string& op, Comm comm) {
          return distributed::all_reduce(x, parse_op(op), comm_or_world(comm));
        },
        py::arg("x"), py::arg("op") = "sum", py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("broadcast",
        [](const at::Tensor& x, int root, Comm comm) { return distributed::broadcast(x, root, comm_or_world(comm)); },
        py::arg("x"), py::arg("root"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("raw_all_gather",
        [](const at::Tensor& x, Comm comm) { return distributed::raw_all_gather(x, comm_or_world(comm)); },
        py::arg("x"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("raw_reduce_scatter",
        [](const at::Tensor& x, const std::string& op, Comm comm) {
          return distributed::raw_reduce_scatter(x, parse_op(op), comm_or_world(comm));
        },
        py::arg("x"), py::arg("op") = "sum", py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("raw_all_reduce",
        [](const at::Tensor& x, const std::string& op, Comm comm) {
          return distributed::raw_all_reduce(x, parse_op(op), comm_or_world(comm));
        },
        py::arg("x"), py::arg("op") = "sum", py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("raw_broadcast",
        [](const at::Tensor& x, int root, Comm comm) {
          return distributed::raw_broadcast(x, root, comm_or_world(comm));
        },
        py::arg("x"), py::arg("root"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("send_activations",
        [](const at::Tensor& x, int peer, Comm comm) { distributed::send_activations(x, peer, comm_or_world(comm)); },
        py::arg("x"), py::arg("peer"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());
  m.def("recv_activations",
        [](int peer, Comm comm) {
          return distributed::recv_activations(peer, comm_or_world(comm), config().device);
        },
        py::arg("peer"), py::arg("comm") = nullptr, py::call_guard<py::gil_scoped_release>());

  m.def("memory_stats", [] {
    MemoryStats s = memory_stats();
    py::dict d;
    d["device_allocated_nbytes"] = s.device_allocated_nbytes;
    d["device_peak_nbytes"] = s.device_peak_nbytes;
    d["shard_nbytes"] = s.shard_nbytes;
    d["gathered_nbytes"] = s.gathered_nbytes;
    d["gathered_peak_nbytes"] = s.gathered_peak_nbytes;
    d["grad_nbytes"] = s.grad_nbytes;
    return d;
  });
  m.def("reset_peak_memory_stats", &reset_peak_memory_stats);
}

}  // namespace bmt::python
