"""What the GPU benchmarks (``gpu_factorized.py``, ``gpu_branch.py``) share.

The check against the float64 reference, the timing of a fused op, the eager code it
replaces and a device copy of the same bytes, the derived numbers of a measured row, the
command line, and the JSON they write.  Importable without CUDA or triton (both are imported
where they are needed).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIMING = "triton.testing.do_bench median, L2 flushed"
BYTES = "each input read once, each output written once (op_bytes)"


def sanitize(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (safe in a file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """The max abs error of ``got`` against the float64 ``want``; raises beyond ``tol * (1 + max |want|)``."""
    err = (got.double() - want).abs()
    bound = tol * (1 + want.abs().max().item())
    if err.max().item() > bound:
        where = [int(i) for i in torch.unravel_index(err.argmax(), err.shape)]
        raise AssertionError(f"{name}: max abs err {err.max().item():.3e} at {where} exceeds {bound:.3e}")
    return err.max().item()


def time_against_copy(fused: Callable[[], object], eager: Callable[[], object], nbytes: int,
                      device: str) -> tuple[float, float, float]:
    """Median ms of ``fused``, ``eager`` and a device-to-device copy moving ``nbytes``
    (``triton.testing.do_bench``, L2 flushed before each call)."""
    import triton.testing

    # a copy reads and writes its size: half the bytes each way
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = dict(warmup=25, rep=100, return_mode="median")
    fused_ms = triton.testing.do_bench(fused, **timing)
    eager_ms = triton.testing.do_bench(eager, **timing)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), **timing)
    del src, dst
    return fused_ms, eager_ms, copy_ms


class Measured:
    """The derived numbers of a row, for a dataclass with ``bytes``, ``fused_ms``, ``eager_ms``
    and ``copy_ms`` fields.  ``JSON_EXTRA`` names the properties its JSON adds after its
    fields, as (key, property) pairs in order."""

    JSON_EXTRA: tuple[tuple[str, str], ...] = ()

    @property
    def fused_gbps(self) -> float:
        return self.bytes / self.fused_ms / 1e6

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.fused_ms

    def to_json(self) -> dict:
        return {**asdict(self), **{key: getattr(self, prop) for key, prop in self.JSON_EXTRA}}


def print_rows(rows: Sequence, format_table: Callable[[Sequence], str]) -> None:
    """Each row as its line of the table, as soon as it is measured."""
    for r in rows:
        print(format_table([r]).splitlines()[-1], flush=True)


def parse_args(doc: str, argv: Optional[Sequence[str]], quick_help: str,
               flags: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """--dtype, --quick (``quick_help``), the script's own on/off ``flags`` (name -> help),
    then --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for flag, help_text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=help_text)
    parser.add_argument("--json", type=Path, default=None, help="output path (default: by device name)")
    return parser.parse_args(argv)


def cuda_or_explain(message: str) -> bool:
    """Whether a CUDA device is there; if not, print ``message`` to stderr."""
    if torch.cuda.is_available():
        return True
    print(message, file=sys.stderr)
    return False


def backend_info(op: str) -> dict:
    """``pfl_kernels.backend_info()``, warning when ``op``'s CUDA kernel is not the Triton one.

    Imports triton first: where it is missing, the script stops here, before measuring.
    """
    import triton  # noqa: F401

    import pfl_kernels
    info = pfl_kernels.backend_info()
    impl = {name: entry["cuda"]["implementation"] for name, entry in info.items()}
    if impl.get(op) != "triton":
        print(f"warning: the CUDA ops are not the Triton kernels: {impl}", file=sys.stderr)
    return info


def write_json(path: Path, suite: str, device_name: str, info: dict, results: dict) -> None:
    """Write ``{"suite", "machine", **results}`` to ``path`` and say where."""
    import triton

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "suite": suite,
        "machine": {"device": device_name, "torch_version": torch.__version__,
                    "triton_version": triton.__version__, "cuda": torch.version.cuda,
                    "platform": platform.platform(), "backend_info": info},
        **results,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
