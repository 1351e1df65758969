"""AdamOptimizer / AdamOffloadOptimizer: torch.optim.Optimizer subclasses (param_groups, state, add_param_group,
zero_grad, state_dict / load_state_dict in BMTrain's layout) whose step runs the engine's fused Adam
(python/csrc/bind_optim.cpp over src/bmt/optim/): the Python param groups hold the options (torch's and
bmt.lr_scheduler's schedulers write them there) and are handed to the engine before every update.

fp32 parameters are updated as BMTrain does, by torch.optim.Adam's own op sequence: bit-identical to
torch.optim.Adam(lr, betas, eps, weight_decay) (L2 weight decay), or with decoupled_weight_decay=True to
torch.optim.AdamW. Half-precision parameters use the fused kernel with decoupled weight decay and fp32 master weights
and moments (BMTrain's). hold_steps holds BMTrain's count of updates at lr 0 (fp32: hold_steps, half: hold_steps - 1).
The gradient of each parameter
is bmt.main_grad(p): a Block's gradient shard (in the parameter's dtype by default, so also `p.grad`; fp32 with
reduce_dtype=torch.float32), the engine's fp32 shard outside Blocks, else `p.grad` (plain torch parameters).
"""
from collections.abc import Mapping

import torch

from .. import _C

_OPTION_KEYS = ("lr", "betas", "eps", "weight_decay")


def _check_args(lr, betas, eps, weight_decay):
    # BMTrain's checks, with its messages and exception type.
    if not 0.0 <= lr:
        raise ValueError("Invalid learning rate: {}".format(lr))
    if not 0.0 <= eps:
        raise ValueError("Invalid epsilon value: {}".format(eps))
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError("Invalid beta parameter at index 0: {}".format(betas[0]))
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError("Invalid beta parameter at index 1: {}".format(betas[1]))
    if not 0.0 <= weight_decay:
        raise ValueError("Invalid weight_decay value: {}".format(weight_decay))


class _EngineState(Mapping):
    """optimizer.state: {param: {"step", "exp_avg", "exp_avg_sq"[, "_param_fp32"]}} read from the engine, the tensors
    aliasing its live state (shaped like the parameter). A parameter before its first update maps to {} (torch's
    defaultdict), without being added."""

    def __init__(self, optimizer):
        self._opt = optimizer

    def _params(self):
        return [p for g in self._opt.param_groups for p in g["params"]]

    def _entry(self, p):
        c = self._opt.__dict__.get("_c")
        s = c.param_state(p) if c is not None else None
        if s is None:
            return None
        step, m, v, master = s
        out = {"step": step, "exp_avg": m.view(p.shape), "exp_avg_sq": v.view(p.shape)}
        if master is not None:
            out["_param_fp32"] = master.view(p.shape)
        return out

    def __getitem__(self, p):
        e = self._entry(p) if isinstance(p, torch.Tensor) else None
        return {} if e is None else e

    def __iter__(self):
        return iter([p for p in self._params() if self._entry(p) is not None])

    def __len__(self):
        return sum(1 for _ in self)

    def __contains__(self, p):
        return isinstance(p, torch.Tensor) and self._entry(p) is not None

    def __repr__(self):
        return f"<{type(self._opt).__name__} state of {len(self)} parameters>"


class _BmtOptimizer(torch.optim.Optimizer):
    _bmtrain_optimizer = True  # BMTrain's marker: OptimManager hands it the loss scale
    _engine_class = None
    _offload = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0,
                 decoupled_weight_decay=False):
        _check_args(lr, betas, eps, weight_decay)
        self.__dict__["_c"] = None
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._hold_steps = hold_steps
        # Like hold_steps, an optimizer attribute: the param groups (and state_dict) keep BMTrain's keys. A group
        # dict given with its own "decoupled_weight_decay" key overrides it for that group.
        self._decoupled_weight_decay = bool(decoupled_weight_decay)
        self._c = self._engine_class([(g["params"], self._engine_options(g)) for g in self.param_groups],
                                     float(lr), (float(betas[0]), float(betas[1])), float(eps), float(weight_decay),
                                     int(hold_steps))
        self._manager = None  # the OptimManager this optimizer was added to (its loss scale, for fp16 state)

    # torch.optim.Optimizer assigns self.state = defaultdict(dict) in __init__ (and __setstate__ writes __dict__):
    # the state lives in the engine, read through this view.
    @property
    def state(self):
        return _EngineState(self)

    @state.setter
    def state(self, value):
        if len(value) != 0:
            raise RuntimeError(f"{type(self).__name__}.state belongs to the engine; use load_state_dict() to set it")

    def _decoupled(self, group):
        return bool(group.get("decoupled_weight_decay", self.__dict__.get("_decoupled_weight_decay", False)))

    def _engine_options(self, group):
        opts = {k: group[k] for k in _OPTION_KEYS}
        opts["hold_steps"] = self.__dict__.get("_hold_steps", 0)
        opts["decoupled_weight_decay"] = self._decoupled(group)
        return opts

    def _push_options(self):
        """Hands the Python groups' options (written by LR schedulers, torch tools, the user) to the engine."""
        for i, g in enumerate(self.param_groups):
            betas = g["betas"]
            _check_args(g["lr"], betas, g["eps"], g["weight_decay"])
            cur = self._c.group_options(i)
            for k, v in (("lr", float(g["lr"])), ("betas", (float(betas[0]), float(betas[1]))),
                         ("eps", float(g["eps"])), ("weight_decay", float(g["weight_decay"])),
                         ("decoupled_weight_decay", self._decoupled(g)),
                         ("hold_steps", int(self._hold_steps))):
                if cur[k] != v:
                    self._c.set_group_option(i, k, v)

    def _pull_options(self):
        """The engine's group options into the Python groups (after the engine loaded a checkpoint)."""
        for i, g in enumerate(self.param_groups):
            cur = self._c.group_options(i)
            for k in _OPTION_KEYS:
                g[k] = cur[k]

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self.__dict__.get("_c") is not None:
            g = self.param_groups[-1]
            self._c.add_param_group(g["params"], self._engine_options(g))

    @torch.no_grad()
    def step(self, closure=None, scale=1):
        """One update with the gradients divided by `scale` (the loss scale, when called directly)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_options()
        self._c.step(float(scale))
        return loss

    def zero_grad(self, set_to_none=False):
        """BMTrain's default keeps the gradient buffers (set_to_none=False)."""
        self._c.zero_grad(set_to_none)

    def _loss_scale(self):
        m = self._manager
        return m.loss_scale if m is not None else 1.0

    def state_dict(self, gather=False):
        """BMTrain's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "_param_fp32"]}},
        "param_groups": [{lr, betas, eps, weight_decay, ..., "params": [indices]}]} (offload: plus "is_whole"),
        each rank holding its own shards. AdamOptimizer keeps fp16 parameters' moments as BMTrain's kernel does
        (exp_avg fp16, both multiplied by the current loss scale); everything else is fp32."""
        if gather:
            raise NotImplementedError(f"{type(self).__name__}.state_dict(gather=True): use bmt.save_checkpoint(...), "
                                      "whose optimizer state loads at any world size")
        index, groups = {}, []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                packed["params"].append(index[id(p)])
            groups.append(packed)
        state = {}
        scale = self._loss_scale()
        for g in self.param_groups:
            for p in g["params"]:
                s = self.state[p]
                if not s:
                    continue
                out = {"step": s["step"], "exp_avg": s["exp_avg"].detach(), "exp_avg_sq": s["exp_avg_sq"].detach()}
                if "_param_fp32" in s:
                    out["_param_fp32"] = s["_param_fp32"].detach()
                elif self._offload:  # BMTrain's offload keeps a host fp32 copy of fp32 parameters too
                    out["_param_fp32"] = p.detach().to("cpu", torch.float32, copy=True)
                if p.dtype == torch.float16 and not self._offload:
                    out["exp_avg"] = (out["exp_avg"] * scale).half()
                    out["exp_avg_sq"] = out["exp_avg_sq"] * scale
                state[index[id(p)]] = out
        sd = {"state": state, "param_groups": groups}
        if self._offload:
            sd["is_whole"] = False
        return sd

    def load_state_dict(self, state_dict):
        """Loads BMTrain's layout (a state dict of BMTrain's AdamOptimizer / AdamOffloadOptimizer, or ours): group
        options as saved, per-parameter state by index. Checks as BMTrain does (ValueError)."""
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        if state_dict.get("is_whole", False):
            raise NotImplementedError(f"{type(self).__name__}.load_state_dict: a gathered state (is_whole=True, "
                                      "BMTrain's state_dict(gather=True)) cannot be loaded; save it per rank "
                                      "(gather=False) or use bmt.save_checkpoint / bmt.load_checkpoint")
        params = [p for g in groups for p in g["params"]]
        id_map = {}
        for s, g in zip(saved_groups, groups):
            for old, p in zip(s["params"], g["params"]):
                id_map[old] = p
        for k in state_dict["state"]:
            if k not in id_map:
                raise ValueError(f"{type(self).__name__}.load_state_dict: the state has an entry for parameter {k!r}, "
                                 "which no param group lists")
        flat = {"num_params": torch.tensor(len(params)), "num_groups": torch.tensor(len(groups))}
        pos = {id(p): i for i, p in enumerate(params)}
        for i, p in enumerate(params):
            flat[f"param.{i}.shape"] = torch.tensor(list(p.shape), dtype=torch.int64)
        for gi, (g, s) in enumerate(zip(groups, saved_groups)):
            betas = s.get("betas", g["betas"])
            for k, v in (("lr", s.get("lr", g["lr"])), ("beta1", betas[0]), ("beta2", betas[1]),
                         ("eps", s.get("eps", g["eps"])), ("weight_decay", s.get("weight_decay", g["weight_decay"]))):
                flat[f"group.{gi}.{k}"] = torch.tensor(float(v), dtype=torch.float64)
            flat[f"group.{gi}.num_params"] = torch.tensor(len(g["params"]))
        scale = self._loss_scale()
        for k, v in state_dict["state"].items():
            p = id_map[k]
            i = pos[id(p)]
            m, var = v["exp_avg"], v["exp_avg_sq"]
            if p.dtype == torch.float16 and not self._offload and m.dtype == torch.float16:
                m, var = m.float() / scale, var.float() / scale  # BMTrain's fp16 kernel keeps them scaled
            step = v["step"]
            flat[f"state.{i}.step"] = torch.tensor(int(step.item() if isinstance(step, torch.Tensor) else step))
            flat[f"state.{i}.exp_avg"] = m.detach().to(torch.float32).reshape(p.shape)
            flat[f"state.{i}.exp_avg_sq"] = var.detach().to(torch.float32).reshape(p.shape)
            if p.dtype != torch.float32:
                master = v.get("_param_fp32")
                flat[f"state.{i}.master"] = (p.detach().float() if master is None else
                                             master.detach().to(torch.float32)).reshape(p.shape)
        self._c.load_state_dict(flat)
        for g, s in zip(groups, saved_groups):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
        self._push_options()

    def refresh_master(self):
        """Re-reads fp32 master copies from the (half-precision) parameters, e.g. after loading weights."""
        self._c.refresh_master()

    def get_avg_delta(self):
        raise NotImplementedError("get delta info is not supported in Adam optimizer , try "
                                  "bmt.optim.AdamOffloadOptimizer(record_delta=True)")

    def get_var_delta(self):
        raise NotImplementedError("get delta info is not supported in Adam optimizer , try "
                                  "bmt.optim.AdamOffloadOptimizer(record_delta=True)")


class AdamOptimizer(_BmtOptimizer):
    """BMTrain's AdamOptimizer(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0), state
    on the parameters' device (beside the shards). fp32 parameters: torch.optim.Adam's update bit for bit (L2 weight
    decay); decoupled_weight_decay=True (ours, torch's keyword): torch.optim.AdamW's. Half-precision parameters:
    the fused kernel, decoupled weight decay (BMTrain's)."""
    _engine_class = _C.AdamOptimizer


class AdamOffloadOptimizer(_BmtOptimizer):
    """BMTrain's AdamOffloadOptimizer(params, lr, betas, eps, weight_decay, hold_steps=0, record_delta=False):
    the fp32 master weights and moments in host memory, the update on a persistent pool of CPU threads (vectorised
    kernel), gradients and new values crossing the bus through pinned buffers.
    Extras: async_step (step() returns before the Blocks' updates finish; each Block waits for its own before it
    next gathers), grad_transfer_dtype (e.g. torch.bfloat16: gradients cross the bus rounded, as BMTrain's do)."""
    _engine_class = _C.AdamOffloadOptimizer
    _offload = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0,
                 record_delta=False, *, async_step=False, grad_transfer_dtype=None, decoupled_weight_decay=False):
        if record_delta:
            raise NotImplementedError("AdamOffloadOptimizer(record_delta=True): update statistics are not "
                                      "available in bmtrain")
        super().__init__(params, lr, betas, eps, weight_decay, hold_steps, decoupled_weight_decay)
        self.record_delta = False
        if async_step:
            self._c.set_async_step(True)
        if grad_transfer_dtype is not None:
            self._c.set_grad_transfer_dtype(grad_transfer_dtype)

    def get_avg_delta(self):
        return 0  # BMTrain's value without record_delta

    def get_var_delta(self):
        return 0

    def wait(self):
        """Waits for every update still running (asynchronous step)."""
        self._c.wait()
