"""BMTrain's module path bmtrain.optim.adam_offload."""
from .adam import AdamOffloadOptimizer  # noqa: F401
