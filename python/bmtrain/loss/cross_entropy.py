"""BMTrain's module path bmtrain.loss.cross_entropy."""
from . import FusedCrossEntropy  # noqa: F401
