"""GPU benchmark of the Triton similarity kernels (needs CUDA, torch >= 2.11, triton >= 3.6).

    python benchmarks/gpu_similarity.py [--dtype float32|bfloat16|float16] [--quick]
    TRITON_INTERPRET=1 python benchmarks/gpu_similarity.py --dry-run   # check the script on a CPU

For every client count K in ``CLIENTS`` and dimension D in ``DIMS`` (inputs under
``MAX_INPUT_BYTES``) it

1. checks ``torch.ops.pfl.pairwise_cosine`` and ``pairwise_sqdist`` on CUDA (the Triton
   kernels; y None: every client against every client) against the float64 reference, and
   stops on a mismatch;
2. times, with ``triton.testing.do_bench`` (median; L2 flushed before each call): the fused
   op, the eager code it replaces (``F.normalize`` + ``mm``; ``torch.cdist(x, x) ** 2``) and
   the floor ``torch.mm(x, x.t())`` in the input dtype (cuBLAS; for float32 with TF32 off,
   the precision the op keeps).  ``copy_ms`` holds the mm time (the shared row format's
   name for the floor);
3. reports the bytes the op must move (x read once, [K, K] float32 written once), the
   ratio to the floor (fused / mm) and the speed-up over eager;
4. for float32 (where ``ops.similarity.cuda_pairwise_path`` chooses between the fused kernel
   and the GEMM form by D), times the op on the path it does not take there too, checked
   against float64 as well: ``path`` is the one that served ``fused_ms``, ``alt_path`` the
   other and ``alt_ms`` its time, so that one run says which path wins at each shape (on the
   H100 the GEMM form, with its device sync, ran at 0.21-0.83x of eager at every D >= 65536,
   and the kernel was not timed there).

``similarity_weights`` is timed at K = M in ``WEIGHT_CLIENTS`` against the eager torch rule
(topk + masks + softmax), with no floor.

Prints a table and writes JSON to ``benchmarks/results/similarity_gpu_<device>.json``.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import _gpu_common as common  # noqa: E402

CLIENTS = [20, 100, 1000]
DIMS = [65_536, 100_000, 1_000_000, 10_000_000]
WEIGHT_CLIENTS = [100, 1000, 10_000]
MAX_INPUT_BYTES = 8 << 30
TARGET = 1.5  # fused / floor (mm), the CPU target, reported on the GPU too
TAU, SCALE, MIN_KEEP = 0.9, 20.0, 4
DRY_RUN_GRID = ([3, 20], [257, 2049], [5, 33])  # (clients, dims, weight clients) of --dry-run


@dataclass
class Row(common.Measured):
    """One measurement: an op at (K, D) (weights: D = K)."""

    op: str
    clients: int
    dim: int
    bytes: int
    fused_ms: float
    eager_ms: float
    copy_ms: float  # the floor: torch.mm (pairwise ops); nan for weights
    max_abs_err: float
    path: str = ""  # the path that served fused_ms: 'triton' or 'gemm' (cuda_pairwise_path)
    alt_path: str = ""  # the other path, timed too (float32 pairwise ops), else ''
    alt_ms: float = float("nan")

    JSON_EXTRA = (("fused_gbps", "fused_gbps"), ("floor_ratio", "floor_ratio"), ("speedup_vs_eager", "speedup"))

    @property
    def floor_ratio(self) -> float:
        return self.fused_ms / self.copy_ms if self.copy_ms == self.copy_ms else float("nan")


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'op':<8} {'K':>6} {'D':>9} {'MB':>8} {'fused us':>10} {'eager us':>10} {'mm us':>10} "
            f"{'x floor':>8} {'x eager':>8} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "" if r.floor_ratio != r.floor_ratio else (" ok" if r.floor_ratio <= TARGET else " MISS")
        lines.append(f"{r.op:<8} {r.clients:>6} {r.dim:>9} {r.bytes / 1e6:>8.1f} {r.fused_ms * 1e3:>10.1f} "
                     f"{r.eager_ms * 1e3:>10.1f} {r.copy_ms * 1e3:>10.1f} {r.floor_ratio:>8.2f} "
                     f"{r.speedup:>8.2f} {r.max_abs_err:>9.2e}{flag}"
                     + (f"  [{r.path}; {r.alt_path}: {r.alt_ms * 1e3:.1f} us]" if r.alt_path else ""))
    return "\n".join(lines)


def bench_pair(rt: common.Runtime, k: int, d: int, dtype: torch.dtype) -> list[Row]:
    """Check then time pairwise_cosine and pairwise_sqdist (y None) at [K, D]."""
    from pfl_kernels.reference import similarity as ref

    device = rt.device
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(k, d, device=device, generator=gen).to(dtype)
    xe = x.double()
    elem = x.element_size()
    nbytes = k * d * elem + k * k * 4
    rows = []
    floor_ms = rt.time(lambda: torch.mm(x, x.t()))

    def fused_cos():
        return torch.ops.pfl.pairwise_cosine(x, None, 1e-8)

    def eager_cos():
        xn = F.normalize(x.float(), dim=1)
        return xn @ xn.t()

    def fused_sq():
        return torch.ops.pfl.pairwise_sqdist(x, None)

    def eager_sq():
        return torch.cdist(x.float(), x.float()) ** 2

    # sqdist: the expanded form's error is relative to the norms (see pairwise_sqdist).
    scale = 2 * xe.pow(2).sum(1).max().item()
    checks = {"cosine": (ref.pairwise_cosine(xe, None, 1e-8), 1.0, 2e-5),
              "sqdist": (ref.pairwise_sqdist(xe, None) / scale, scale, 2e-6 * max(1.0, math.sqrt(d / 1000)))}

    def checked(op: str, fused, what: str = "") -> float:
        want, divisor, tol = checks[op]
        return common.check(f"{op} K={k} D={d}{what}", fused() / divisor, want, tol)

    path = pairwise_path(d, dtype)
    alt_path = {"gemm": "triton", "triton": "gemm"}.get(path, "") if dtype == torch.float32 else ""
    for op, fused, eager in (("cosine", fused_cos, eager_cos), ("sqdist", fused_sq, eager_sq)):
        err = checked(op, fused)
        fused_ms, eager_ms = rt.pair(fused, eager)
        row = rt.annotate(Row(op, k, d, nbytes, fused_ms, eager_ms, floor_ms, err, path, alt_path))
        if alt_path:
            with routed(alt_path, device):
                checked(op, fused, f" ({alt_path})")
                row.alt_ms = rt.time(fused)
        rows.append(row)
    del x, xe
    rt.empty_cache()
    return rows


def pairwise_path(d: int, dtype: torch.dtype) -> str:
    """The path ``pairwise_cosine``/``pairwise_sqdist`` of [K, d] rows take on CUDA now."""
    from pfl_kernels.ops import similarity as ops

    return ops.cuda_pairwise_path(d, dtype, torch.backends.cuda.matmul.allow_tf32)


@contextlib.contextmanager
def routed(path: str, device: str):
    """Within the block float32 rows of any D take ``path`` ('gemm' or 'triton') on ``device``
    (the dispatch reads ``GEMM_MIN_DIM`` and the GEMM devices per call: both are in its plan's key)."""
    from pfl_kernels.ops import similarity as ops
    from pfl_kernels.triton import similarity as kernels

    saved = ops.GEMM_MIN_DIM, kernels._GEMM_DEVICES
    ops.GEMM_MIN_DIM = 0 if path == "gemm" else 1 << 62
    kernels._GEMM_DEVICES = (torch.device(device).type,)
    try:
        yield
    finally:
        ops.GEMM_MIN_DIM, kernels._GEMM_DEVICES = saved


def eager_weights(sim: torch.Tensor) -> torch.Tensor:
    v = sim.clone()
    v.fill_diagonal_(1.0)
    kept = v >= TAU
    kept.scatter_(1, v.topk(min(MIN_KEEP, v.shape[1]), dim=1).indices, True)
    return torch.softmax((SCALE * v).masked_fill(~kept, float("-inf")), dim=1)


def bench_weights(rt: common.Runtime, k: int) -> Row:
    from pfl_kernels.reference import similarity as ref

    gen = torch.Generator(device=rt.device).manual_seed(1)
    sim = torch.rand(k, k, device=rt.device, generator=gen) * 2 - 1

    def fused():
        return torch.ops.pfl.similarity_weights(sim, TAU, SCALE, MIN_KEEP, None)

    err = common.check(f"weights K={k}", fused(), ref.similarity_weights(sim.double(), TAU, SCALE, MIN_KEEP, None),
                       1e-5)
    fused_ms, eager_ms = rt.pair(fused, lambda: eager_weights(sim))
    return rt.annotate(Row("weights", k, k, 2 * k * k * 4, fused_ms, eager_ms, float("nan"), err))


def measure(rt: common.Runtime, args) -> tuple[list[Row], list[list[int]]]:
    """The rows of every (K, D) of the grid (``--quick``: its subset; ``--dry-run``: tiny
    shapes) whose input fits, then of the weights; and the [K, D] left out for their size."""
    dtype = common.DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    if args.dry_run:
        clients, dims, weight_clients = DRY_RUN_GRID
    elif args.quick:
        clients, dims, weight_clients = [20, 100], [65_536, 1_000_000], [1000]
    else:
        clients, dims, weight_clients = CLIENTS, DIMS, WEIGHT_CLIENTS
    rows, skipped = [], []
    for k in clients:
        for d in dims:
            if k * d * elem >= MAX_INPUT_BYTES:
                skipped.append([k, d])
                continue
            rows.extend(bench_pair(rt, k, d, dtype))
            common.print_rows(rows[-2:], format_table)
    for k in weight_clients:
        rows.append(bench_weights(rt, k))
        common.print_rows(rows[-1:], format_table)
    return rows, skipped


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="K in {20, 100}, D in {65536, 10^6}, weights K=1000")
    rt = common.start(args, "gpu_similarity.py", "pfl::pairwise_cosine")
    if rt is None:
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the floor keeps float32 precision, as the op does
    with rt:
        rows, skipped = measure(rt, args)
    print("\n" + format_table(rows))
    pair = [r for r in rows if r.op != "weights"]
    summary = {
        "pairwise_cases": len(pair), "met": sum(r.floor_ratio <= TARGET for r in pair),
        "worst_floor_ratio": max((r.floor_ratio for r in pair), default=None),
        "geomean_speedup_vs_eager": common.geomean([r.speedup for r in rows]) if rows else None,
        "skipped_inputs_over_bytes": skipped,
    }
    print(f"pairwise: {summary['met']}/{summary['pairwise_cases']} within {TARGET}x of torch.mm "
          f"(worst {summary['worst_floor_ratio']:.2f}x)")
    common.write_json(rt.json_path(args.json, "similarity_gpu"), "benchmarks/gpu_similarity.py", rt, {
        "config": {"dtype": args.dtype, "timing": common.TIMING,
                   "bytes": "x read once, the [K, K] float32 result written once",
                   "floor": "torch.mm(x, x.t()) in the input dtype (TF32 off)", "floor_ratio": "fused / mm",
                   "target": TARGET, "eager": "F.normalize + mm; torch.cdist ** 2; topk + masks + softmax",
                   "weights": {"tau": TAU, "scale": SCALE, "min_keep": MIN_KEEP}},
        "summary": summary,
        "rows": [r.to_json() for r in rows],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
