"""The package imports and falls back cleanly; backend_info() tells what runs where."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pfl_kernels

OPS = ("pfl::factorized_weight", "pfl::factorized_weight_backward", "pfl::soft_threshold_")


def _run(code: str, **env) -> str:
    full_env = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return out.stdout


def test_backend_info_lists_every_op_and_device():
    info = pfl_kernels.backend_info()
    for op in OPS:
        assert set(info[op]) == {"cpu", "cuda", "other"}
        for entry in info[op].values():
            assert entry["implementation"] in ("cpp", "triton", "reference")
            # A reason is given exactly when the fast implementation is not the active one.
            assert (entry["reason"] == "") == (entry["implementation"] != "reference")


def test_import_without_extension_falls_back_to_reference():
    code = """
import json, torch, pfl_kernels
from pfl_kernels.ops import factorized_weight
u, v, mu = torch.randn(9, 1), torch.randn(1, 12), torch.randn(9, 12)
w = factorized_weight(u, v, mu, shape=(4, 3, 3, 3))
ref = (u @ v + mu).t().reshape(4, 3, 3, 3)
print(json.dumps({"ok": bool(torch.allclose(w, ref)), "info": pfl_kernels.backend_info()}))
"""
    result = json.loads(_run(code, PFL_KERNELS_DISABLE_EXTENSION="1", PFL_KERNELS_DISABLE_TRITON="1"))
    assert result["ok"]
    for op in OPS:
        assert result["info"][op]["cpu"] == {"implementation": "reference",
                                             "reason": "disabled by PFL_KERNELS_DISABLE_EXTENSION"}
        assert result["info"][op]["cuda"] == {"implementation": "reference",
                                              "reason": "disabled by PFL_KERNELS_DISABLE_TRITON"}


def test_command_line_report():
    out = _run("import runpy; runpy.run_module('pfl_kernels', run_name='__main__')")
    assert "pfl::factorized_weight" in out and "implementation" in out


def test_command_line_report_says_when_no_cuda_device_is_present():
    """Without a CUDA device every cuda row says so, next to what would run on one (it listed
    "cuda triton" with an empty reason, as if Triton were running)."""
    out = _run("import runpy; runpy.run_module('pfl_kernels', run_name='__main__')", CUDA_VISIBLE_DEVICES="")
    cuda_rows = [line.split(maxsplit=3) for line in out.splitlines() if line.split()[1:2] == ["cuda"]]
    assert len(cuda_rows) == len(pfl_kernels.backend_info())
    for op, _, implementation, reason in cuda_rows:
        assert implementation == pfl_kernels.backend_info()[op]["cuda"]["implementation"]
        assert "no CUDA device here" in reason, (op, reason)


def test_command_line_report_has_no_device_note_where_cuda_is_present(monkeypatch):
    from pfl_kernels._backends import format_backend_info

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "no CUDA device" not in format_backend_info()


def test_algorithms_package_imports():
    import pfl_algorithms  # noqa: F401
