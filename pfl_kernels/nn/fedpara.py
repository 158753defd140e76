"""FedPara layers (Hyeon-Woo, Ye-Bin and Oh, ICLR 2022), in pFedPara's personalized form.

Each weight is the Hadamard product of two low-rank weights,

    W = W1 ⊙ (W2 + 1) = W1 ⊙ W2 + W1                       (pFedPara, Sec. 3.3)

with W1 shared with the server (FedAvg) and W2 kept by the client.

* Linear (Proposition 1): W_i = X_i Y_iᵀ, X_i ∈ R^{out×R}, Y_i ∈ R^{in×R}.
* Conv2d (Proposition 3, the paper's tensor form, as the authors' code builds it):
  W_i = T_i ×₁ X_i ×₂ Y_i, i.e. W_i[o, c, h, w] = Σ_{a,b} T_i[a, b, h, w] X_i[o, a] Y_i[c, b],
  T_i ∈ R^{R×R×kh×kw}, X_i ∈ R^{out×R}, Y_i ∈ R^{in×R}.

The rank follows the paper's ratio γ (Sec. 3.1): R = ⌈(1 − γ) r_min + γ r_max⌉ with
r_min = min(⌈√out⌉, ⌈√in⌉) and r_max the largest R whose two factorized weights hold no more
parameters than the original (2R(in + out) ≤ in·out for a Linear; 2(R²·kh·kw + R(in + out)) ≤
in·out·kh·kw for a Conv2d, 1×1 ones included: they have the R×R core too).  So at γ = 1 a layer
holds at most the parameters of the one it replaces, unless even R = 1 holds more (R is never
below 1).  Biases are kept as they are (shared, with the body).

Initialization, ``init``:

* ``'variance'`` (ours, the default): every factor is normal with one std chosen so that W1 and
  W2 each have the variance of the weight the layer replaces; W2 + 1 is then close to 1 and the
  layer starts near its unconverted scale.  A new layer, ``reset_parameters()`` without
  ``weight_var`` and ``fedpara`` on the meta device (no values to measure) take the variance of
  nn.Linear's / nn.Conv2d's default weight, 1 / (3·fan_in).
* ``'he'`` (the authors' code, as the Flower baseline carries it): every factor drawn
  He-normal, ``kaiming_normal_(mode='fan_out', nonlinearity='relu')`` on the authors' layouts,
  i.e. std √(2/fan) with fan = out (X) and in (Y) for a Linear, and R (X, Y) and R·kh·kw (T)
  for a convolution.  The weights it gives are far larger than a dense layer's.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..ops._checks import has_values, positive_int
from ._conv import adopt_conv2d_arguments, conv2d_extra_repr, conv2d_forward, keep_requires_grad
from ._read_only import RebuiltAttributes, read_only
from .convert import _Conversion, _convert


def fedpara_rank(fan_out: int, fan_in: int, kernel: int = 1, ratio: float = 0.5, *, conv: bool = False) -> int:
    """The paper's rank for ratio γ = ``ratio``: ⌈(1 − γ) r_min + γ r_max⌉ (module docstring).

    ``kernel`` is kh·kw for a convolution (the tensor form), 1 for a Linear; ``conv=True`` says
    a layer is a convolution whatever its kernel: a 1×1 one has the R×R core of the tensor form,
    which the Linear budget does not count (a kernel above 1 is always a convolution)."""
    r_min = min(math.ceil(math.sqrt(fan_out)), math.ceil(math.sqrt(fan_in)))
    core = kernel if conv or kernel > 1 else 0  # T1, T2: 2·kernel·R² parameters

    def fits(r):
        return 2 * (core * r * r + r * (fan_out + fan_in)) <= fan_out * fan_in * kernel

    # The root of core·R² + (in + out)·R − in·out·kernel/2, then settled in integers: the float
    # root can be off by one where the budget is met exactly.
    b = fan_out + fan_in
    r_max = (math.floor((-b + math.sqrt(b * b + 2 * core * fan_out * fan_in * kernel)) / (2 * core)) if core
             else (fan_out * fan_in) // (2 * b))
    while r_max > 0 and not fits(r_max):
        r_max -= 1
    while fits(r_max + 1):
        r_max += 1
    return max(1, math.ceil((1 - ratio) * r_min + ratio * r_max))


INITS = ("variance", "he")


def _he_normal_(tensor: torch.Tensor, fan: int) -> None:
    """He-normal for ReLU with fan ``fan``: N(0, 2 / fan)."""
    nn.init.normal_(tensor, 0.0, math.sqrt(2.0 / fan))


def _normal_(tensors, target_var: float, order: int) -> None:
    """Fill ``tensors`` (the factors of one weight) with N(0, s²) so that a sum over R^{order−1}
    products of ``order`` factors has variance ``target_var``."""
    count = tensors[1].shape[1] ** (order - 1)  # R (matrix) or R² (tensor form)
    std = (target_var / count) ** (1.0 / (2 * order))
    for t in tensors:
        nn.init.normal_(t, 0.0, std)


def _checked_weight_var(weight_var, init: str, fan_in: int) -> float:
    """``weight_var``, or nn.Linear's / nn.Conv2d's default weight variance 1 / (3·fan_in) when
    it is None; ValueError for an unknown ``init`` or a ``weight_var`` that is not a finite
    number >= 0 (a negative one made the factors' std complex, an unknown init drew 'variance')."""
    if not isinstance(init, str) or init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if weight_var is None:
        return 1.0 / (3 * fan_in)
    if isinstance(weight_var, bool) or not isinstance(weight_var, numbers.Real) or not 0 <= weight_var < math.inf:
        raise ValueError(f"weight_var must be a finite number >= 0 or None, got {weight_var!r}")
    return float(weight_var)


class _FedParaMixin(RebuiltAttributes):
    """The rebuilt ``weight`` and ``reset_parameters`` shared by both layers."""

    _rebuilt_attributes = ("weight",)
    _factors: tuple[str, ...]

    @property
    def weight(self) -> torch.Tensor:
        """W1 ⊙ (W2 + 1) (``full_weight()``), in the shape of the dense layer's weight: what
        code written for the dense layer reads (``nn.MultiheadAttention`` reads its
        ``out_proj.weight``).

        Read-only: it is rebuilt on every access, so writing to it (``nn.init.*_``,
        ``.zero_()``, ``.data = ...``, assigning it) raises ``ReadOnlyWeightError``;
        initialise the factors instead.  Gradients through it reach the factors.
        """
        return read_only(self.full_weight(), self._write_error("weight"))

    def _write_error(self, name: str) -> str:
        cls = type(self).__name__
        return (f"{cls}.{name} is W1 * (W2 + 1), rebuilt from {', '.join(self._factors)} on every access, so "
                f"writing to it would change nothing; initialise the factors instead: reset_parameters(), or "
                f"write layer.x1, layer.y1, ... under torch.no_grad() (e.g. nn.init.normal_(layer.x1)); "
                f"for a copy you can write to, use layer.{name}.detach().clone()")

    def reset_parameters(self, weight_var: Optional[float] = None, init: str = "variance") -> None:
        """Draw the factors (module docstring, ``init``); ``weight_var`` is the variance each of
        W1, W2 gets under ``'variance'``: by default (None) the variance of the dense layer's
        default weight, 1 / (3·fan_in), as the layer draws itself when it is made.  The bias is
        left as it is.

        Raises:
            ValueError: an ``init`` other than 'variance' and 'he'; a ``weight_var`` that is
                not a finite number >= 0 or None.
        """
        weight_var = _checked_weight_var(weight_var, init, math.prod(self.weight_shape[1:]))
        with torch.no_grad():
            self._draw(weight_var, init)


class FedParaLinear(_FedParaMixin, nn.Module):
    """y = x (W1 ⊙ (W2 + 1))ᵀ + b, W_i = X_i Y_iᵀ (Proposition 1).

    ``weight`` is W1 ⊙ (W2 + 1) [out, in] (``weight_shape``), a read-only property (writing to it
    raises ``ReadOnlyWeightError``)."""

    _factors = ("x1", "y1", "x2", "y2")

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, *,
                 device=None, dtype=None):
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.out_features = positive_int("out_features", out_features)
        self.rank = rank = positive_int("rank", rank)
        self.weight_shape = (self.out_features, self.in_features)
        kw = {"device": device, "dtype": dtype}
        self.x1 = nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.y1 = nn.Parameter(torch.empty(self.in_features, rank, **kw))
        self.x2 = nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.y2 = nn.Parameter(torch.empty(self.in_features, rank, **kw))
        self.bias = nn.Parameter(torch.zeros(self.out_features, **kw)) if bias else None
        self.reset_parameters()

    def _draw(self, weight_var: float, init: str) -> None:
        for x, y in ((self.x1, self.y1), (self.x2, self.y2)):
            if init == "he":  # the authors' X (in×R) and Y (out×R), fan_out = their rows
                _he_normal_(x, self.out_features)
                _he_normal_(y, self.in_features)
            else:
                _normal_((x, y), weight_var, 2)

    def full_weight(self) -> torch.Tensor:
        """W1 ⊙ (W2 + 1): [out, in]."""
        return (self.x1 @ self.y1.T) * (self.x2 @ self.y2.T + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.full_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, bias={self.bias is not None}"


class FedParaConv2d(_FedParaMixin, nn.Module):
    """conv2d(x, W1 ⊙ (W2 + 1)) + b, W_i = T_i ×₁ X_i ×₂ Y_i (Proposition 3, tensor form).

    ``in_channels``, ``out_channels``, ``kernel_size``, ``stride``, ``padding`` and ``dilation``
    are checked and stored as ``nn.Conv2d`` does (no groups, zero padding only).  ``weight`` is
    W1 ⊙ (W2 + 1) [out, in, kh, kw] (``weight_shape``), a read-only property (writing to it raises
    ``ReadOnlyWeightError``)."""

    _factors = ("t1", "x1", "y1", "t2", "x2", "y2")

    def __init__(self, in_channels: int, out_channels: int, kernel_size, rank: int, bias: bool = True, *,
                 stride=1, padding=0, dilation=1, device=None, dtype=None):
        super().__init__()
        self.weight_shape = adopt_conv2d_arguments(self, in_channels, out_channels, kernel_size, stride, padding,
                                                   dilation, 1, bias, "zeros")
        out_channels, in_channels, kh, kw_ = self.weight_shape
        self.rank = rank = positive_int("rank", rank)
        kw = {"device": device, "dtype": dtype}
        self.t1 = nn.Parameter(torch.empty(rank, rank, kh, kw_, **kw))
        self.x1 = nn.Parameter(torch.empty(out_channels, rank, **kw))
        self.y1 = nn.Parameter(torch.empty(in_channels, rank, **kw))
        self.t2 = nn.Parameter(torch.empty(rank, rank, kh, kw_, **kw))
        self.x2 = nn.Parameter(torch.empty(out_channels, rank, **kw))
        self.y2 = nn.Parameter(torch.empty(in_channels, rank, **kw))
        self.bias = nn.Parameter(torch.zeros(out_channels, **kw)) if bias else None
        self.reset_parameters()

    def _draw(self, weight_var: float, init: str) -> None:
        for t, x, y in ((self.t1, self.x1, self.y1), (self.t2, self.x2, self.y2)):
            if init == "he":  # the authors' T (R×R×kh×kw), X (R×out), Y (R×in): fan_out = dim 0
                _he_normal_(t, self.rank * self.kernel_size[0] * self.kernel_size[1])
                _he_normal_(x, self.rank)
                _he_normal_(y, self.rank)
            else:
                _normal_((t, x, y), weight_var, 3)

    def full_weight(self) -> torch.Tensor:
        """W1 ⊙ (W2 + 1): [out, in, kh, kw], contiguous.  (einsum lays it out channels-last,
        which makes the convolution's output channels-last: under vmap, GroupNorm's rule then
        fails with "NYI: querying is_contiguous inside of vmap".)"""
        w1 = torch.einsum("abhw,oa,ib->oihw", self.t1, self.x1, self.y1)
        w2 = torch.einsum("abhw,oa,ib->oihw", self.t2, self.x2, self.y2)
        return (w1 * (w2 + 1)).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv2d_forward(self, x, self.full_weight(), self.bias)

    def extra_repr(self) -> str:
        return conv2d_extra_repr(self) + f", rank={self.rank}"


FEDPARA_LAYERS = (FedParaLinear, FedParaConv2d)


# What fedpara() replaces and ties (convert.py's machinery): tied dense weights become layers
# sharing their factors.
_FEDPARA = _Conversion("fedpara", "convert nn.Sequential(model) instead",
                       {"weight": ("x1", "y1", "x2", "y2", "t1", "t2"), "bias": ("bias",)})


def _weight_variance(weight: torch.Tensor) -> Optional[float]:
    """The variance ``'variance'`` gives W1 and W2: the dense weight's; None (the layer's default,
    ``reset_parameters``) where the weight has no values to measure (the meta device)."""
    if not has_values(weight):
        return None
    return float(weight.detach().double().var()) if weight.numel() > 1 else 1.0


def _converted(layer: nn.Module, ratio: float, init: str) -> nn.Module:
    weight = layer.weight
    kw = {"device": weight.device, "dtype": weight.dtype}
    bias = layer.bias is not None
    if isinstance(layer, nn.Linear):
        new = FedParaLinear(layer.in_features, layer.out_features,
                            fedpara_rank(layer.out_features, layer.in_features, 1, ratio), bias, **kw)
    else:
        if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise ValueError(f"pFedPara converts Conv2d with groups=1, numeric padding and padding_mode='zeros'; "
                             f"got {layer}")
        kh, kw_ = layer.kernel_size
        new = FedParaConv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                            fedpara_rank(layer.out_channels, layer.in_channels, kh * kw_, ratio, conv=True), bias,
                            stride=layer.stride, padding=layer.padding, dilation=layer.dilation, **kw)
    new.reset_parameters(_weight_variance(weight), init)
    if bias:
        with torch.no_grad():
            new.bias.copy_(layer.bias)
    new.train(layer.training)
    keep_requires_grad(new, layer, _FEDPARA.ties)
    return new


def fedpara(model: nn.Module, ratio: float = 0.5, init: str = "variance", *,
            exclude: Optional[Iterable[str]] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` (in place, at any depth) by its
    FedPara layer of ratio γ = ``ratio``, factors drawn by ``init`` ('variance' or 'he', module
    docstring); biases are copied, train/eval mode and requires_grad kept, everything else is
    untouched.  Returns ``model``.  Draws the factors from torch's global RNG, layer by layer
    in module order.  A model on the meta device converts too (its layers take the default
    variance, as ``reset_parameters()`` does): ``to_empty()`` then ``reset_parameters()`` it.

    As ``factorize`` does: a module registered under several names becomes one FedPara layer
    under all of them, and layers sharing a weight (or bias) Parameter become layers sharing
    its factors (or bias); ``exclude`` names modules to leave dense (None: none).

    Raises:
        ValueError: a ratio outside [0, 1], an unknown ``init``, a Conv2d with groups, string
            padding or a padding mode other than zeros, and every error of ``factorize`` for a
            module it cannot replace exactly (a subclass overriding ``forward``, hooks,
            parametrizations, an uninitialised lazy module, a non-finite weight, a weight tied
            to a module that stays dense, ``model`` itself a Linear/Conv2d).  Nothing changes
            when it raises.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio <= 1:
        raise ValueError(f"the FedPara ratio must be a number in [0, 1], got {ratio!r}")
    if init not in INITS:
        raise ValueError(f"the FedPara init must be one of {INITS}, got {init!r}")
    _convert(model, exclude, False, lambda layer: _converted(layer, ratio, init), _FEDPARA)
    return model
