"""Bitwise comparison of run states (checkpoints, state dicts, metrics, folders), shared by the tests."""
from __future__ import annotations

from typing import Callable

import torch


def _compare(a, b, path: str, leaf: Callable[[object, object, str], None]) -> None:
    """Walk ``a`` and ``b`` together: dicts key by key, lists and tuples item by item (the same
    keys and lengths asserted), and ``leaf(x, y, path)`` on everything else."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _compare(a[key], b[key], f"{path}.{key}", leaf)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{path}[{i}]", leaf)
    else:
        leaf(a, b, path)


def assert_same(a, b, path="state"):
    """``a`` and ``b`` equal bit for bit: tensors by ``torch.equal``, containers item by item
    (NaN equals NaN); ``path`` names the first difference."""
    def leaf(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
        else:
            assert x == y or (x != x and y != y), where

    _compare(a, b, path, leaf)


# Adam runs compared across executors (batched against sequential): Adam's update
# m / (sqrt(v) + eps) is about ±lr for a gradient at rounding-noise level, whatever its size,
# so the summation order (which changes with the thread count: 1, 3 and 4 threads gave 1.6e-10
# to 1.8e-10 on one BatchNormNet parameter, float64) moves such a parameter by far more than
# its rounding.  A stale step count or a lost step moves parameters by about lr / 10 = 1e-3.
ADAM_TOL = dict(rtol=1e-7, atol=1e-8)


def assert_close_state(a, b, *, rtol: float, atol: float, path="state"):
    """``a`` and ``b`` equal up to ``rtol``/``atol``: floating tensors and numbers by
    ``torch.testing.assert_close`` (NaN equals NaN), everything else exactly, item by item."""
    def leaf(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, where
            if x.is_floating_point():
                torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{where}: {m}")
            else:
                assert torch.equal(x, y), where
        elif isinstance(x, float) and isinstance(y, float):
            assert (x != x and y != y) or abs(x - y) <= atol + rtol * abs(y), f"{where}: {x} != {y}"
        else:
            assert x == y, where

    _compare(a, b, path, leaf)


def assert_close_norms(a, b, *, rtol: float, path="state"):
    """``a`` and ``b`` have the same structure, and each floating tensor of ``a`` is within
    ``rtol`` of ``b``'s in norm: ‖a − b‖ ≤ rtol·‖b‖ (NaN where ``b`` has NaN).  Float32 runs
    that differ only by reassociation drift by chaotic amplification (a ReLU or max-pool tie
    that flips changes a few entries by much more than the rest), so the bound is on the
    whole tensor, not on its worst entry; a real difference (a wrong client, a dropped
    update) moves the whole tensor by far more."""
    def leaf(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, where
            if x.is_floating_point() and x.numel():
                p, q = x.double(), y.double()
                assert torch.equal(p.isnan(), q.isnan()), f"{where}: NaN in different places"
                p, q = p.nan_to_num(0.0), q.nan_to_num(0.0)
                gap, scale = (p - q).norm().item(), q.norm().item()
                assert gap <= rtol * scale, f"{where}: ‖a − b‖ = {gap:.3g} > {rtol} · ‖b‖ = {rtol * scale:.3g}"
            elif not x.is_floating_point():
                assert torch.equal(x, y), where
        elif isinstance(x, float) and isinstance(y, float):
            assert (x != x and y != y) or abs(x - y) <= rtol * abs(y), f"{where}: {x} != {y}"
        else:
            assert x == y, where

    _compare(a, b, path, leaf)


def file_tree(folder) -> dict:
    """Every file below ``folder`` with its bytes (to show a command left a folder untouched)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
