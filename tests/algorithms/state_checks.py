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
