"""The GPU benchmark scripts (``benchmarks/gpu_*.py``) run from end to end before a GPU is spent
on them: ``--dry-run`` in the Triton interpreter (tiny shapes, the Triton launchers as the
ops' CPU kernels, their float64 checks included), and a clear refusal where they cannot run.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_gpu_benchmarks.py -q
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math

import pytest
import torch

from tests.kernels.triton_support import INTERPRET

SCRIPTS = {  # script -> (arguments, JSON keys besides suite/machine/config/rows)
    "gpu_aggregate": ([], {"summary"}),
    "gpu_similarity": ([], {"summary"}),
    "gpu_branch_aggregate": ([], {"summary"}),
    "gpu_branch": ([], {"summary"}),
    "gpu_branch_shared": (["--shared"], {"summary"}),
    "gpu_factorized": ([], {"largest"}),
}


def _module(script: str):
    return importlib.import_module(f"benchmarks.{script.removesuffix('_shared')}")


@pytest.mark.triton_interpret
@pytest.mark.skipif(not INTERPRET, reason="--dry-run runs in the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_dry_run(script, tmp_path, capsys):
    """Each script measures its dry-run grid, checks every op against float64, prints its
    table and writes its JSON, with the launchers back to the C++ kernels afterwards."""
    args, keys = SCRIPTS[script]
    path = tmp_path / f"{script}.json"
    assert _module(script).main(["--dry-run", "--json", str(path), *args]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out and "max err" in out
    payload = json.loads(path.read_text())
    assert payload["machine"]["dry_run"] is True
    # the launch mode of its figures (the interpreter launches nothing directly)
    from pfl_kernels.triton import _direct
    assert payload["machine"]["direct_launch"] is _direct.ENABLED
    assert payload["machine"]["direct_launches"]["direct"] == 0
    from pfl_kernels.ops import _eager
    assert payload["machine"]["dispatch_bypass"] is _eager.ENABLED
    assert payload["suite"] == f"benchmarks/{script.removesuffix('_shared')}.py"
    assert {"config", "rows"} | keys <= payload.keys()
    rows = payload["rows"]
    assert rows, "no row measured"
    for row in rows:
        assert row["fused_ms"] > 0 and row["eager_ms"] > 0
        # a fused call that lost carries its kernel times (NaN here: no device to profile)
        assert ("kernel_fused_ms" in row) == (row["fused_ms"] > row["eager_ms"])
        # float32 inputs: every op agreed with float64 (the scripts raise beyond their tolerance)
        assert math.isfinite(row["max_abs_err"]) and row["max_abs_err"] < 1e-4
    if "--shared" in args:
        assert payload["config"]["shared_weights"] is True
    if script == "gpu_similarity":  # float32 pairwise rows: timed on the other path too, checked
        pairwise = [row for row in rows if row["op"] != "weights"]
        assert pairwise and all(row["path"] == "triton" and row["alt_path"] == "gemm" and row["alt_ms"] > 0
                                for row in pairwise)
        assert all(row["alt_path"] == "" for row in rows if row["op"] == "weights")
        assert "[triton; gemm: " in out
    # the scoped CPU registrations are gone: the C++ kernels serve CPU tensors again
    from pfl_kernels.ops._library import has_kernel
    assert has_kernel("pfl::weighted_average", "CPU") == _has_cpp_kernel()


def _has_cpp_kernel() -> bool:
    from pfl_kernels import _extension

    return _extension.LOADED


@pytest.mark.parametrize("script", sorted(s for s in SCRIPTS if not s.endswith("_shared")))
def test_refuses_without_a_device(script, capsys, monkeypatch):
    """Without CUDA (and without --dry-run) a script says so and measures nothing (exit 2);
    --dry-run outside the interpreter says what it needs."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there")
    module = _module(script)
    assert module.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    if not INTERPRET:
        assert module.main(["--dry-run"]) == 2
        assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_every_triton_op_has_a_recorded_launcher():
    """``pfl_kernels.triton.LAUNCHERS`` (what --dry-run and the interpreter tests run) holds
    every op whose CUDA implementation is meant to be Triton."""
    pytest.importorskip("triton")
    from pfl_kernels import triton as pfl_triton
    from pfl_kernels.ops._library import FAST_PATHS

    if not pfl_triton.AVAILABLE:
        pytest.skip(pfl_triton.REASON)
    pfl_triton.register_all()
    meant = {op.split("::")[1] for op, fast in FAST_PATHS.items() if fast["cuda"] == "triton"}
    assert meant <= set(pfl_triton.LAUNCHERS)


def test_kernel_times_are_taken_only_where_the_fused_call_loses(monkeypatch):
    """``Runtime.pair`` profiles the kernels of a losing pair only, and ``annotate`` hands
    them to that row alone (the next row starts clean)."""
    from benchmarks import _gpu_common as common

    rt = common.Runtime(dry_run=True, backend_info={})
    rt.dry_run = False  # as on a GPU (a dry run reports NaN kernel times without profiling)
    times = iter([2.0, 1.0, 1.0, 2.0])  # first pair: fused loses; second: fused wins
    monkeypatch.setattr(rt, "time", lambda fn: next(times))
    profiled = []
    monkeypatch.setattr(rt, "kernel_ms", lambda fn: profiled.append(fn) or 0.5)

    @dataclasses.dataclass
    class Row(common.Measured):
        bytes: int
        fused_ms: float
        eager_ms: float

    fused, eager = object(), object()
    lost = rt.annotate(Row(1, *rt.pair(fused, eager)))
    assert profiled == [fused, eager] and lost.kernel_ms == (0.5, 0.5)
    assert lost.to_json()["kernel_fused_ms"] == 0.5 and "kernels alone" in lost.kernel_note()
    won = rt.annotate(Row(1, *rt.pair(fused, eager)))
    assert len(profiled) == 2 and won.kernel_ms is None and "kernel_fused_ms" not in won.to_json()


def test_kernel_ms_is_nan_without_a_device():
    from benchmarks import _gpu_common as common

    rt = common.Runtime(dry_run=True, backend_info={})
    x = torch.randn(64)
    assert math.isnan(rt.kernel_ms(lambda: x * 2, calls=2))
