"""Tolerances per dtype, in one place, and a comparison with a readable mismatch report."""
from __future__ import annotations

import torch

# (rtol, atol) against a float64 reference computed from the same (upcast) inputs.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """Assert ``actual`` matches the float64 ``expected`` within the tolerance of ``dtype``.

    On failure, report the relative error ‖a − e‖/‖e‖, the worst element and its index.
    """
    rtol, atol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    assert torch.isfinite(a).all(), f"{what}: non-finite values in result"
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        rel = float((a - e).norm() / e.norm().clamp_min(1e-300))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside rtol={rtol}, atol={atol} "
            f"({dtype}); max abs err {float(err.max()):.3e}, relative error {rel:.3e}; first at {idx}: "
            f"got {float(a[idx]):.6g}, expected {float(e[idx]):.6g}")
