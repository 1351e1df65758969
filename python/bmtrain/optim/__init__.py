"""bmtrain.optim: AdamOptimizer, AdamOffloadOptimizer, OptimManager (BMTrain's names and arguments), run by the
engine: the fused Adam kernels (GPU) and the vectorised CPU Adam with host-resident state (offload)."""
from .adam import AdamOptimizer, AdamOffloadOptimizer
from .optim_manager import OptimManager

__all__ = ["AdamOptimizer", "AdamOffloadOptimizer", "OptimManager"]
