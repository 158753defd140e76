"""Drop-in multi-branch layers of pFedMB: W = Σ_b α_b W_b with α on the simplex (Eq. 1–2).

Each layer holds B branch weights ``branch_weight`` [B, *weight shape], per-branch biases
``branch_bias`` [B, out] combined with the same α, and ``alpha_param`` [B]: the logits of
α under ``simplex='softmax'`` (the default; the paper does not say how it keeps α on the
simplex) or α itself under ``simplex='project'``, kept on the simplex by
``project_alpha_()`` after each optimizer step.  Initial α is uniform (the paper's choice).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..ops import project_simplex_
from ..ops._checks import positive_int
from ._conv import (adopt_conv2d_arguments, conv2d_arguments, conv2d_extra_repr, conv2d_forward, keep_requires_grad,
                    linear_arguments)
from ._convertible import check_convertible
from ._read_only import RebuiltAttributes, read_only

SIMPLEX_MODES = ("softmax", "project")


def check_noise(noise) -> None:
    """ValueError unless ``noise`` is a finite real number >= 0 (not a bool)."""
    if isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not 0 <= noise < math.inf:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")


class _MultiBranchMixin(RebuiltAttributes):
    """Parameters, α on the simplex and the combined weight, shared by both layers."""

    branch_weight: nn.Parameter
    branch_bias: Optional[nn.Parameter]
    alpha_param: nn.Parameter
    _rebuilt_attributes = ("weight", "bias")
    # The parameters made from a dense layer's weight and bias (from_dense, multibranch); α
    # weighs the weight's branches, so it follows the weight.
    made_from = {"weight": ("branch_weight", "alpha_param"), "bias": ("branch_bias",)}

    def _init_parameters(self, shape, branches, simplex, bias, device, dtype) -> None:
        if simplex not in SIMPLEX_MODES:
            raise ValueError(f"simplex must be one of {SIMPLEX_MODES}, got {simplex!r}")
        self.branches = positive_int("branches", branches)
        self.simplex = simplex
        self.weight_shape = tuple(shape)
        kw = {"device": device, "dtype": dtype}
        self.branch_weight = nn.Parameter(torch.empty(branches, *shape, **kw))
        self.register_parameter("branch_bias", nn.Parameter(torch.empty(branches, shape[0], **kw)) if bias else None)
        self.alpha_param = nn.Parameter(torch.empty(branches, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each branch initialised as the dense layer would be (independent draws); α uniform."""
        fan_in = math.prod(self.weight_shape[1:])
        for branch in self.branch_weight:
            # nn.Conv2d / nn.Linear: kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
            nn.init.kaiming_uniform_(branch, a=math.sqrt(5))
        if self.branch_bias is not None:
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(self.branch_bias, -bound, bound)
        self._reset_alpha()

    def _reset_alpha(self) -> None:
        with torch.no_grad():
            if self.simplex == "softmax":
                self.alpha_param.zero_()
            else:
                self.alpha_param.fill_(1.0 / self.branches)

    @property
    def alpha(self) -> torch.Tensor:
        """α [B] on the simplex (differentiable with respect to ``alpha_param``)."""
        if self.simplex == "softmax":
            return torch.softmax(self.alpha_param, dim=-1)
        return self.alpha_param

    @property
    def weight(self) -> torch.Tensor:
        """Σ_b α_b W_b, in the shape of the dense layer's weight.

        Read-only: it is rebuilt on every access, so writing to it (``nn.init.*_``,
        ``.zero_()``, ``.data = ...``, assigning it) raises ``ReadOnlyWeightError``;
        initialise ``branch_weight`` and ``alpha_param`` instead.
        """
        return read_only(torch.ops.pfl.branch_combine(self.branch_weight, self.alpha), self._write_error("weight"))

    @property
    def bias(self) -> Optional[torch.Tensor]:
        """Σ_b α_b bias_b, or None without bias (read-only, as ``weight``)."""
        if self.branch_bias is None:
            return None
        return read_only(torch.ops.pfl.branch_combine(self.branch_bias, self.alpha), self._write_error("bias"))

    def _write_error(self, name: str) -> str:
        cls = type(self).__name__
        branches = "branch_weight" if name == "weight" else "branch_bias"
        return (f"{cls}.{name} is the sum over b of alpha_b * {branches}[b], rebuilt on every access, so "
                f"writing to it would change nothing; initialise the branches instead: reset_parameters(), "
                f"{cls}.from_dense(dense_layer), or write layer.{branches} (and layer.alpha_param) under "
                f"torch.no_grad() (e.g. layer.{branches}.copy_(value.expand_as(layer.{branches}))); "
                f"for a copy you can write to, use layer.{name}.detach().clone()")

    def _combined(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        # The ops themselves, not the validating wrappers (shapes are fixed at construction
        # and the ops still check them); one softmax for weight and bias.
        alpha = self.alpha
        bias = None if self.branch_bias is None else torch.ops.pfl.branch_combine(self.branch_bias, alpha)
        return torch.ops.pfl.branch_combine(self.branch_weight, alpha), bias

    @torch.no_grad()
    def project_alpha_(self) -> None:
        """Project α back onto the simplex (``simplex='project'``; a no-op under softmax)."""
        if self.simplex == "project":
            project_simplex_(self.alpha_param)

    def _load_dense(self, module: nn.Module, noise: float) -> None:
        """Every branch := the dense layer's weight (+ Gaussian noise of std noise·std(weight)) and
        bias; α uniform; the dense layer's train/eval mode and its parameters' requires_grad."""
        check_noise(noise)
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        with torch.no_grad():
            self.branch_weight.copy_(weight.expand_as(self.branch_weight))
            if noise > 0:
                # A one-entry weight has no spread to scale by (its unbiased std is NaN, which
                # made every branch NaN): its branches stay equal.
                scale = noise * weight.std() if weight.numel() > 1 else 0.0
                self.branch_weight.add_(torch.randn_like(self.branch_weight) * scale)
            if bias is not None:
                self.branch_bias.copy_(bias.expand_as(self.branch_bias))
        self._reset_alpha()
        self.train(module.training)
        keep_requires_grad(self, module, self.made_from)

    def _branch_repr(self) -> str:
        return f", branches={self.branches}, simplex={self.simplex!r}"


class MultiBranchConv2d(_MultiBranchMixin, nn.Module):
    """``nn.Conv2d`` whose weight and bias are convex combinations of B branches (pFedMB Eq. 1–2).

    Takes every ``nn.Conv2d`` argument with the same meaning, plus ``branches`` (B >= 1) and
    ``simplex`` ('softmax' or 'project').  ``weight``, ``bias`` and ``alpha`` are properties
    (writing to ``weight`` or ``bias`` raises ``ReadOnlyWeightError``).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None, *,
                 branches=2, simplex="softmax"):
        super().__init__()
        shape = adopt_conv2d_arguments(self, in_channels, out_channels, kernel_size, stride, padding,
                                       dilation, groups, bias, padding_mode)
        self._init_parameters(shape, branches, simplex, bias, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return conv2d_forward(self, input, *self._combined())

    def _apply(self, fn, recurse=True):
        # nn.Module.to(memory_format=torch.channels_last) converts every 4-D and 5-D tensor, and
        # torch refuses channels_last for a 5-D one, so a model holding this layer could not be
        # moved to channels_last.  The [B, O, I, kh, kw] branches go through ``fn`` as the
        # [B·O, I, kh, kw] stack of B convolution weights (a view): each branch then has the
        # memory format that ``fn`` gives a Conv2d weight.  Every other ``fn`` (device, dtype,
        # to_empty, share_memory_) treats the entries alike, so the flattening changes nothing.
        def on_branches_as_conv_weights(t):
            if t.dim() == 5:
                return fn(t.flatten(0, 1)).unflatten(0, t.shape[:2])
            return fn(t)

        return super()._apply(on_branches_as_conv_weights, recurse)

    @classmethod
    def from_dense(cls, module: nn.Conv2d, *, branches: int = 2, noise: float = 0.0,
                   simplex: str = "softmax", allow_subclasses=False) -> "MultiBranchConv2d":
        """A multi-branch copy of ``module``: every branch starts as its weight (and bias).

        With noise=0 the layer computes the dense function (up to rounding of Σ α_b = 1);
        noise > 0 adds Gaussian noise of std noise·std(weight) to each branch to break symmetry
        (none to a one-entry weight).  The new parameters keep the dense ones' requires_grad.

        Raises:
            TypeError: ``module`` is not an ``nn.Conv2d``.
            ValueError: a bad noise; ``module`` computes something the new layer would not:
                a subclass overriding ``forward`` (unless ``allow_subclasses`` is True or holds
                its class), parametrizations, hooks, or lazy uninitialised parameters (see
                ``multibranch``).
        """
        check_convertible(module, nn.Conv2d, allow_subclasses=allow_subclasses)
        w = module.weight
        layer = cls(*conv2d_arguments(module), device=w.device, dtype=w.dtype, branches=branches, simplex=simplex)
        layer._load_dense(module, noise)
        return layer

    def extra_repr(self) -> str:
        return conv2d_extra_repr(self) + self._branch_repr()


class MultiBranchLinear(_MultiBranchMixin, nn.Module):
    """``nn.Linear`` whose weight and bias are convex combinations of B branches (pFedMB Eq. 1–2)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 branches=2, simplex="softmax"):
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.out_features = positive_int("out_features", out_features)
        self._init_parameters((out_features, in_features), branches, simplex, bias, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, *self._combined())

    @classmethod
    def from_dense(cls, module: nn.Linear, *, branches: int = 2, noise: float = 0.0,
                   simplex: str = "softmax", allow_subclasses=False) -> "MultiBranchLinear":
        """A multi-branch copy of ``module`` (the arguments and errors of ``MultiBranchConv2d.from_dense``)."""
        check_convertible(module, nn.Linear, allow_subclasses=allow_subclasses)
        w = module.weight
        layer = cls(*linear_arguments(module), device=w.device, dtype=w.dtype, branches=branches, simplex=simplex)
        layer._load_dense(module, noise)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.branch_bias is not None}" + self._branch_repr())
