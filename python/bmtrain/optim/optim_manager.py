"""OptimManager (BMTrain's bmtrain.optim.OptimManager): loss scaling, the global inf/NaN check, clipping and
LR scheduling over several optimizers (bmtrain's and torch.optim's), run by the engine (bmt::optim::OptimManager);
LR schedulers are stepped here after every step the engine did not skip."""
import torch

from .. import _C, torch_ops
from ..global_var import config
from .adam import _BmtOptimizer
from .auto_overlap import AutoStepInBackward


def _params_of(optimizer):
    seen, out = set(), []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


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
        self._torch_handles = []  # (torch optimizer, its engine handle)
        self._auto = AutoStepInBackward(self)  # the step inside the backward when the loop allows it

    def add_optimizer(self, optimizer, lr_scheduler=None):
        """bmtrain's optimizers (stepped by the engine with the loss scale) or any torch.optim.Optimizer (its
        gradients checked for inf/NaN with the others, divided by the loss scale, then its own step()), with an
        optional LR scheduler (anything with step(): bmt.lr_scheduler's or torch's), stepped after every step that
        is not skipped."""
        if isinstance(optimizer, _BmtOptimizer):
            self._c.add_optimizer(optimizer._c, None)
            optimizer._manager = self
        elif isinstance(optimizer, torch.optim.Optimizer):
            self._torch_handles.append((optimizer, self._c.add_torch_optimizer(optimizer, _params_of(optimizer))))
        else:
            raise TypeError(f"OptimManager.add_optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer "
                            "(use bmt.optim.AdamOptimizer, AdamOffloadOptimizer or a torch.optim optimizer)")
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def _sync(self):
        """Hands the Python side's current options and parameter lists to the engine before it runs."""
        for opt in self.optimizers:
            if isinstance(opt, _BmtOptimizer):
                opt._push_options()
        for opt, handle in self._torch_handles:
            handle.set_params(_params_of(opt))

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
        self._sync()  # overlapped updates start during the backward
        self._c.backward(loss)

    def zero_grad(self):
        torch_ops.close_window()
        self._sync()
        self._c.zero_grad()

    def step(self):
        """Steps every optimizer and LR scheduler unless a gradient is inf/NaN on some rank; then the step is
        skipped everywhere, gradients are zeroed and the loss scale lowered. Returns False when skipped."""
        self._sync()
        try:
            stepped = self._c.step()
        except RuntimeError as e:
            raise self._auto.step_error(e) from e
        self._auto.after_step()
        if stepped:
            for opt in self.optimizers:  # torch's LR schedulers check that the optimizer stepped
                opt._opt_called = True
            for s in self.lr_schedulers:
                if s is not None:
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
        """BMTrain's layout: {"optimizers": [each optimizer's state_dict()], "lr_schedulers": [state_dict() or None],
        "loss_scale", "loss_scale_enabled"}, plus "steps_since_last_scale" (BMTrain's load ignores it)."""
        opts = [o.state_dict(gather_opt) if isinstance(o, _BmtOptimizer) else o.state_dict() for o in self.optimizers]
        return {
            "optimizers": opts,
            "lr_schedulers": [s.state_dict() if s is not None else None for s in self.lr_schedulers],
            "loss_scale": self.loss_scale,
            "loss_scale_enabled": self.loss_scale_enabled,
            "steps_since_last_scale": self.steps_since_last_scale,
        }

    def load_state_dict(self, state_dict):
        """Loads BMTrain's layout (from BMTrain's OptimManager.state_dict() or ours)."""
        assert len(self.optimizers) == len(state_dict["optimizers"]), (
            f"OptimManager.load_state_dict: the state has {len(state_dict['optimizers'])} optimizers, this manager "
            f"{len(self.optimizers)}")
        assert len(self.lr_schedulers) == len(state_dict["lr_schedulers"]), (
            f"OptimManager.load_state_dict: the state has {len(state_dict['lr_schedulers'])} LR schedulers, this "
            f"manager {len(self.lr_schedulers)}")
        # The loss scale first: AdamOptimizer's fp16 moments are saved multiplied by it.
        self._c.set_loss_scale_state(float(state_dict["loss_scale"]), bool(state_dict["loss_scale_enabled"]),
                                     int(state_dict.get("steps_since_last_scale", 0)))
        for opt, st in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(st)
        for s, st in zip(self.lr_schedulers, state_dict["lr_schedulers"]):
            if s is not None and st is not None:
                s.load_state_dict(st)

    def _set_scale_state(self, scale=None, enabled=None, steps=None):
        self._c.set_loss_scale_state(float(self.loss_scale if scale is None else scale),
                                     bool(self.loss_scale_enabled if enabled is None else enabled),
                                     int(self.steps_since_last_scale if steps is None else steps))

    loss_scale = property(lambda self: self._c.loss_scale, lambda self, v: self._set_scale_state(scale=v))
    loss_scale_enabled = property(lambda self: self._c.loss_scale_enabled,
                                  lambda self, v: self._set_scale_state(enabled=v))
    steps_since_last_scale = property(lambda self: self._c.steps_since_last_scale,
                                      lambda self, v: self._set_scale_state(steps=v))
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
