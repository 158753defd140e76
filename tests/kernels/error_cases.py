"""Argument mistakes of every op, and the one exception type each must raise whichever layer
catches it (issue 14): the documented wrapper, ``torch.ops.pfl.<op>`` (the C++ kernel), the
reference kernel, the fake kernel (meta tensors, FakeTensorMode) and the Triton launcher.

The rule (the wrappers' docstrings state it): a wrong kind of argument (a non-floating
dtype, dtypes that differ) is a TypeError; a wrong shape, value, device or layout is a
ValueError.  Each case is written once, as the op's own arguments; ``WRAPPERS`` says how the
documented wrapper takes the same arguments.  Shared by ``test_error_types.py`` and its
Triton twin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from pfl_kernels import ops
from pfl_kernels.ops._library import op_overload

F64 = torch.float64
NAN = float("nan")

# op overload -> the documented wrapper called with the op's arguments (None: no wrapper)
WRAPPERS: dict[str, Optional[Callable]] = {
    "pairwise_cosine": lambda x, y, eps: ops.pairwise_cosine(x, y, eps=eps),
    "pairwise_sqdist": ops.pairwise_sqdist,
    "similarity_weights": lambda sim, tau, scale, min_keep, self_index: ops.similarity_weights(
        sim, tau=tau, scale=scale, min_keep=min_keep, self_index=self_index),
    "weighted_average": ops.weighted_average,
    "weighted_average.out": ops.weighted_average,
    "branch_aggregate": ops.branch_aggregate,
    "branch_aggregate.out": ops.branch_aggregate,
    "class_means": ops.class_means,
    "factorized_weight": ops.factorized_weight,
    "factorized_weight_backward": None,
    "soft_threshold_": ops.soft_threshold_,
    "branch_combine": ops.branch_combine,
    "branch_combine_backward": None,
    "project_simplex_": ops.project_simplex_,
}


class Tensors:
    """Makes a case's tensors for one layer: random (never zeros) or given values, made on
    the CPU, then moved where the layer needs them (``place``: meta tensors, fake tensors, a
    GPU), except one that a device mistake puts ``elsewhere`` (default: on meta)."""

    def __init__(self, place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 elsewhere: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.place = place
        self.elsewhere = elsewhere or (lambda t: place(t.to("meta")))
        self.generator = torch.Generator().manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype = F64, elsewhere: bool = False) -> torch.Tensor:
        """Random normal values (random integers for integer dtypes); ``elsewhere``: this one
        tensor on another device than the rest."""
        if dtype.is_floating_point:
            t = torch.randn(*shape, generator=self.generator, dtype=F64).to(dtype)
        else:
            t = torch.randint(1, 3, shape, generator=self.generator).to(dtype)
        return self.elsewhere(t) if elsewhere else self.place(t)

    def rand(self, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
        """Uniform values in (0, 1) (weights, alpha)."""
        return self.place(torch.rand(*shape, generator=self.generator, dtype=F64).to(dtype) + 1e-3)

    def tensor(self, values, dtype: torch.dtype = F64) -> torch.Tensor:
        return self.place(torch.tensor(values, dtype=dtype))


@dataclass(frozen=True)
class Mistake:
    """One mistake in a call of ``op`` (an overload name in the pfl namespace).

    ``args(t)`` returns the op's (args, kwargs), built with ``t`` (a ``Tensors``).
    ``error``/``match``: the exception type every layer raises and a pattern of its message
    (the argument's name).  ``reads_values``: only a kernel can see it (it reads the data),
    not the fake kernel.  ``devices``: a device mistake (one tensor elsewhere), which
    meta tensors cannot show (they are all on meta).
    """

    op: str
    what: str
    error: type
    match: str
    args: Callable[[Tensors], tuple[tuple, dict]]
    reads_values: bool = False
    devices: bool = False

    @property
    def id(self) -> str:
        return f"{self.op}: {self.what}"

    @property
    def has_wrapper(self) -> bool:
        return WRAPPERS[self.op] is not None

    def function(self, through: str) -> Callable:
        """The op overload (``through='op'``) or its documented wrapper (``'wrapper'``)."""
        return op_overload(f"pfl::{self.op}") if through == "op" else WRAPPERS[self.op]

    def call(self, through: str, t: Tensors) -> Any:
        """Make the mistake through the op or the wrapper, with tensors from ``t``."""
        args, kwargs = self.args(t)
        return self.function(through)(*args, **kwargs)


def _a(*args, **kwargs):
    return args, kwargs


def _pair_mistakes(op: str, extra: tuple) -> list[Mistake]:
    """pairwise_cosine / pairwise_sqdist share their checks of x and y."""
    return [
        Mistake(op, "x not 2-D", ValueError, "x must", lambda t: _a(t.randn(3), None, *extra)),
        Mistake(op, "x not floating", TypeError, "x must be a floating",
                lambda t: _a(t.randn(3, 4, dtype=torch.int64), None, *extra)),
        Mistake(op, "y of another dtype", TypeError, "y must have",
                lambda t: _a(t.randn(3, 4), t.randn(2, 4, dtype=torch.float32), *extra)),
        Mistake(op, "y of another D", ValueError, r"y must be \[M, D\]",
                lambda t: _a(t.randn(3, 4), t.randn(2, 5), *extra)),
        Mistake(op, "y on another device", ValueError, "y must be on",
                lambda t: _a(t.randn(3, 4), t.randn(2, 4, elsewhere=True), *extra), devices=True),
    ]


def _similarity_weights_args(t, sim=None, tau=0.5, scale=2.0, min_keep=0, self_index=None):
    return _a(t.rand(4, 4) if sim is None else sim, tau, scale, min_keep, self_index)


def _factorized_args(t, u=None, v=None, mu=None, mask=None, shape=(6, 2, 3, 3), layout="spatial"):
    # the spatial layout of [6, 2, 3, 3]: R = 3·3 = 9 rows, C = 6·2 = 12 columns
    return _a(t.randn(9, 2) if u is None else u, t.randn(2, 12) if v is None else v, mu, mask,
              shape=list(shape), layout=layout)


def _branch_aggregate_args(t, params=None, alpha=None, counts=None, **kwargs):
    return _a(t.randn(3, 2, 5) if params is None else params, t.rand(3, 2) if alpha is None else alpha,
              t.tensor([3, 1, 2], torch.int64) if counts is None else counts, **kwargs)


def _class_means_args(t, features=None, labels=None, num_classes=3):
    return _a(t.randn(5, 4) if features is None else features,
              t.tensor([0, 2, 1, 1, 0], torch.int64) if labels is None else labels, num_classes)


def mistakes() -> list[Mistake]:
    """Every case, one mistake each (the rest of the call is valid)."""
    sw, fw, ba, cm = _similarity_weights_args, _factorized_args, _branch_aggregate_args, _class_means_args
    return [
        *_pair_mistakes("pairwise_cosine", (1e-8,)),
        Mistake("pairwise_cosine", "eps = 0", ValueError, "eps must be", lambda t: _a(t.randn(3, 4), None, 0.0)),
        Mistake("pairwise_cosine", "eps = inf", ValueError, "eps must be",
                lambda t: _a(t.randn(3, 4), None, float("inf"))),
        *_pair_mistakes("pairwise_sqdist", ()),

        Mistake("similarity_weights", "sim not 2-D", ValueError, "sim must", lambda t: sw(t, sim=t.rand(4))),
        Mistake("similarity_weights", "sim not floating", TypeError, "sim must be a floating",
                lambda t: sw(t, sim=t.randn(4, 4, dtype=torch.int64))),
        Mistake("similarity_weights", "sim not square, no self_index", ValueError, "not square",
                lambda t: sw(t, sim=t.rand(4, 5))),
        Mistake("similarity_weights", "tau outside [-1, 1]", ValueError, "tau must be in", lambda t: sw(t, tau=1.5)),
        Mistake("similarity_weights", "scale not finite", ValueError, "scale must be finite",
                lambda t: sw(t, scale=float("inf"))),
        Mistake("similarity_weights", "scale beyond float32 sim's accumulation", ValueError,
                r"scale must be within float32's range .* got 1e\+39",
                lambda t: sw(t, sim=t.rand(4, 4, dtype=torch.float32), scale=1e39)),
        Mistake("similarity_weights", "min_keep < 0", ValueError, "min_keep must be >= 0",
                lambda t: sw(t, min_keep=-1)),
        Mistake("similarity_weights", "self_index not integer", TypeError, "self_index must be an int64 or int32",
                lambda t: sw(t, self_index=t.tensor([0., 1., 2., 3.]))),
        Mistake("similarity_weights", "self_index of the wrong shape", ValueError, r"self_index must be \[K\]",
                lambda t: sw(t, self_index=t.tensor([0, 1, 2], torch.int64))),
        Mistake("similarity_weights", "self_index on another device", ValueError, "self_index must be on",
                lambda t: sw(t, self_index=t.randn(4, dtype=torch.int64, elsewhere=True)), devices=True),
        Mistake("similarity_weights", "NaN in sim", ValueError, "sim must be finite",
                lambda t: sw(t, sim=t.tensor([[1.0, NAN], [0.5, 1.0]])), reads_values=True),
        Mistake("similarity_weights", "self_index value out of range", ValueError, "self_index values must be in",
                lambda t: sw(t, self_index=t.tensor([0, 1, 4, 3], torch.int64)), reads_values=True),

        Mistake("weighted_average", "weights not 2-D", ValueError, "weights must be",
                lambda t: _a(t.rand(3), t.randn(3, 5))),
        Mistake("weighted_average", "params not floating", TypeError, "params must be",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5, dtype=torch.int64))),
        Mistake("weighted_average", "weights not floating", TypeError, "weights must be",
                lambda t: _a(t.randn(2, 3, dtype=torch.int32), t.randn(3, 5))),
        Mistake("weighted_average", "M differs", ValueError, "params must", lambda t: _a(t.rand(2, 3), t.randn(4, 5))),
        Mistake("weighted_average", "weights on another device", ValueError, "weights must be on",
                lambda t: _a(t.randn(2, 3, elsewhere=True), t.randn(3, 5)), devices=True),
        Mistake("weighted_average", "NaN in weights", ValueError, "weights must be finite",
                lambda t: _a(t.tensor([[0.5, NAN, 0.5]]), t.randn(3, 5)), reads_values=True),
        Mistake("weighted_average", "float64 weights beyond float32 params' range", ValueError,
                r"weights must be finite \(.*beyond the accumulation dtype's range",
                lambda t: _a(t.tensor([[1e300, 0.5, 0.5]]), t.randn(3, 5, dtype=torch.float32)), reads_values=True),
        Mistake("weighted_average.out", "out of the wrong shape", ValueError, "out must have shape",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5), out=t.randn(2, 4))),
        Mistake("weighted_average.out", "out of another dtype", TypeError, "out must have",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5), out=t.randn(2, 5, dtype=torch.float32))),
        Mistake("weighted_average.out", "out without unit stride", ValueError, "unit stride",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5), out=t.randn(5, 2).t())),
        Mistake("weighted_average.out", "out's rows overlap", ValueError, "rows overlap",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5), out=t.randn(5).expand(2, 5))),
        Mistake("weighted_average.out", "out on another device", ValueError, "out must be on",
                lambda t: _a(t.rand(2, 3), t.randn(3, 5), out=t.randn(2, 5, elsewhere=True)), devices=True),
        Mistake("weighted_average.out", "NaN in weights", ValueError, "weights must be finite",
                lambda t: _a(t.tensor([[0.5, NAN, 0.5]]), t.randn(3, 5), out=t.randn(1, 5)), reads_values=True),

        Mistake("branch_aggregate", "alpha not 2-D", ValueError, "alpha must be", lambda t: ba(t, alpha=t.rand(3))),
        Mistake("branch_aggregate", "no clients", ValueError, "alpha must have K >= 1",
                lambda t: ba(t, params=t.randn(0, 2, 5), alpha=t.rand(0, 2), counts=t.tensor([], torch.int64))),
        Mistake("branch_aggregate", "branch_params not floating", TypeError, "branch_params must be a floating",
                lambda t: ba(t, params=t.randn(3, 2, 5, dtype=torch.int64))),
        Mistake("branch_aggregate", "alpha not floating", TypeError, "alpha must be a floating",
                lambda t: ba(t, alpha=t.randn(3, 2, dtype=torch.int64))),
        Mistake("branch_aggregate", "counts bool", TypeError, "counts must be an integer or floating",
                lambda t: ba(t, counts=t.tensor([True, False, True], torch.bool))),
        Mistake("branch_aggregate", "counts of the wrong shape", ValueError, "counts must have shape",
                lambda t: ba(t, counts=t.tensor([3, 1], torch.int64))),
        Mistake("branch_aggregate", "branch_params of the wrong shape", ValueError, "branch_params must have shape",
                lambda t: ba(t, params=t.randn(3, 3, 5))),
        Mistake("branch_aggregate", "alpha on another device", ValueError, "alpha must be on",
                lambda t: ba(t, alpha=t.randn(3, 2, elsewhere=True)), devices=True),
        Mistake("branch_aggregate", "negative count", ValueError, "counts must be >= 0",
                lambda t: ba(t, counts=t.tensor([3, -1, 2], torch.int64)), reads_values=True),
        Mistake("branch_aggregate", "NaN in alpha", ValueError, "alpha must be >= 0 and finite",
                lambda t: ba(t, alpha=t.tensor([[0.5, 0.5], [NAN, 0.5], [0.5, 0.5]])), reads_values=True),
        Mistake("branch_aggregate.out", "out of the wrong shape", ValueError, "out must have shape",
                lambda t: ba(t, out=t.randn(2, 4))),
        Mistake("branch_aggregate.out", "out of another dtype", TypeError, "out must have",
                lambda t: ba(t, out=t.randn(2, 5, dtype=torch.float32))),
        Mistake("branch_aggregate.out", "out's elements share memory", ValueError, "share memory",
                lambda t: ba(t, out=t.randn(5).expand(2, 5))),

        Mistake("class_means", "features not 2-D or 3-D", ValueError, "features must be",
                lambda t: cm(t, features=t.randn(5), labels=t.tensor(0, torch.int64))),
        Mistake("class_means", "features not floating", TypeError, "features must be a floating",
                lambda t: cm(t, features=t.randn(5, 4, dtype=torch.int64))),
        Mistake("class_means", "labels not integer", TypeError, "labels must be (an )?int64 or int32",
                lambda t: cm(t, labels=t.tensor([0., 2., 1., 1., 0.]))),
        Mistake("class_means", "labels of the wrong shape", ValueError, "labels must have shape",
                lambda t: cm(t, labels=t.tensor([0, 1], torch.int64))),
        Mistake("class_means", "labels on another device", ValueError, "labels must be on",
                lambda t: cm(t, labels=t.randn(5, dtype=torch.int64, elsewhere=True)), devices=True),
        Mistake("class_means", "num_classes 0", ValueError, "num_classes must be", lambda t: cm(t, num_classes=0)),
        Mistake("class_means", "label out of range", ValueError, "labels must be in",
                lambda t: cm(t, labels=t.tensor([0, 2, 3, 1, 0], torch.int64)), reads_values=True),

        Mistake("factorized_weight", "u not 2-D or 3-D", ValueError, "u must", lambda t: fw(t, u=t.randn(9))),
        Mistake("factorized_weight", "u not floating", TypeError, "u must be a floating",
                lambda t: fw(t, u=t.randn(9, 2, dtype=torch.int64), v=t.randn(2, 12, dtype=torch.int64))),
        Mistake("factorized_weight", "v of another dtype", TypeError, "v must have",
                lambda t: fw(t, v=t.randn(2, 12, dtype=torch.float32))),
        Mistake("factorized_weight", "v of the wrong C", ValueError, "v must have", lambda t: fw(t, v=t.randn(2, 11))),
        Mistake("factorized_weight", "mu of the wrong shape", ValueError, "mu must have shape",
                lambda t: fw(t, mu=t.randn(9, 11))),
        Mistake("factorized_weight", "mu of another dtype", TypeError, "mu must have",
                lambda t: fw(t, mu=t.randn(9, 12, dtype=torch.float32))),
        Mistake("factorized_weight", "mask without mu", ValueError, "mask.* without mu",
                lambda t: fw(t, mask=t.randn(9, 12))),
        Mistake("factorized_weight", "v on another device", ValueError, "v must be on",
                lambda t: fw(t, v=t.randn(2, 12, elsewhere=True)), devices=True),
        Mistake("factorized_weight", "client counts differ", ValueError, "clients",
                lambda t: fw(t, u=t.randn(2, 9, 2), v=t.randn(3, 2, 12))),
        Mistake("factorized_weight", "unknown layout", ValueError, "layout", lambda t: fw(t, layout="rows")),
        Mistake("factorized_weight", "shape of the wrong rank", ValueError, "shape must be",
                lambda t: fw(t, shape=(6, 2, 3))),
        Mistake("factorized_weight_backward", "grad_w of the wrong shape", ValueError, "grad_w must have shape",
                lambda t: _a(t.randn(6, 2, 3, 2), *fw(t)[0], **fw(t)[1], output_mask=[True] * 4)),
        Mistake("factorized_weight_backward", "grad_w of another dtype", TypeError, "grad_w must have",
                lambda t: _a(t.randn(6, 2, 3, 3, dtype=torch.float32), *fw(t)[0], **fw(t)[1],
                             output_mask=[True] * 4)),
        Mistake("soft_threshold_", "threshold < 0", ValueError, "threshold must be",
                lambda t: _a(t.randn(3, 4), -0.1)),
        Mistake("soft_threshold_", "threshold = inf", ValueError, "threshold must be",
                lambda t: _a(t.randn(3, 4), float("inf"))),
        Mistake("soft_threshold_", "mu not floating", TypeError, "mu must be a floating",
                lambda t: _a(t.randn(3, 4, dtype=torch.int64), 0.1)),
        Mistake("soft_threshold_", "mu's elements share memory", ValueError, "share memory",
                lambda t: _a(t.randn(4).expand(3, 4), 0.1)),

        Mistake("branch_combine", "alpha not 1-D or 2-D", ValueError, "alpha must",
                lambda t: _a(t.randn(2, 3, 4, 5), t.rand(2, 3, 4))),
        Mistake("branch_combine", "alpha not floating", TypeError, "alpha must be a floating",
                lambda t: _a(t.randn(3, 5, dtype=torch.int64), t.randn(3, dtype=torch.int64))),
        Mistake("branch_combine", "weights of another dtype", TypeError, "weights must have",
                lambda t: _a(t.randn(3, 5, dtype=torch.float32), t.rand(3))),
        Mistake("branch_combine", "weights of the wrong shape", ValueError, "weights must have shape",
                lambda t: _a(t.randn(4, 5), t.rand(3))),
        Mistake("branch_combine", "no branches", ValueError, "B >= 1", lambda t: _a(t.randn(0, 5), t.rand(0))),
        Mistake("branch_combine", "weights on another device", ValueError, "weights must be on",
                lambda t: _a(t.randn(3, 5, elsewhere=True), t.rand(3)), devices=True),
        Mistake("branch_combine_backward", "grad_w of the wrong shape", ValueError, "grad_w must have shape",
                lambda t: _a(t.randn(4), t.randn(3, 5), t.rand(3), [True, True])),
        Mistake("branch_combine_backward", "grad_w of another dtype", TypeError, "grad_w must have",
                lambda t: _a(t.randn(5, dtype=torch.float32), t.randn(3, 5), t.rand(3), [True, True])),
        Mistake("project_simplex_", "x 0-D", ValueError, "x must", lambda t: _a(t.randn(()))),
        Mistake("project_simplex_", "x not floating", TypeError, "x must be a floating",
                lambda t: _a(t.randn(3, 4, dtype=torch.int64))),
        Mistake("project_simplex_", "x's elements share memory", ValueError, "share memory",
                lambda t: _a(t.randn(4).expand(3, 4))),
    ]


MISTAKES = {m.id: m for m in mistakes()}
