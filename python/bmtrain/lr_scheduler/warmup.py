"""BMTrain's module path bmtrain.lr_scheduler.warmup (for subclasses)."""
from . import WarmupLRScheduler  # noqa: F401
