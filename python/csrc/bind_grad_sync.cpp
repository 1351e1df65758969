// bmtrain._C: deferring the ZeRO gradient reduction (GradSyncGuard, engine/block.h: gradient accumulation).
#include "bmt/engine/block.h"
#include "py_support.h"

namespace bmt::python {

void bind_grad_sync(py::module_& m) {
  py::class_<GradSyncGuard>(m, "GradSyncGuard").def(py::init<>());
  m.def("grad_sync_enabled", &grad_sync_enabled);
}

}  // namespace bmt::python
