"""Optimizers that step flat parameter vectors, with their state kept in client banks.

The update rules are torch.optim's (SGD with momentum, dampening, weight decay and Nesterov;
Adam with bias correction, optionally AdamW's decoupled decay), written over one flat vector:
a step is a few fused tensor ops whatever the number of tensors in the model (or of clients:
the batched executor steps stacked rows [C, P] sharing a step count in one call), and the state
(momentum, moments, step count) of every client is a row of a bank, so it survives between
rounds without a per-client ``torch.optim`` object.  ``ranges`` restrict a step to parameter
groups (a phase that trains only the head, only α, ...); the rest is left untouched.  ``lr``, a
[C, 1] tensor, gives stacked rows learning rates of their own (clients whose phases differ only
in their learning rate step together).  ``lr_scale``, a tensor over the whole vector ([P], or
[C, P] for stacked rows), multiplies the learning rate element by element: each parameter
tensor then steps at its own rate, as a torch.optim parameter group with lr × scale would
(pFedMB's lr / ‖α_l‖² per layer).  The scale multiplies the step, after momentum, Adam's
normalization and weight decay are applied, so it holds under every rule (a scaled gradient
would be normalized away by Adam).

``capturable=True`` steps without reading anything back to the host, so that a CUDA graph can
capture the step (``step_graphs``): the step count is then a tensor on the parameters' device
([] or [C], one per row: rows may differ), SGD's first-step choice a ``torch.where`` and Adam's
bias corrections tensors computed from it in float64, as torch.optim's ``capturable`` does.
SGD's capturable step is bitwise its host step; Adam's agrees to float rounding (the
corrections reach the update as tensors, not as host scalars).

These optimizers serve server-side updates too (``pfl_algorithms.api`` exports them): FedGen's
generator and pFedHN's hypernetwork step their flat parameter vectors with them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

Ranges = Optional[Sequence[tuple[int, int]]]


def _pieces(ranges: Ranges, *tensors: Optional[torch.Tensor]):
    """The tensors restricted to each range of their last dimension (or whole, when ranges is
    None): flat vectors [P], or the stacked rows [C, P] of the batched executor; None stays None."""
    if ranges is None:
        yield tensors
        return
    for start, stop in ranges:
        yield tuple(None if t is None else t[..., start:stop] for t in tensors)


def _per_row(steps: torch.Tensor) -> torch.Tensor:
    """A step count [] or [C] shaped to broadcast against a piece [P] or [C, P]."""
    return steps[..., None]


def _check_scale(params: torch.Tensor, lr_scale: Optional[torch.Tensor]) -> None:
    if lr_scale is not None and lr_scale.shape[-1] != params.shape[-1]:
        raise ValueError(f"lr_scale must cover the whole vector ({params.shape[-1]} entries in its last dim), "
                         f"got {list(lr_scale.shape)}")


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD's rule.  State: ``momentum_buffer`` [P] (when momentum != 0)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        if not self.lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not self.momentum >= 0.0:
            raise ValueError(f"momentum must be >= 0, got {self.momentum}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")

    def state_names(self) -> tuple[str, ...]:
        """The flat state vectors (each [P]) this optimizer keeps per client."""
        return ("momentum_buffer",) if self.momentum != 0.0 else ()

    @torch.no_grad()
    def step(self, params: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
             *, ranges: Ranges = None, lr: Optional[torch.Tensor] = None,
             lr_scale: Optional[torch.Tensor] = None, capturable: bool = False) -> None:
        """One step of ``params`` [P] (or rows [C, P]) given ``grads`` (may be overwritten);
        ``lr`` [C, 1]: each row's learning rate instead of ``self.lr``; ``lr_scale`` [P] or
        [C, P]: a multiplier of the rate per element; ``capturable``: no host read, the step
        count a tensor on the parameters' device (module docstring)."""
        _check_scale(params, lr_scale)
        # torch.optim starts the buffer at the first gradient.
        first = _per_row(state["steps"] == 0) if capturable else int(state["steps"]) == 0
        buffers = (state["momentum_buffer"],) if self.momentum != 0.0 else ()
        for p, g, scale, *buf in _pieces(ranges, params, grads, lr_scale, *buffers):
            if self.weight_decay != 0.0:
                g.add_(p, alpha=self.weight_decay)
            if self.momentum != 0.0:
                b = buf[0]
                if capturable:
                    b.copy_(torch.where(first, g, b.mul(self.momentum).add_(g, alpha=1.0 - self.dampening)))
                elif first:
                    b.copy_(g)
                else:
                    b.mul_(self.momentum).add_(g, alpha=1.0 - self.dampening)
                if self.nesterov:
                    g.add_(b, alpha=self.momentum)
                else:
                    g = b
            if scale is not None:
                g = g * scale
            if lr is None:
                p.add_(g, alpha=-self.lr)
            else:
                p.addcmul_(g, lr, value=-1.0)
        state["steps"] += 1


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam's rule (``decoupled=True``: AdamW).  State: ``exp_avg``, ``exp_avg_sq``."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self):
        if not self.lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not (0.0 <= self.betas[0] < 1.0 and 0.0 <= self.betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {self.betas}")
        if not self.eps >= 0.0 or not self.weight_decay >= 0.0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {self.eps}, {self.weight_decay}")

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def step(self, params: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
             *, ranges: Ranges = None, lr: Optional[torch.Tensor] = None,
             lr_scale: Optional[torch.Tensor] = None, capturable: bool = False) -> None:
        """One step of ``params`` [P] (or rows [C, P]) given ``grads`` (may be overwritten);
        ``lr`` [C, 1]: each row's learning rate instead of ``self.lr``; ``lr_scale`` [P] or
        [C, P]: a multiplier of the rate per element; ``capturable``: no host read, the step
        count a tensor on the parameters' device (module docstring)."""
        _check_scale(params, lr_scale)
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        if capturable:  # the corrections in float64, as the host computes them, then a tensor each
            step = _per_row(state["steps"]).to(torch.float64) + 1
            step_size = (lr / (1.0 - torch.pow(beta1, step))).to(params.dtype)
            bias2_sqrt = (1.0 - torch.pow(beta2, step)).sqrt_().to(params.dtype)
        else:
            step = int(state["steps"]) + 1
            bias1 = 1.0 - beta1 ** step
            bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
            step_size = lr / bias1
        for p, g, scale, m, v in _pieces(ranges, params, grads, lr_scale, state["exp_avg"], state["exp_avg_sq"]):
            if self.weight_decay != 0.0:
                if self.decoupled:
                    p.mul_(1.0 - (lr * self.weight_decay if scale is None else scale * (lr * self.weight_decay)))
                else:
                    g.add_(p, alpha=self.weight_decay)
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            update = m if scale is None else m * scale
            if isinstance(step_size, torch.Tensor):
                p.addcdiv_(update * step_size, denom, value=-1.0)
            else:
                p.addcdiv_(update, denom, value=-step_size)
        state["steps"] += 1


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": lambda **kw: Adam(decoupled=True, **kw)}

# The settings each optimizer takes besides lr (torch.optim's names).
TAKES = {"sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
         "adam": ("betas", "eps", "weight_decay"), "adamw": ("betas", "eps", "weight_decay")}


def make_optimizer(name: str, **settings):
    """An optimizer by name (``sgd``, ``adam``, ``adamw``) with torch.optim's argument names."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name](**settings)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"optimizer setting {name} must be a number, got {value!r}")
    return value


@dataclass(frozen=True)
class OptimizerSettings:
    """An optimizer by name with its settings (torch.optim's names and defaults): the run's
    (``EngineSettings.optimizer``, from ``RunConfig``'s optimizer, lr, momentum, weight_decay)
    and each phase's (``Phase.settings_for`` merges a phase's overrides into the run's).

    A setting the named optimizer does not take must stay at its default (``momentum`` is
    SGD's, ``betas`` and ``eps`` Adam's); every error is one line naming the setting.
    ``build()`` gives the optimizer."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        if not isinstance(self.name, str) or self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; valid: {', '.join(sorted(OPTIMIZERS))}")
        for name in ("lr", "momentum", "dampening", "eps", "weight_decay"):
            _number(name, getattr(self, name))
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"optimizer setting nesterov must be True or False, got {self.nesterov!r}")
        betas = self.betas
        if isinstance(betas, (list, tuple)) and len(betas) == 2:
            object.__setattr__(self, "betas", (_number("betas", betas[0]), _number("betas", betas[1])))
        else:
            raise ValueError(f"optimizer setting betas must be two numbers, got {betas!r}")
        taken = TAKES[self.name]
        for f in fields(self):
            if f.name not in ("name", "lr", *taken) and getattr(self, f.name) != f.default:
                raise ValueError(f"optimizer setting {f.name}={getattr(self, f.name)!r} does not apply to "
                                 f"{self.name} (it takes lr, {', '.join(taken)})")
        self.build()  # the optimizer's own checks (lr >= 0, nesterov with momentum, ...)

    def settings(self) -> dict:
        """The optimizer's keyword arguments: lr and the settings its rule takes."""
        return {"lr": self.lr, **{name: getattr(self, name) for name in TAKES[self.name]}}

    def build(self):
        """The optimizer (``SGD`` or ``Adam``) with these settings."""
        return make_optimizer(self.name, **self.settings())
