"""Drop-in factorized layers: W = u vᵀ ⊕ μ (Factorized-FL Eq. 2; SimFed Eq. 6).

``FactorizedConv2d`` and ``FactorizedLinear`` keep the factors u [R, rank], v [rank, C]
and the sparse bias μ [R, C] as parameters and rebuild the weight with the fused op
``pfl_kernels.ops.factorized_weight`` on every forward, so gradients reach u, v and μ.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops  # noqa: F401  (defines torch.ops.pfl.*)
from .._layout import LAYOUTS, layout_geometry
from ..ops._checks import positive_int
from ..reference.factorized import unplace
from ._conv import adopt_conv2d_arguments, conv2d_arguments, conv2d_extra_repr, conv2d_forward, linear_arguments
from ._convertible import check_convertible
from ._read_only import RebuiltAttributes, read_only


class _FactorizedMixin(RebuiltAttributes):
    """Parameters, weight reconstruction and sparsity accounting shared by both layers."""

    u: nn.Parameter
    v: nn.Parameter
    mu: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    _rebuilt_attributes = ("weight",)

    def _init_parameters(self, shape, layout, rank, sparse, bias, device, dtype) -> None:
        """Create u, v, mu and bias for a weight of ``shape`` and initialise them."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.rank = positive_int("rank", rank)
        self.layout = layout
        self.weight_shape = tuple(shape)
        rows, cols, _, _ = layout_geometry(shape, layout)
        kw = {"device": device, "dtype": dtype}
        self.u = nn.Parameter(torch.empty(rows, rank, **kw))
        self.v = nn.Parameter(torch.empty(rank, cols, **kw))
        self.register_parameter("mu", nn.Parameter(torch.empty(rows, cols, **kw)) if sparse else None)
        self.register_parameter("bias", nn.Parameter(torch.empty(shape[0], **kw)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """u, v Xavier-uniform, μ zeros (the released Factorized-FL code); bias as the dense layer."""
        nn.init.xavier_uniform_(self.u)
        nn.init.xavier_uniform_(self.v)
        if self.mu is not None:
            nn.init.zeros_(self.mu)
        if self.bias is not None:
            # nn.Conv2d / nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = prod(weight.shape[1:]).
            bound = 1 / math.sqrt(math.prod(self.weight_shape[1:]))
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def weight(self) -> torch.Tensor:
        """The reconstructed weight place(u @ v + μ) in the shape of the dense layer's weight.

        Read-only: it is rebuilt on every access, so writing to it (``nn.init.*_``,
        ``.zero_()``, ``.data = ...``, assigning it) raises ``ReadOnlyWeightError``;
        initialise u, v and mu instead.  Gradients through it reach u, v and mu.
        """
        return read_only(self._reconstructed_weight(), self._write_error("weight"))

    def _reconstructed_weight(self) -> torch.Tensor:
        # The op itself, not the validating wrapper: the parameters' shapes were fixed at
        # construction (and the op still checks them), and this runs on every forward.
        return torch.ops.pfl.factorized_weight(self.u, self.v, self.mu, shape=self.weight_shape,
                                               layout=self.layout)

    def _write_error(self, name: str) -> str:
        cls = type(self).__name__
        return (f"{cls}.{name} is rebuilt from u, v and mu on every access, so writing to it would "
                f"change nothing; initialise the factors instead: reset_parameters(), "
                f"{cls}.from_dense(dense_layer), or write layer.u, layer.v and layer.mu under "
                f"torch.no_grad() (e.g. nn.init.xavier_uniform_(layer.u), layer.mu.zero_()); "
                f"for a copy you can write to, use layer.{name}.detach().clone()")

    def _load_dense(self, module: nn.Module) -> None:
        """From a dense layer: u, v the best rank-r part of its weight (SVD), μ the rest; its
        bias and its train/eval mode."""
        with torch.no_grad():
            if module.bias is not None:
                self.bias.copy_(module.bias)
            m = unplace(module.weight.detach().to(torch.float64), self.weight_shape, self.layout)
            left, sing, right = torch.linalg.svd(m, full_matrices=False)
            r = min(self.rank, sing.numel())
            root = sing[:r].sqrt()
            u = torch.zeros(m.shape[0], self.rank, dtype=torch.float64, device=m.device)
            v = torch.zeros(self.rank, m.shape[1], dtype=torch.float64, device=m.device)
            u[:, :r] = left[:, :r] * root
            v[:r] = root[:, None] * right[:r]
            self.u.copy_(u)
            self.v.copy_(v)
            if self.mu is not None:
                self.mu.copy_(m - u @ v)
        self.train(module.training)

    def sparsity_loss(self) -> torch.Tensor:
        """‖μ‖₁, the sparsity term of Factorized-FL Eq. 6 (differentiable; 0 without μ)."""
        if self.mu is None:
            return self.u.new_zeros(())
        return self.mu.abs().sum()

    def nnz(self, threshold: float = 0.0) -> int:
        """Number of μ entries with |μ| ≥ threshold (> 0 when threshold is 0); 0 without μ."""
        if self.mu is None:
            return 0
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        mag = self.mu.detach().abs()
        return int((mag >= threshold).sum() if threshold > 0 else (mag > 0).sum())

    def parameter_count(self, threshold: float = 0.0) -> int:
        """Entries a client would send: u, v and the μ entries counted by ``nnz(threshold)``.

        The bias (if any) is not included; add ``bias.numel()`` where it is sent.
        """
        return self.u.numel() + self.v.numel() + self.nnz(threshold)


class FactorizedConv2d(_FactorizedMixin, nn.Module):
    """``nn.Conv2d`` whose weight is u vᵀ ⊕ μ (Factorized-FL Eq. 2; SimFed Eq. 6 with layout='simfed').

    Takes every ``nn.Conv2d`` argument with the same meaning, plus:
        rank: r, the number of columns of u (>= 1).
        layout: how (R, C) maps onto the weight: 'spatial' (default; u over the kh·kw kernel
            positions, v over (out, in) pairs), 'simfed' (u over in·kh, v over out·kw),
            or 'view' (the released code's reshape).
        sparse: keep the sparse bias μ [R, C] (default True).

    Parameters: ``u`` [R, rank], ``v`` [rank, C], ``mu`` [R, C] (None when sparse=False),
    ``bias`` [out_channels] (None when bias=False).  ``weight`` is a read-only property
    (writing to it raises ``ReadOnlyWeightError``).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", device=None, dtype=None, *,
                 rank=1, layout="spatial", sparse=True):
        super().__init__()
        if layout == "linear":
            raise ValueError("layout 'linear' is for FactorizedLinear; use 'spatial', 'simfed' or 'view'")
        shape = adopt_conv2d_arguments(self, in_channels, out_channels, kernel_size, stride, padding,
                                       dilation, groups, bias, padding_mode)
        self._init_parameters(shape, layout, rank, sparse, bias, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return conv2d_forward(self, input, self._reconstructed_weight(), self.bias)

    @classmethod
    def from_dense(cls, module: nn.Conv2d, *, rank: int = 1, layout: str = "spatial",
                   sparse: bool = True, allow_subclasses=False) -> "FactorizedConv2d":
        """A factorized copy of ``module``: u, v the best rank-r part of its weight (SVD), μ the rest.

        With sparse=True the new layer computes the same function as ``module``; with
        sparse=False it keeps only the rank-r approximation.

        Raises:
            TypeError: ``module`` is not an ``nn.Conv2d``.
            ValueError: ``module`` computes something the new layer would not: a subclass
                overriding ``forward`` (unless ``allow_subclasses`` is True or holds its
                class), parametrizations, hooks, or lazy uninitialised parameters (see
                ``factorize``).
        """
        check_convertible(module, nn.Conv2d, allow_subclasses=allow_subclasses)
        w = module.weight
        layer = cls(*conv2d_arguments(module), device=w.device, dtype=w.dtype, rank=rank, layout=layout,
                    sparse=sparse)
        layer._load_dense(module)
        return layer

    def extra_repr(self) -> str:
        return conv2d_extra_repr(self) + f", rank={self.rank}, layout={self.layout!r}, sparse={self.mu is not None}"


class FactorizedLinear(_FactorizedMixin, nn.Module):
    """``nn.Linear`` whose weight is u vᵀ ⊕ μ, with u over inputs and v over outputs.

    Parameters: ``u`` [in_features, rank], ``v`` [rank, out_features], ``mu``
    [in_features, out_features] (None when sparse=False), ``bias`` [out_features].
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 rank=1, sparse=True):
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.out_features = positive_int("out_features", out_features)
        self._init_parameters((out_features, in_features), "linear", rank, sparse, bias, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self._reconstructed_weight(), self.bias)

    @classmethod
    def from_dense(cls, module: nn.Linear, *, rank: int = 1, sparse: bool = True,
                   allow_subclasses=False) -> "FactorizedLinear":
        """A factorized copy of ``module`` (exact with sparse=True; the arguments and errors of
        FactorizedConv2d.from_dense)."""
        check_convertible(module, nn.Linear, allow_subclasses=allow_subclasses)
        w = module.weight
        layer = cls(*linear_arguments(module), device=w.device, dtype=w.dtype, rank=rank, sparse=sparse)
        layer._load_dense(module)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, sparse={self.mu is not None}")
