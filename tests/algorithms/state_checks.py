"""Bitwise comparison of run states (checkpoints, state dicts, metrics), shared by the tests."""
from __future__ import annotations

import torch


def assert_same(a, b, path="state"):
    """``a`` and ``b`` equal bit for bit: tensors by ``torch.equal``, containers item by item
    (NaN equals NaN); ``path`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path


def assert_close_state(a, b, *, rtol: float, atol: float, path="state"):
    """``a`` and ``b`` equal up to ``rtol``/``atol``: floating tensors and numbers by
    ``torch.testing.assert_close`` (NaN equals NaN), everything else exactly, item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_close_state(a[key], b[key], rtol=rtol, atol=atol, path=f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_state(x, y, rtol=rtol, atol=atol, path=f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert (a != a and b != b) or abs(a - b) <= atol + rtol * abs(b), f"{path}: {a} != {b}"
    else:
        assert a == b, path


def assert_close_norms(a, b, *, rtol: float, path="state"):
    """``a`` and ``b`` have the same structure, and each floating tensor of ``a`` is within
    ``rtol`` of ``b``'s in norm: ‖a − b‖ ≤ rtol·‖b‖ (NaN where ``b`` has NaN).  Float32 runs
    that differ only by reassociation drift by chaotic amplification (a ReLU or max-pool tie
    that flips changes a few entries by much more than the rest), so the bound is on the
    whole tensor, not on its worst entry; a real difference (a wrong client, a dropped
    update) moves the whole tensor by far more."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.is_floating_point() and a.numel():
            x, y = a.double(), b.double()
            assert torch.equal(x.isnan(), y.isnan()), f"{path}: NaN in different places"
            x, y = x.nan_to_num(0.0), y.nan_to_num(0.0)
            gap, scale = (x - y).norm().item(), y.norm().item()
            assert gap <= rtol * scale, f"{path}: ‖a − b‖ = {gap:.3g} > {rtol} · ‖b‖ = {rtol * scale:.3g}"
        elif not a.is_floating_point():
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_close_norms(a[key], b[key], rtol=rtol, path=f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_norms(x, y, rtol=rtol, path=f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert (a != a and b != b) or abs(a - b) <= rtol * abs(b), f"{path}: {a} != {b}"
    else:
        assert a == b, path
