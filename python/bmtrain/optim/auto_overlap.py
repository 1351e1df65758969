"""The optimizer step inside the backward, switched on by OptimManager when the user's step allows it.

An unmodified BMTrain loop (zero_grad, backward, step) holds every Block's gradient shard from its reduction until
step(). The engine can instead update each Block as soon as its gradients are reduced, during the rest of the
backward, and free them (OptimManager.overlap_step_with_backward(release_gradients=True); C++
OptimManager::overlap_step_with_backward): the model's gradients are never all held at once, and on one rank the
Block hands its parameters' own gradients to the optimizer (no fp32 copy). The update is the same: the same Adam
arithmetic on the same gradients, element by element, only earlier.

"When the step allows it" -- mode "auto" (opt-in: BMT_STEP_IN_BACKWARD=auto or set_step_in_backward("auto"); the
default is off, since a script that reads gradients between backward() and step() would find them freed) turns it
on from the second iteration when
  * loss scaling is off (a skipped step cannot undo early updates),
  * every optimizer of the manager is a bmtrain AdamOptimizer / AdamOffloadOptimizer (the engine's overlap drives
    only those),
  * the user did not ask for an overlap themselves (overlap_*_with_backward), and
  * the first iteration was exactly one manager.backward() followed by step(), without clip_grad_norm() (clipping
    needs every gradient before any update; several backward() calls per step accumulate gradients).
A later iteration that breaks the pattern cannot be repaired after the fact (an early update is applied): a second
backward() before step() and clip_grad_norm() after early updates raise an error naming the switch. Differences a
user can see while it is on: an inf/NaN gradient raises in step() instead of skipping the step (loss scaling is off,
so BMTrain itself would apply it), and a Block's gradients are freed after its update (read them under
BMT_STEP_IN_BACKWARD=0).

Switch: BMT_STEP_IN_BACKWARD=auto|1|0 (1: from the first backward, an error if not possible; 0: never), or
OptimManager.set_step_in_backward("auto" | True | False).
"""
import os
import weakref

from .. import _C

_ENV = "BMT_STEP_IN_BACKWARD"


def _parse(value, what):
    if value is True or value is False:
        return value
    v = str(value).strip().lower()
    if v in ("auto", ""):
        return "auto"
    if v in ("1", "on", "true"):
        return True
    if v in ("0", "off", "false"):
        return False
    raise ValueError(f"{what}={value!r}: use auto, 1 (on) or 0 (off)")


class AutoStepInBackward:
    """Per OptimManager: watches its iterations and owns the engine's overlap handle when it turned it on."""

    def __init__(self, manager):
        self._manager = weakref.ref(manager)  # no cycle: the hook goes with the manager
        self.mode = _parse(os.environ.get(_ENV, "0"), _ENV)  # off unless asked: see the module docstring
        self.handle = None          # the engine's OffloadOverlap while on
        self.reason_off = None      # why auto mode stays off for good (None: not decided)
        self._clean = False         # a clean iteration was seen
        self._backwards = 0         # manager.backward() calls since the last step()
        self._clipped = False

    # ------------------------------------------------------------------------------------------- the switch

    def set_mode(self, mode):
        self.mode = _parse(mode, "set_step_in_backward")
        if self.mode is False:
            self._remove()

    def user_chose(self):
        """The user turns an overlap on (or off) themselves: auto mode steps aside."""
        self._remove()
        self.reason_off = "the script manages the overlap itself (overlap_*_with_backward)"

    def _remove(self):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _why_not(self):
        m = self._manager()
        if self.reason_off:
            return self.reason_off
        if m._c.loss_scale_enabled:
            return "loss scaling is on (a skipped step cannot undo early updates)"
        if not m.optimizers:
            return "no optimizer was added"
        for o in m.optimizers:
            if not isinstance(getattr(o, "_c", None), (_C.AdamOptimizer, _C.AdamOffloadOptimizer)):
                return f"{type(o).__name__} is not a bmtrain Adam optimizer"
        return None

    @property
    def active(self):
        return self.handle is not None

    # ------------------------------------------------------------------------------------- the manager's calls

    def before_backward(self):
        if self.handle is not None and self._backwards >= 1:
            raise RuntimeError(
                "OptimManager.backward: a second backward() before step(), but the optimizer step inside the "
                "backward is on (BMT_STEP_IN_BACKWARD / set_step_in_backward, default auto: it turned on after an "
                "iteration with one backward per step) and the first backward already updated the Blocks. To "
                "accumulate gradients over several backward() calls, run with BMT_STEP_IN_BACKWARD=0 or call "
                "manager.set_step_in_backward(False) before training")
        self._backwards += 1
        if self.handle is not None or self.mode is False:
            return
        why = self._why_not()
        if self.mode is True:
            if why:
                raise RuntimeError(f"OptimManager: the optimizer step inside the backward was asked for "
                                   f"(BMT_STEP_IN_BACKWARD=1 / set_step_in_backward(True)) but {why}")
            self.handle = self._manager()._c.overlap_step_with_backward(True)
        elif why is None and self._clean:
            self.handle = self._manager()._c.overlap_step_with_backward(True)

    def on_clip(self):
        self._clipped = True

    def clip_error(self, err):
        """clip_grad_norm refused by the engine after early updates: say how to turn the auto mode off."""
        if self.handle is None or "already updated" not in str(err):
            return err
        return RuntimeError(f"{err}\n(The step inside the backward was turned on by OptimManager, "
                            f"{_ENV}={self.mode if self.mode is not True else 1}: the first iteration did not clip. "
                            f"To clip, run with {_ENV}=0 or call manager.set_step_in_backward(False) before training)")

    def step_error(self, err):
        """step() found inf/NaN after early updates (the engine raises): say how to have such steps skipped."""
        if self.handle is None or "already updated" not in str(err):
            return err
        return RuntimeError(f"{err}\n(The step inside the backward was on: {_ENV}=0 or "
                            "manager.set_step_in_backward(False) skips such steps instead)")

    def after_step(self):
        if self.mode == "auto" and self.handle is None and self.reason_off is None:
            if self._clipped:
                self.reason_off = "the script clips gradients (clip_grad_norm)"
            elif self._backwards > 1:
                self.reason_off = "the script runs several backward() calls per step"
            elif self._backwards == 1:
                self._clean = True
        self._backwards = 0
        self._clipped = False
