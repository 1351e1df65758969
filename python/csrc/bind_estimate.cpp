// bmtrain._C: bmt::estimate_memory for bmt.estimate_memory (python/bmtrain/estimate.py).
#include <pybind11/stl.h>

#include "bmt/runtime/estimate_memory.h"
#include "models/preset_shapes.h"  // examples/models: the presets' one table
#include "py_support.h"

namespace bmt::python {
namespace {

py::dict split_dict(const MemoryEstimate::Split& s) {
  py::dict d;
  d["parameters"] = s.parameters;
  d["gradients"] = s.gradients;
  d["optimizer_states"] = s.optimizer_states;
  d["activations"] = s.activations;
  d["buffers"] = s.buffers;
  d["runtime"] = s.runtime;
  d["total"] = s.total();
  return d;
}

}  // namespace

void bind_estimate(py::module_& m) {
  m.def("model_shape_preset_names", &examples::preset_shape_names);
  m.def("estimate_memory",
        [](const py::object& preset, const std::string& arch, int64_t layers, int64_t hidden, int64_t heads,
           int64_t ffn, int64_t kv_heads, int64_t vocab, int64_t max_seq, int world, int ranks_per_host, int tp,
           int pp, int zero, bool checkpointing, bool offload, int offload_gpu_blocks, bool offload_grad_bf16,
           bool step_in_backward, int64_t batch, int64_t seq, const std::string& dtype) {
          ModelShape s;
          if (!preset.is_none()) {
            s = examples::preset_shape(preset.cast<std::string>());
          } else {
            s.arch = arch;
            s.layers = layers;
            s.hidden = hidden;
            s.heads = heads;
            s.ffn = ffn;
            s.kv_heads = kv_heads;
            s.vocab = vocab;
            s.max_seq = max_seq;
          }
          MemoryPlan p;
          p.world = world;
          p.ranks_per_host = ranks_per_host;
          p.tp = tp;
          p.pp = pp;
          p.zero = zero;
          p.checkpointing = checkpointing;
          p.offload = offload;
          p.offload_gpu_blocks = offload_gpu_blocks;
          p.offload_grad_bf16 = offload_grad_bf16;
          p.step_in_backward = step_in_backward;
          p.batch = batch;
          p.seq = seq;
          p.dtype = dtype;
          MemoryEstimate e = bmt::estimate_memory(s, p);
          py::dict out;
          out["gpu"] = split_dict(e.gpu);
          out["host"] = split_dict(e.host);
          out["params"] = e.params_total;
          out["params_per_rank"] = e.params_per_rank;
          out["ranks_per_host"] = e.ranks_per_host;
          out["table"] = format_memory_estimate(s, p, e);
          return out;
        },
        py::arg("preset") = py::none(), py::kw_only(), py::arg("arch") = "gpt", py::arg("layers") = 0,
        py::arg("hidden") = 0, py::arg("heads") = 0, py::arg("ffn") = 0, py::arg("kv_heads") = 0,
        py::arg("vocab") = 50304, py::arg("max_seq") = 2048, py::arg("world") = 1, py::arg("ranks_per_host") = 0,
        py::arg("tp") = 1, py::arg("pp") = 1, py::arg("zero") = 3, py::arg("checkpointing") = false,
        py::arg("offload") = false, py::arg("offload_gpu_blocks") = 0, py::arg("offload_grad_bf16") = false,
        py::arg("step_in_backward") = false, py::arg("batch") = 1, py::arg("seq") = 1024, py::arg("dtype") = "bf16");
}

}  // namespace bmt::python
