"""The bridge to the C++ module-level API: a C++ module tree holding a Python model's own tensors under the
Python names (see python/csrc/py_support.h), so init_parameters, state dicts, save/load and checkpoints run in C++."""
from . import _C


def persistent_buffers(model):
    for mod_name, mod in model.named_modules(remove_duplicate=True):
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def holder_of(model, buffers=True):
    params = list(model.named_parameters(remove_duplicate=True))
    bufs = list(persistent_buffers(model)) if buffers else []
    return _C.make_holder(params, bufs)
