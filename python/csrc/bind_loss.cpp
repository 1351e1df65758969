// bmtrain._C: the fused cross-entropy (loss/fused_cross_entropy.h).
#include "bmt/core/error.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "py_support.h"

namespace bmt::python {
namespace {

loss::Reduction parse_reduction(const std::string& r) {
  if (r == "mean") return loss::Reduction::kMean;
  if (r == "sum") return loss::Reduction::kSum;
  if (r == "none") return loss::Reduction::kNone;
  BMT_ERROR("FusedCrossEntropy: unknown reduction '", r, "': use mean, sum or none");
}

}  // namespace

void bind_loss(py::module_& m) {
  m.def(
      "fused_cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, const std::string& reduction,
         double label_smoothing, bool parallel, bool inplace) {
        loss::FusedCrossEntropyOptions o;
        o.ignore_index = ignore_index;
        o.reduction = parse_reduction(reduction);
        o.label_smoothing = label_smoothing;
        o.parallel = parallel;
        o.inplace = inplace;
        py::gil_scoped_release release;
        return loss::fused_cross_entropy(logits, target, o);
      },
      py::arg("logits"), py::arg("target"), py::arg("ignore_index") = -100, py::arg("reduction") = "mean",
      py::arg("label_smoothing") = 0.0, py::arg("parallel") = false, py::arg("inplace") = false);
  m.def("check_pending_targets", &loss::check_pending_targets);
}

}  // namespace bmt::python
