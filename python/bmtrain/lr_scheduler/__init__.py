"""bmtrain.lr_scheduler: BMTrain 1.0.1's warm-up schedules, for any optimizer with param_groups (bmtrain's or
torch.optim's). t = num_iter, W = warmup_iter, E = end_iter, S = start_lr: warm-up S * t / W (Noam: S / sqrt(W) *
t / W), so the first update uses lr 0 when W > 0, then NoDecay S, Noam S / sqrt(t), Linear max(0, S * (E - t) /
(E - W)), Cosine max(0, S / 2 * (1 + cos(pi (t - W) / max(1, E - W)))) (it rises again after E, as BMTrain's),
Exponential max(0, S * gamma^(t - W)).

step() writes the new lr into every param group; OptimManager steps the scheduler added with an optimizer after
every step it does not skip. Subclasses override get_lr_warmup / get_lr_decay, as with BMTrain. (The C++ engine's
schedulers, bmt::optim::lr_scheduler, serve C++ programs.)"""
import math


class WarmupLRScheduler:
    """Base class: WarmupLRScheduler(optimizer, start_lr, warmup_iter, end_iter, num_iter=0). The constructor
    applies lr(num_iter) at once; step() advances num_iter by one (step(n) jumps to n)."""

    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter=0):
        self.start_lr = start_lr
        self.warmup_iter = warmup_iter
        self.end_iter = end_iter
        self.optimizer = optimizer
        self.num_iter = num_iter
        self._current_lr = None
        self.step(self.num_iter)

    def get_lr_warmup(self, num_iter):
        return self.start_lr * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter):
        raise NotImplementedError(f"{type(self).__name__} must define get_lr_decay(num_iter)")

    def get_lr(self):
        assert self.num_iter >= 0
        if self.num_iter < self.warmup_iter:
            return self.get_lr_warmup(self.num_iter)
        return self.get_lr_decay(self.num_iter)

    @property
    def current_lr(self):
        return self._current_lr

    def step(self, num_iter=None):
        if num_iter is None:
            num_iter = self.num_iter + 1
        self.num_iter = num_iter
        lr = self.get_lr()
        self._current_lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                "num_iter": self.num_iter}

    def load_state_dict(self, state_dict):
        self.start_lr = state_dict["start_lr"]
        self.warmup_iter = state_dict["warmup_iter"]
        self.end_iter = state_dict["end_iter"]
        self.num_iter = state_dict["num_iter"]
        self.step(self.num_iter)


class NoDecay(WarmupLRScheduler):
    """Warm-up, then the constant start_lr."""

    def get_lr_decay(self, num_iter):
        return self.start_lr


class Noam(WarmupLRScheduler):
    """Warm-up S / sqrt(W) * t / W, then S / sqrt(t)."""

    def get_lr_warmup(self, num_iter):
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter):
        return self.start_lr / math.sqrt(num_iter)


class Linear(WarmupLRScheduler):
    """Warm-up, then linear decay to 0 at end_iter (0 after it)."""

    def get_lr_decay(self, num_iter):
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / (self.end_iter - self.warmup_iter))


class Cosine(WarmupLRScheduler):
    """Warm-up, then cosine decay to 0 at end_iter (rising again after it, as BMTrain's)."""

    def get_lr_decay(self, num_iter):
        progress = (num_iter - self.warmup_iter) / max(1, (self.end_iter - self.warmup_iter))
        return max(0.0, self.start_lr * 0.5 * (1.0 + math.cos(progress * math.pi)))


class Exponential(WarmupLRScheduler):
    """Warm-up, then start_lr * gamma^(t - warmup_iter)."""

    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter=0, gamma=0.95):
        self.gamma = gamma  # before the first step (BMTrain sets it after, failing when num_iter >= warmup_iter)
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def get_lr_decay(self, num_iter):
        return max(0.0, self.start_lr * self.gamma ** (num_iter - self.warmup_iter))
