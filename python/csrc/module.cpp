// bmtrain._C: the C++ engine for the Python package (python/bmtrain). Binding glue only; the logic is libbmtrain's.
#include "py_support.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "bmtrain's C++ engine (libbmtrain) for the Python package";
  bmt::python::bind_init(m);
  bmt::python::bind_params(m);
  bmt::python::bind_block(m);
  bmt::python::bind_grad_sync(m);
  bmt::python::bind_nn(m);
  bmt::python::bind_loss(m);
  bmt::python::bind_optim(m);
  bmt::python::bind_checkpoint(m);
  bmt::python::bind_inspect(m);
  bmt::python::bind_estimate(m);
  bmt::python::bind_pipeline(m);
  bmt::python::bind_nccl(m);
  bmt::python::bind_tp(m);
}
