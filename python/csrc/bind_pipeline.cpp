// bmtrain._C: the pipeline block list (bmt::PipelineTransformerBlockList) over Python Blocks.
#include "bmt/pipeline/pipeline.h"
#include "py_support.h"

namespace bmt::python {

void bind_pipeline(py::module_& m) {
  py::class_<PipelineTransformerBlockList, std::shared_ptr<PipelineTransformerBlockList>>(m, "PipelineTransformerBlockList")
      // make_block(layer) -> _C.Block is called for this stage's layers only. The GIL stays held: the factory is
      // Python, and the one collective (the tied-parameter group split) waits only on this job's other processes.
      .def(py::init([](int64_t num_layers, py::function make_block, int num_hidden, int num_micro_batches,
                       const std::string& schedule, std::vector<int64_t> partition, int prefetch_depth) {
             PipelineOptions o;
             o.num_hidden = num_hidden;
             o.num_micro_batches = num_micro_batches;
             o.schedule = parse_pipe_schedule(schedule);
             o.partition = std::move(partition);
             o.prefetch_depth = prefetch_depth;
             BlockFactory f = [&make_block](int64_t layer) { return make_block(layer).cast<std::shared_ptr<Block>>(); };
             return std::make_shared<PipelineTransformerBlockList>(num_layers, f, o);
           }),
           py::arg("num_layers"), py::arg("make_block"), py::arg("num_hidden") = 1, py::arg("num_micro_batches") = 0,
           py::arg("schedule") = "gpipe", py::arg("partition") = std::vector<int64_t>{},
           py::arg("prefetch_depth") = 1)
      .def("forward",
           [](PipelineTransformerBlockList& l, const std::vector<at::Tensor>& inputs, py::object context) {
             CallContext c = make_call_context(std::move(context));
             py::gil_scoped_release release;
             return l.forward_autograd(inputs, std::move(c));
           },
           py::arg("inputs"), py::arg("context") = py::none())
      .def_property_readonly("num_stages", &PipelineTransformerBlockList::num_stages)
      .def_property_readonly("stage_id", &PipelineTransformerBlockList::stage_id)
      .def_property_readonly("num_layers", &PipelineTransformerBlockList::num_layers)
      .def_property("num_micro_batches", &PipelineTransformerBlockList::num_micro_batches,
                    &PipelineTransformerBlockList::set_num_micro_batches)
      .def("get_range_by_stage_id", &PipelineTransformerBlockList::get_range_by_stage_id)
      .def("get_stage_by_layer_id", &PipelineTransformerBlockList::get_stage_by_layer_id)
      .def_static("even_partition", &PipelineTransformerBlockList::even_partition);
}

}  // namespace bmt::python
