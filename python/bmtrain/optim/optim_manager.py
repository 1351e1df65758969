"""OptimManager (BMTrain's bmtrain.optim.OptimManager): loss scaling, the global inf/NaN check, clipping and
LR scheduling over several optimizers, run by the engine (bmt::optim::OptimManager)."""
from .. import _C, torch_ops
from ..global_var import config
from .auto_overlap import AutoStepInBackward


class OptimManager:
    """OptimManager(loss_scale=None, loss_scale_factor=2, loss_scale_steps=1024, min_loss_scale=1,
    max_loss_scale=inf, grad_scale=None). loss_scale None disables scaling. grad_scale None = BMTrain's default,
    world_size / pipe_size (bmt.config["zero_size"]): backward() multiplies the loss by loss_scale / grad_scale, and
    gradients are summed over ranks, so per-rank mean losses give mean gradients."""

    def __init__(self, loss_scale=None, loss_scale_factor=2, loss_scale_steps=1024, min_loss_scale=1,
                 max_loss_scale=float("inf"), grad_scale=None):
        if grad_scale is None:
            grad_scale = config.get("zero_size", 1) if config["initialized"] else 1
        self._c = _C.OptimManager(float(loss_scale or 0), float(loss_scale_factor), int(loss_scale_steps),
                                  float(min_loss_scale), float(max_loss_scale), float(grad_scale))
        self.optimizers = []
        self.lr_schedulers = []
        self._python_schedulers = []  # user subclasses of WarmupLRScheduler, stepped here
        self._auto = AutoStepInBackward(self)  # the step inside the backward when the loop allows it

    def add_optimizer(self, optimizer, lr_scheduler=None):
        if not getattr(optimizer, "_bmtrain_optimizer", False) or not hasattr(optimizer, "_c"):
            raise TypeError(f"OptimManager.add_optimizer: {type(optimizer).__name__} is not a bmtrain optimizer; use "
                            "bmt.optim.AdamOptimizer or bmt.optim.AdamOffloadOptimizer")
        engine_sched = getattr(lr_scheduler, "_c", None)
        self._c.add_optimizer(optimizer._c, engine_sched)
        if lr_scheduler is not None and engine_sched is None:
            self._python_schedulers.append(lr_scheduler)
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def overlap_offload_with_backward(self):
        """Starts each Block's CPU Adam update (AdamOffloadOptimizer) as soon as the Block's gradients are reduced,
        while the rest of the backward runs. A Block whose gradients hold inf/NaN is left to step(); refused with
        loss scaling (an early update cannot be undone). Returns a handle: .remove(), or use it as a context
        manager; .num_early_starts counts the updates started early."""
        self._auto.user_chose()
        return _OverlapHandle(self._c.overlap_offload_with_backward())

    def overlap_step_with_backward(self, release_gradients=True):
        """Updates each Block as soon as its gradients are reduced, during the rest of the backward, with every Adam
        of this manager (GPU AdamOptimizer: queued without a host wait; AdamOffloadOptimizer as above). With
        release_gradients a Block's fp32 gradient shards are freed after its update, so the model's gradients are
        never all held at once. clip_grad_norm is refused after early updates; refused with loss scaling. Returns a
        handle like overlap_offload_with_backward()."""
        self._auto.user_chose()
        return _OverlapHandle(self._c.overlap_step_with_backward(bool(release_gradients)))

    def scale_loss(self, loss):
        return self._c.scale_loss(loss)

    def set_step_in_backward(self, mode):
        """"auto" (default, env BMT_STEP_IN_BACKWARD), True or False: update each Block during the backward, as
        overlap_step_with_backward() does, when the loop allows it (optim/auto_overlap.py says when)."""
        self._auto.set_mode(mode)

    step_in_backward_active = property(lambda self: self._auto.active)

    def backward(self, loss):
        torch_ops.close_window()
        self._auto.before_backward()
        self._c.backward(loss)

    def zero_grad(self):
        torch_ops.close_window()
        self._c.zero_grad()

    def step(self):
        """Steps every optimizer and LR scheduler unless a gradient is inf/NaN on some rank; then the step is
        skipped everywhere, gradients are zeroed and the loss scale lowered. Returns False when skipped."""
        try:
            stepped = self._c.step()
        except RuntimeError as e:
            raise self._auto.step_error(e) from e
        self._auto.after_step()
        if stepped:
            for s in self._python_schedulers:
                s.step()
        return stepped

    def clip_grad_norm(self, param_groups, max_norm, norm_type=2, eps=1e-6):
        """Clips the gradients of the parameters in `param_groups` (a list of groups with "params", or of
        parameters) to the global norm max_norm; returns the norm before clipping (unscaled)."""
        params = []
        for g in param_groups:
            if isinstance(g, dict) or hasattr(g, "keys"):
                params.extend(g["params"])
            else:
                params.append(g)
        self._auto.on_clip()
        try:
            return self._c.clip_grad_norm(params, float(max_norm), float(norm_type), float(eps))
        except RuntimeError as e:
            raise self._auto.clip_error(e) from e

    def state_dict(self, gather_opt=False):
        if gather_opt:
            raise NotImplementedError("OptimManager.state_dict(gather_opt=True): use bmt.save_checkpoint(...), "
                                      "whose optimizer state loads at any world size")
        sd = dict(self._c.state_dict())
        for i, s in enumerate(self.lr_schedulers):
            if s is not None and getattr(s, "_c", None) is None:
                import torch
                sd[f"python_lr_schedulers.{i}.num_iter"] = torch.tensor([s.num_iter], dtype=torch.int64)
        return sd

    def load_state_dict(self, state):
        state = dict(state)
        extra = {k: state.pop(k) for k in list(state) if k.startswith("python_lr_schedulers.")}
        self._c.load_state_dict(state)
        for i, s in enumerate(self.lr_schedulers):
            key = f"python_lr_schedulers.{i}.num_iter"
            if key in extra:
                s.step(int(extra[key][0]))

    loss_scale = property(lambda self: self._c.loss_scale)
    loss_scale_enabled = property(lambda self: self._c.loss_scale_enabled)
    steps_since_last_scale = property(lambda self: self._c.steps_since_last_scale)
    loss_scale_factor = property(lambda self: self._c.loss_scale_factor)
    loss_scale_steps = property(lambda self: self._c.loss_scale_steps)
    min_loss_scale = property(lambda self: self._c.min_loss_scale)
    max_loss_scale = property(lambda self: self._c.max_loss_scale)
    grad_scale = property(lambda self: self._c.grad_scale)
    num_skipped_steps = property(lambda self: self._c.num_skipped_steps)


class _OverlapHandle:
    def __init__(self, handle):
        self._h = handle

    def remove(self):
        self._h.remove()

    active = property(lambda self: self._h.active)
    num_early_starts = property(lambda self: self._h.num_early_starts)
    num_nonfinite_blocks = property(lambda self: self._h.num_nonfinite_blocks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False
