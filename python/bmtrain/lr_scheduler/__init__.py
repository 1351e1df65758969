"""bmtrain.lr_scheduler: BMTrain's warm-up schedules. The built-in ones run in the engine (OptimManager steps them
after each step that is not skipped) with BMTrain's formulas, t = num_iter, W = warmup_iter, E = end_iter,
S = start_lr: warm-up S * t / W (Noam: S / sqrt(W) * t / W), so the first update uses lr 0 when W > 0, then
NoDecay S, Noam S / sqrt(t), Linear S * (E - t) / (E - W), Cosine S / 2 * (1 + cos(pi (t - W) / (E - W))),
Exponential S * gamma^(t - W); Linear and Cosine reach 0 at E and stay there (BMTrain's Cosine rises again).

A user subclass of WarmupLRScheduler that overrides get_lr_warmup / get_lr_decay runs in Python, stepped by
OptimManager the same way."""
import math

from .. import _C


class WarmupLRScheduler:
    """Base class: WarmupLRScheduler(optimizer, start_lr, warmup_iter, end_iter, num_iter=0). The constructor
    applies lr(num_iter) at once; step() advances num_iter by one (step(n) jumps to n) and writes the lr into every
    param group."""
    _engine_class = None

    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter=0, **engine_kwargs):
        self.optimizer = optimizer
        if self._engine_class is not None and type(self).get_lr_warmup is WarmupLRScheduler.get_lr_warmup \
                and type(self).get_lr_decay is type(self)._builtin_decay:
            self._c = self._engine_class(optimizer._c, float(start_lr), int(warmup_iter), int(end_iter),
                                         int(num_iter), **engine_kwargs)
            self._c.warmup_from_zero(True)
        else:
            self._c = None
            self._start_lr, self._warmup_iter, self._end_iter = start_lr, warmup_iter, end_iter
            self._num_iter = num_iter
            self._current_lr = 0.0
            self.step(num_iter)

    _builtin_decay = None

    # Python path (user subclasses) -------------------------------------------------------------------------------
    def get_lr_warmup(self, num_iter):
        return self.start_lr * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter):
        raise NotImplementedError("a WarmupLRScheduler subclass must define get_lr_decay(num_iter)")

    def get_lr(self):
        if self._c is not None:
            return self._c.get_lr()
        t = self._num_iter
        return self.get_lr_warmup(t) if t < self._warmup_iter else self.get_lr_decay(t)

    @property
    def current_lr(self):
        return self._c.current_lr if self._c is not None else self._current_lr

    @property
    def num_iter(self):
        return self._c.num_iter if self._c is not None else self._num_iter

    @property
    def start_lr(self):
        return self._c.start_lr if self._c is not None else self._start_lr

    @property
    def warmup_iter(self):
        return self._c.warmup_iter if self._c is not None else self._warmup_iter

    @property
    def end_iter(self):
        return self._c.end_iter if self._c is not None else self._end_iter

    def step(self, num_iter=None):
        if self._c is not None:
            if num_iter is None:
                self._c.step()
            else:
                self._c.step_to(int(num_iter))
            return
        self._num_iter = self._num_iter + 1 if num_iter is None else int(num_iter)
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self):
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                "num_iter": self.num_iter}

    def load_state_dict(self, state_dict):
        self.step(int(state_dict["num_iter"]))


def _builtin(name, engine_class, doc):
    def decay(self, num_iter):  # placeholder that marks "not overridden"; the engine computes the built-ins
        raise AssertionError("built-in schedules are computed by the engine")

    cls = type(name, (WarmupLRScheduler,), {"_engine_class": engine_class, "_builtin_decay": decay,
                                            "get_lr_decay": decay, "__doc__": doc})
    return cls


NoDecay = _builtin("NoDecay", _C.NoDecay, "Warm-up, then the constant start_lr.")
Noam = _builtin("Noam", _C.Noam, "Noam: warm-up S/sqrt(W)*t/W, then S/sqrt(t).")
Linear = _builtin("Linear", _C.Linear, "Warm-up, then linear decay to 0 at end_iter.")
Cosine = _builtin("Cosine", _C.Cosine, "Warm-up, then cosine decay to 0 at end_iter.")


class Exponential(WarmupLRScheduler):
    """Warm-up, then start_lr * gamma^(t - warmup_iter)."""
    _engine_class = _C.Exponential

    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter=0, gamma=0.95):
        self.gamma = gamma
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter, gamma=float(gamma))

    def _builtin_decay(self, num_iter):
        raise AssertionError("computed by the engine")

    get_lr_decay = _builtin_decay


del math
