"""bmtrain: BMTrain's Python API (OpenBMB BMTrain 1.0.1) over bmtrain's C++ engine.

`import bmtrain as bmt`, `bmt.init_distributed()`, DistributedModule / DistributedParameter, Block /
TransformerBlockList, bmt.optim.OptimManager, launched with torchrun. Sharding, gathering, prefetch and overlap,
gradient reduction, loss scaling, the optimizers, offload and checkpoint I/O run in C++ (libbmtrain, through the
extension bmtrain._C); this package is binding glue. Differences from BMTrain are listed in docs/python.md.
"""
import torch as _torch

from . import _build_info


def _check_torch_version():
    built, running = _build_info.TORCH_VERSION, _torch.__version__
    if built != running:
        raise ImportError(
            f"bmtrain was built against torch {built}, but torch {running} is installed: its C++ engine links "
            f"torch's libraries and would crash or fail to load. Rebuild bmtrain against the installed torch: "
            f"`pip install --no-build-isolation --force-reinstall <bmtrain source dir>` (or install torch=={built}).")


_check_torch_version()


def _share_cxx_runtime():
    # libbmtrain can hold weak copies of C++ runtime template instances (GCC 13's headers emit some: iostream and
    # locale ones). Python loads extensions RTLD_LOCAL, so under a libstdc++ that torch already loaded those copies
    # would bind inside libbmtrain and split the runtime's locale state (a crash at the first ostringstream).
    # Making the loaded libstdc++ global first binds every reference to the one runtime.
    import ctypes
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:  # not a GNU toolchain: nothing to share
        pass


_share_cxx_runtime()

from . import _C  # noqa: E402  (after the version check: a mismatched _C fails with undefined symbols)

__version__ = _build_info.VERSION
DistError = _C.DistError

from .global_var import config, rank, world_size  # noqa: E402
from .init import init_distributed, is_initialized  # noqa: E402
from .parameter import DistributedParameter, ParameterInitializer  # noqa: E402
from .layer import DistributedModule  # noqa: E402
from .param_init import init_parameters, grouped_parameters  # noqa: E402
from .synchronize import synchronize, sum_loss, gather_result, wait_loader  # noqa: E402
from .block_layer import Block, CheckpointBlock, TransformerBlockList, no_grad_sync  # noqa: E402
from .pipe_layer import PipelineTransformerBlockList  # noqa: E402
from .store import (save, load, save_checkpoint, load_checkpoint, load_hf_safetensors,  # noqa: E402
                    prepare_async_save)
from .utils import print_block, print_dict, print_rank, see_memory, main_grad, load_nccl_pypi  # noqa: E402
from .wrapper import BMTrainModelWrapper  # noqa: E402
from .estimate import estimate_memory  # noqa: E402
from . import debug, distributed, nn, loss, optim, lr_scheduler, benchmark, inspect, nccl, zero_context  # noqa: E402,F401
from . import torch_ops, recompute_tail  # noqa: E402,F401
