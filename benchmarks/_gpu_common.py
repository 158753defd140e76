"""What the GPU benchmarks (``benchmarks/gpu_*.py``) share.

The check against the float64 reference, the timing of a fused op, the eager code it
replaces and a device copy of the same bytes, the derived numbers of a measured row, the
command line, and the JSON they write.  Importable without CUDA or triton (both are imported
where they are needed).

Each script runs on a CUDA device, or with ``--dry-run`` on the CPU: tiny shapes, the Triton
launchers run in the interpreter (``TRITON_INTERPRET=1``) as the ops' CPU kernels, a
wall-clock timer instead of ``do_bench``, JSON to a temporary folder.  Its timings mean
nothing; it checks that a script runs from end to end (its correctness checks included)
before a GPU is spent on it.  ``tests/kernels/test_gpu_benchmarks.py`` runs every script so.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DRY_RUN_RESULTS = Path(tempfile.gettempdir()) / "pfl_gpu_dry_run"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIMING = "triton.testing.do_bench median, L2 flushed"
BYTES = "each input read once, each output written once (op_bytes)"
DRY_RUN_NAME = "dry run (Triton interpreter on CPU)"
KERNEL_CALLS = 20  # calls profiled per kernel time (only where a fused call loses)


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


class Runtime:
    """Where a script measures: ``device`` ('cuda', or 'cpu' in a dry run), the device's
    ``name`` for the report, and the timer.  ``with runtime:`` holds what the run needs (in
    a dry run: the Triton launchers as the ops' CPU kernels)."""

    last_kernel_ms: Optional[tuple[float, float]] = None

    def __init__(self, dry_run: bool, backend_info: dict):
        self.dry_run = dry_run
        self.backend_info = backend_info  # pfl_kernels.backend_info() when the run started
        self.device = "cpu" if dry_run else "cuda"
        self.name = DRY_RUN_NAME if dry_run else torch.cuda.get_device_name()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Runtime":
        if self.dry_run:
            from pfl_kernels.triton import launchers_on_cpu

            self._stack.enter_context(launchers_on_cpu())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def time(self, fn: Callable[[], object]) -> float:
        """Median ms of ``fn``: ``triton.testing.do_bench`` (L2 flushed before each call), or
        in a dry run the wall-clock time of one call: a dry run checks the script, its figures
        mean nothing, and the interpreter is slow (the median of three calls after a warm-up
        call made the dry runs of gpu_similarity, gpu_aggregate and gpu_branch_aggregate take
        167 s on a 2-core AMD EPYC, one call 66 s)."""
        if self.dry_run:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def time_patched(self, fn: Callable[[], object], check: Callable[[], object], module, **settings) -> float:
        """``time(fn)`` with ``module``'s attributes set to ``settings`` (a kernel's other path or
        block, timed beside the default; restored after), once ``fn``'s result under them has
        passed ``check`` (which may call ``fn`` itself).

        On a GPU, a failure of that other path (its check, or an error) is printed on one line
        and gives NaN (not timed): it must not cost the suite its JSON, which the script writes
        once, at the end (the 3xTF32 dense kernel and the chunked segment kernel had not run on a
        GPU when this was written).  A dry run raises it, so CI sees a path that fails."""
        saved = {name: getattr(module, name) for name in settings}
        try:
            for name, value in settings.items():
                setattr(module, name, value)
            fn()
            check()
            return self.time(fn)
        except Exception as error:  # noqa: BLE001  (any failure of the other path: reported, not fatal)
            if self.dry_run:
                raise
            print(f"  the other path ({', '.join(f'{k}={v!r}' for k, v in settings.items())}) failed, not timed: "
                  f"{type(error).__name__}: {' '.join(str(error).split())[:200]}", flush=True)
            return float("nan")
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    def kernel_ms(self, fn: Callable[[], object], calls: int = KERNEL_CALLS) -> float:
        """The device's busy time per call of ``fn``, in ms: the summed durations of the kernels
        (and copies) ``calls`` back-to-back calls ran, from the profiler, divided by ``calls``.
        No host time and no idle gaps, unlike ``time``; no L2 flush either.  NaN in a dry run
        (no device activity to record)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if self.dry_run:  # nothing to record: one call checks the path (the interpreter is slow)
            calls = 1
        else:
            fn()  # warm
        activities = [ProfilerActivity.CPU] + ([] if self.dry_run else [ProfilerActivity.CUDA])
        # one cycle: acc_events=True keeps exactly its events, without torch 2.11's warning that
        # a cycle's end clears them
        with profile(activities=activities, acc_events=True) as prof:
            for _ in range(calls):
                fn()
            if not self.dry_run:
                torch.cuda.synchronize()
        busy_us = sum(e.self_device_time_total for e in prof.events()
                      if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
        return busy_us / calls / 1e3 if busy_us > 0 else float("nan")

    def pair(self, fused: Callable[[], object], eager: Callable[[], object]) -> tuple[float, float]:
        """Median ms of ``fused`` and of ``eager`` (``time``).  Where the fused call loses, also
        their kernel times (``kernel_ms``), kept as ``last_kernel_ms`` for ``annotate``: they
        tell a loss of host time (the kernels win) from a loss on the device."""
        fused_ms, eager_ms = self.time(fused), self.time(eager)
        self.last_kernel_ms = None
        if fused_ms > eager_ms:
            # a dry run has no device to profile (and the interpreter is slow): NaN, as kernel_ms gives
            nan = float("nan")
            self.last_kernel_ms = (nan, nan) if self.dry_run else (self.kernel_ms(fused), self.kernel_ms(eager))
        return fused_ms, eager_ms

    def annotate(self, row: "Measured") -> "Measured":
        """``row`` with the kernel times of the last ``pair`` (where the fused call lost)."""
        row.kernel_ms = self.last_kernel_ms
        self.last_kernel_ms = None
        return row

    def time_against_copy(self, fused: Callable[[], object], eager: Callable[[], object],
                          nbytes: int) -> tuple[float, float, float]:
        """Median ms of ``fused``, ``eager`` (``pair``) and a device-to-device copy moving ``nbytes``."""
        # a copy reads and writes its size: half the bytes each way
        src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        fused_ms, eager_ms = self.pair(fused, eager)
        copy_ms = self.time(lambda: dst.copy_(src))
        del src, dst
        return fused_ms, eager_ms, copy_ms

    def free_bytes(self) -> int:
        """Free device memory (a dry run: 1 GiB, more than its shapes need)."""
        return 1 << 30 if self.dry_run else torch.cuda.mem_get_info()[0]

    def empty_cache(self) -> None:
        """Give cached blocks back, so that the next shape's allocations fit."""
        if not self.dry_run:
            torch.cuda.empty_cache()

    def json_path(self, given: Optional[Path], stem: str) -> Path:
        """``given``, else ``benchmarks/results/<stem>_<device>.json`` (a dry run: a temporary folder)."""
        if given is not None:
            return given
        folder = DRY_RUN_RESULTS if self.dry_run else RESULTS
        return folder / f"{stem}_{sanitize(self.name)}.json"


def start(args: argparse.Namespace, script: str, op: str) -> Optional[Runtime]:
    """The script's Runtime, or None (after saying why on stderr) where it cannot measure:
    no CUDA device without ``--dry-run``, or ``--dry-run`` without the Triton interpreter.

    Imports triton (where it is missing the script stops here, before measuring) and warns
    when ``op``'s CUDA kernel is not the Triton one.
    """
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print(f"{script} --dry-run needs TRITON_INTERPRET=1 in the environment (set before triton is "
                  "imported)", file=sys.stderr)
            return None
    elif not torch.cuda.is_available():
        print(f"{script} needs a CUDA device (none found; --dry-run checks the script on the CPU): "
              "nothing measured", file=sys.stderr)
        return None
    import triton  # noqa: F401

    import pfl_kernels
    info = pfl_kernels.backend_info()
    impl = {name: entry["cuda"]["implementation"] for name, entry in info.items()}
    if impl.get(op) != "triton":
        print(f"warning: the CUDA ops are not the Triton kernels: {impl}", file=sys.stderr)
    return Runtime(args.dry_run, info)


class Measured:
    """The derived numbers of a row, for a dataclass with ``bytes``, ``fused_ms``, ``eager_ms``
    and ``copy_ms`` fields.  ``JSON_EXTRA`` names the properties its JSON adds after its
    fields, as (key, property) pairs in order."""

    JSON_EXTRA: tuple[tuple[str, str], ...] = ()
    kernel_ms: Optional[tuple[float, float]] = None  # (fused, eager) kernel ms, where fused lost (Runtime.annotate)

    @property
    def fused_gbps(self) -> float:
        return self.bytes / self.fused_ms / 1e6

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.fused_ms

    def kernel_note(self) -> str:
        """'' or, where the fused call lost, its kernel time against eager's."""
        if self.kernel_ms is None:
            return ""
        fused, eager = self.kernel_ms
        return (f"  kernels alone: fused {fused * 1e3:.1f} us, eager {eager * 1e3:.1f} us "
                f"({eager / fused:.2f}x)")

    def to_json(self) -> dict:
        out = {**asdict(self), **{key: getattr(self, prop) for key, prop in self.JSON_EXTRA}}
        if self.kernel_ms is not None:
            out["kernel_fused_ms"], out["kernel_eager_ms"] = self.kernel_ms
        return out


def print_rows(rows: Sequence, format_table: Callable[[Sequence], str]) -> None:
    """Each row as its line of the table, as soon as it is measured (with its kernel times
    where the fused call lost)."""
    for r in rows:
        print(format_table([r]).splitlines()[-1] + getattr(r, "kernel_note", lambda: "")(), flush=True)


def parse_args(doc: str, argv: Optional[Sequence[str]], quick_help: str,
               flags: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """--dtype, --quick (``quick_help``), --dry-run, the script's own on/off ``flags``
    (name -> help), then --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU through the Triton interpreter (needs TRITON_INTERPRET=1): "
                             "checks the script, its timings mean nothing")
    for flag, help_text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=help_text)
    parser.add_argument("--json", type=Path, default=None,
                        help="output path (default: benchmarks/results/<suite>_<device>.json)")
    return parser.parse_args(argv)


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive ``values``."""
    return statistics.geometric_mean(values)


def launch_mode() -> dict:
    """How this run's ops launched their Triton kernels, recorded with its figures:
    ``direct_launch``, whether they launch the compiled kernels directly
    (``PFL_KERNELS_DIRECT_LAUNCH``, ``pfl_kernels/triton/_direct.py``), and ``direct_launches``,
    how many launches made so far were direct and how many went through Triton
    (``_direct.counts``), so a run shows that the switch took effect; and ``dispatch_bypass``,
    whether plain eager calls of the functional ops skip the dispatcher
    (``PFL_KERNELS_DISPATCH_BYPASS``, ``pfl_kernels/ops/_eager.py``)."""
    from pfl_kernels.ops import _eager
    from pfl_kernels.triton import _direct

    return {"direct_launch": bool(_direct.ENABLED), "direct_launches": _direct.counts(),
            "dispatch_bypass": bool(_eager.ENABLED)}


def write_json(path: Path, suite: str, runtime: Runtime, results: dict) -> None:
    """Write ``{"suite", "machine", **results}`` to ``path`` and say where."""
    import triton

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "suite": suite,
        "machine": {"device": runtime.name, "dry_run": runtime.dry_run, "torch_version": torch.__version__,
                    "triton_version": triton.__version__, "cuda": torch.version.cuda,
                    "platform": platform.platform(), "backend_info": runtime.backend_info, **launch_mode()},
        **results,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
