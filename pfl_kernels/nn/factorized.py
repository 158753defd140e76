"""Drop-in factorized layers: W = u vᵀ ⊕ μ (Factorized-FL Eq. 2; SimFed Eq. 6).

``FactorizedConv2d`` and ``FactorizedLinear`` keep the factors u [R, rank], v [rank, C]
and the sparse bias μ [R, C] as parameters and rebuild the weight with the fused op
``pfl_kernels.ops.factorized_weight`` on every forward, so gradients reach u, v and μ.
"""
from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from .. import ops  # noqa: F401  (defines torch.ops.pfl.*)
from .._layout import LAYOUTS, layout_geometry
from ..ops._checks import positive_int
from ..reference.factorized import unplace
from ._conv import (adopt_conv2d_arguments, conv2d_arguments, conv2d_extra_repr, conv2d_forward, keep_requires_grad,
                    linear_arguments)
from ._convertible import check_convertible
from ._read_only import RebuiltAttributes, read_only


def best_rank_factors(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u [R, rank] and v [rank, C] whose product is the best rank-r approximation of ``m`` [R, C]
    (Eckart-Young: the top r singular triplets, r = min(rank, R, C)).

    Balanced as ``from_dense`` has always split them: column i of u and row i of v both have
    norm sqrt(σ_i); the columns of u and rows of v beyond r are zero.

    The top singular vectors come from the eigenvectors of the smaller Gram matrix (m mᵀ or
    mᵀ m), not from a full SVD: the convolutions' matrices are kh·kw × O·I (9 × 262,144 in
    ResNet-18), where the Gram matrix costs one pass over m and LAPACK's SVD took 0.1-0.3 s
    per layer (most of ``factorize``'s time).  In float64 the top vectors' error is about
    eps·σ₁² / (σ_r² - σ_r+1²) against the SVD's eps·σ₁ / (σ_r - σ_r+1): the same order for
    rank 1, and far below the float32 rounding of the factors wherever float32 can tell σ_r
    from σ_r+1 (squaring costs accuracy in the small singular values, which are not kept).
    σ_i is measured on m itself (the norm of m's projection onto the vector), not taken from
    the eigenvalue.  Where σ_r = σ_r+1 the best rank-r part is not unique, for the SVD too.
    """
    rows, cols = m.shape
    r = min(rank, rows, cols)
    wide = rows <= cols
    # eigh sorts ascending: the last r eigenvectors, largest first.
    basis = torch.linalg.eigh(m @ m.mT if wide else m.mT @ m).eigenvectors[:, -r:].flip(-1)
    # The other side's vectors scaled by σ: Σ Vᵀ [r, C] (wide) or U Σ [R, r] (tall).
    scaled = basis.mT @ m if wide else m @ basis
    sing = torch.linalg.vector_norm(scaled, dim=1 if wide else 0)
    root = sing.sqrt()
    # Divide by sqrt(σ) only where σ > 0 (a zero matrix, or rank above m's rank): there the
    # triplet contributes nothing and both factors stay zero.
    inv_root = torch.where(sing > 0, 1 / root.clamp_min(torch.finfo(m.dtype).tiny), 0)
    u = m.new_zeros(rows, rank)
    v = m.new_zeros(rank, cols)
    if wide:
        u[:, :r] = basis * root
        v[:r] = scaled * inv_root[:, None]
    else:
        u[:, :r] = scaled * inv_root
        v[:r] = root[:, None] * basis.mT
    return u, v


@contextmanager
def _one_thread_on_cpu(device: torch.device):
    """Run the body with one intra-op thread when ``device`` is a CPU, restoring the count after.

    Why: the conversion is a few small, memory-bound ops per layer, each a parallel region whose
    threads wait for one another.  On a busy 2-core machine (load 8-11) that waiting dominated:
    ResNet-18's ``factorize`` took a median 2.2 s of wall time (0.9 s CPU) on 2 threads against
    0.5 s (0.17 s CPU) on one, in one process (the full-SVD conversion before: 21 s, 8.6 s CPU).
    On one thread the work itself is ~0.2 s of CPU, so a quiet machine loses little.
    """
    previous = torch.get_num_threads()
    if device.type == "cpu" and previous > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


class _FactorizedMixin(RebuiltAttributes):
    """Parameters, weight reconstruction and sparsity accounting shared by both layers."""

    u: nn.Parameter
    v: nn.Parameter
    mu: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    _rebuilt_attributes = ("weight",)
    # The parameters made from a dense layer's weight and bias (from_dense, factorize).
    made_from = {"weight": ("u", "v", "mu"), "bias": ("bias",)}

    def _init_parameters(self, shape, layout, rank, sparse, bias, device, dtype) -> None:
        """Create u, v, mu and bias for a weight of ``shape`` and initialise them."""
        if not isinstance(sparse, bool):
            raise TypeError(f"sparse must be a bool, got {sparse!r}")
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

    @classmethod
    def _converted(cls, module: nn.Module, arguments: tuple, **kwargs):
        """A new layer of ``arguments`` and ``kwargs`` on ``module``'s device and dtype, loaded from it."""
        w = module.weight
        with _one_thread_on_cpu(w.device):
            layer = cls(*arguments, device=w.device, dtype=w.dtype, **kwargs)
            layer._load_dense(module)
        return layer

    def _load_dense(self, module: nn.Module) -> None:
        """From a dense layer: u, v the best rank-r part of its weight, μ the rest; its bias, its
        train/eval mode and its parameters' requires_grad."""
        with torch.no_grad():
            if module.bias is not None:
                self.bias.copy_(module.bias)
            # A float64 copy of our own (copy=True: a float64 weight too), so μ can be computed in it.
            m = unplace(module.weight.detach().to(torch.float64, copy=True), self.weight_shape, self.layout)
            u, v = best_rank_factors(m, self.rank)
            self.u.copy_(u)
            self.v.copy_(v)
            if self.mu is not None:
                # m - u v in float64, rounded once: u v + μ is the dense weight to within that rounding.
                self.mu.copy_(m.addmm_(u, v, alpha=-1))
        self.train(module.training)
        keep_requires_grad(self, module, self.made_from)

    def sparsity_loss(self) -> torch.Tensor:
        """‖μ‖₁, the sparsity term of Factorized-FL Eq. 6 (differentiable; 0 without μ)."""
        if self.mu is None:
            return self.u.new_zeros(())
        return self.mu.abs().sum()

    def nnz(self, threshold: float = 0.0) -> int:
        """Number of μ entries with |μ| ≥ threshold (> 0 when threshold is 0); 0 without μ.

        Raises:
            ValueError: ``threshold`` is not a number >= 0 (NaN included).
        """
        # Checked first, with or without μ: a NaN threshold counted nothing, a string failed
        # in the comparison.
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        if self.mu is None:
            return 0
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
        return cls._converted(module, conv2d_arguments(module), rank=rank, layout=layout, sparse=sparse)

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
        return cls._converted(module, linear_arguments(module), rank=rank, sparse=sparse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, rank={self.rank}, sparse={self.mu is not None}")
