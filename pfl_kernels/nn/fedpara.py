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
in·out·kh·kw for a Conv2d).  Biases are kept as they are (shared, with the body).

Initialization, ``init``:

* ``'variance'`` (ours, the default): every factor is normal with one std chosen so that W1 and
  W2 each have the variance of the weight the layer replaces; W2 + 1 is then close to 1 and the
  layer starts near its unconverted scale.
* ``'he'`` (the authors' code, as the Flower baseline carries it): every factor drawn
  He-normal, ``kaiming_normal_(mode='fan_out', nonlinearity='relu')`` on the authors' layouts,
  i.e. std √(2/fan) with fan = out (X) and in (Y) for a Linear, and R (X, Y) and R·kh·kw (T)
  for a convolution.  The weights it gives are far larger than a dense layer's.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn
from torch.nn import functional as F

from ._conv import keep_requires_grad
from .convert import _Conversion, _convert


def fedpara_rank(fan_out: int, fan_in: int, kernel: int = 1, ratio: float = 0.5) -> int:
    """The paper's rank for ratio γ = ``ratio``: ⌈(1 − γ) r_min + γ r_max⌉ (module docstring);
    ``kernel`` is kh·kw for a convolution (the tensor form), 1 for a Linear."""
    r_min = min(math.ceil(math.sqrt(fan_out)), math.ceil(math.sqrt(fan_in)))
    if kernel == 1:
        r_max = (fan_out * fan_in) // (2 * (fan_out + fan_in))
    else:  # kernel·R² + (in + out)·R − in·out·kernel/2 = 0
        b, c = fan_out + fan_in, fan_out * fan_in * kernel / 2
        r_max = math.floor((-b + math.sqrt(b * b + 4 * kernel * c)) / (2 * kernel))
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


class FedParaLinear(nn.Module):
    """y = x (W1 ⊙ (W2 + 1))ᵀ + b, W_i = X_i Y_iᵀ (Proposition 1)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True, *,
                 device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.x1 = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.y1 = nn.Parameter(torch.empty(in_features, rank, **kw))
        self.x2 = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.y2 = nn.Parameter(torch.empty(in_features, rank, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        self.reset_parameters(1.0 / (3 * in_features))  # nn.Linear's default weight variance

    def reset_parameters(self, weight_var: float, init: str = "variance") -> None:
        """Draw the factors (module docstring, ``init``); ``weight_var`` is the variance each
        of W1, W2 gets under ``'variance'``."""
        with torch.no_grad():
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


class FedParaConv2d(nn.Module):
    """conv2d(x, W1 ⊙ (W2 + 1)) + b, W_i = T_i ×₁ X_i ×₂ Y_i (Proposition 3, tensor form)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, rank: int, bias: bool = True, *,
                 stride=1, padding=0, dilation=1, device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        kh, kw_ = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        kw = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels, self.kernel_size, self.rank = in_channels, out_channels, (kh, kw_), rank
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.t1 = nn.Parameter(torch.empty(rank, rank, kh, kw_, **kw))
        self.x1 = nn.Parameter(torch.empty(out_channels, rank, **kw))
        self.y1 = nn.Parameter(torch.empty(in_channels, rank, **kw))
        self.t2 = nn.Parameter(torch.empty(rank, rank, kh, kw_, **kw))
        self.x2 = nn.Parameter(torch.empty(out_channels, rank, **kw))
        self.y2 = nn.Parameter(torch.empty(in_channels, rank, **kw))
        self.bias = nn.Parameter(torch.zeros(out_channels, **kw)) if bias else None
        self.reset_parameters(1.0 / (3 * in_channels * kh * kw_))  # nn.Conv2d's default weight variance

    def reset_parameters(self, weight_var: float, init: str = "variance") -> None:
        """Draw the factors (module docstring, ``init``); ``weight_var`` is the variance each
        of W1, W2 gets under ``'variance'``."""
        with torch.no_grad():
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
        return F.conv2d(x, self.full_weight(), self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, rank={self.rank}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


FEDPARA_LAYERS = (FedParaLinear, FedParaConv2d)


# What fedpara() replaces and ties (convert.py's machinery): tied dense weights become layers
# sharing their factors.
_FEDPARA = _Conversion("fedpara", "convert nn.Sequential(model) instead",
                       {"weight": ("x1", "y1", "x2", "y2", "t1", "t2"), "bias": ("bias",)})


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
                            fedpara_rank(layer.out_channels, layer.in_channels, kh * kw_, ratio), bias,
                            stride=layer.stride, padding=layer.padding, dilation=layer.dilation, **kw)
    new.reset_parameters(float(weight.detach().double().var()) if weight.numel() > 1 else 1.0, init)
    if bias:
        with torch.no_grad():
            new.bias.copy_(layer.bias)
    new.train(layer.training)
    keep_requires_grad(new, layer, _FEDPARA.ties)
    return new


def fedpara(model: nn.Module, ratio: float = 0.5, init: str = "variance") -> nn.Module:
    """Replace every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` (in place, at any depth) by its
    FedPara layer of ratio γ = ``ratio``, factors drawn by ``init`` ('variance' or 'he', module
    docstring); biases are copied, train/eval mode and requires_grad kept, everything else is
    untouched.  Returns ``model``.  Draws the factors from torch's global RNG, layer by layer
    in module order.

    As ``factorize`` does: a module registered under several names becomes one FedPara layer
    under all of them, and layers sharing a weight (or bias) Parameter become layers sharing
    its factors (or bias).

    Raises:
        ValueError: a ratio outside [0, 1], an unknown ``init``, a Conv2d with groups, string
            padding or a padding mode other than zeros, and every error of ``factorize`` for a
            module it cannot replace exactly (a subclass overriding ``forward``, hooks,
            parametrizations, an uninitialised lazy module, a weight tied to a module that
            stays dense, ``model`` itself a Linear/Conv2d).  Nothing changes when it raises.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 <= ratio <= 1:
        raise ValueError(f"the FedPara ratio must be a number in [0, 1], got {ratio!r}")
    if init not in INITS:
        raise ValueError(f"the FedPara init must be one of {INITS}, got {init!r}")
    _convert(model, (), False, lambda layer: _converted(layer, ratio, init), _FEDPARA)
    return model
