"""GPU benchmark of the Triton branch_aggregate and class_means kernels (needs CUDA, torch >= 2.11,
triton >= 3.6).

    python benchmarks/gpu_branch_aggregate.py [--dtype float32|bfloat16|float16] [--quick]
    TRITON_INTERPRET=1 python benchmarks/gpu_branch_aggregate.py --dry-run   # check the script on a CPU

1. branch_aggregate (pFedMB Eq. 5) at K ∈ {20, 100, 1000}, B = 5, P ∈ {65536, 10^5, 10^6,
   10^7}, skipping shapes whose params exceed ``MAX_BYTES`` (16 GB: K = 1000 at P = 10^7;
   K = 100 at P = 10^7 is 20 GB in float32 and is kept only in bfloat16/float16, at 10 GB);
2. class_means (Fed-CMA) at N ∈ {10^4, 10^5, 10^6}, D ∈ {256, 512}, C ∈ {10, 100}.

For each shape it checks the op (``torch.ops.pfl.*`` on CUDA: the Triton kernels) against the
float64 reference, stops on a mismatch, and times with ``triton.testing.do_bench`` (median, L2
flushed) the op (``branch_aggregate.out`` into a preallocated W), the eager code it replaces
(normalized weights + ``torch.einsum``; ``index_add_`` + ``bincount``) and the floor: a
device-to-device copy moving the op's bytes (``op_bytes``).  Target: branch_aggregate within 1.2x of the floor at P = 10^7.

Prints a table and writes JSON to ``benchmarks/results/branch_aggregate_gpu_<device>.json``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import _gpu_common as common  # noqa: E402

CLIENTS = [20, 100, 1000]
PARAMS = [65536, 10 ** 5, 10 ** 6, 10 ** 7]
BRANCHES = 5
MAX_BYTES = 16 << 30
SAMPLES = [10 ** 4, 10 ** 5, 10 ** 6]
DIMS = [256, 512]
CLASSES = [10, 100]
TARGET = 1.2  # op time / floor (copy) time, branch_aggregate at P = 10^7
TARGET_P = 10 ** 7
# --dry-run: (K, P) of branch_aggregate and (N, D, C) of class_means
DRY_RUN_GRID = ([(3, 1000), (20, 4099)], [(1000, 33, 10), (2049, 48, 7)])


def op_bytes(op: str, shape: tuple, elem: int) -> int:
    """Bytes an ideal kernel moves: every input read once, every output written once.

    aggregate [K, B, P]: read params K·B·P (``elem`` bytes each), alpha and counts (negligible,
    counted as 4 and 8 bytes), write W B·P.  class_means [N, D, C]: read features N·D and
    labels N (8 bytes), write means C·D (float32) and counts C (8 bytes).
    """
    if op == "aggregate":
        k, b, p = shape
        return k * b * p * elem + k * b * 4 + k * 8 + b * p * elem
    n, d, c = shape
    return n * d * elem + n * 8 + c * d * 4 + c * 8


@dataclass
class Row(common.Measured):
    op: str
    shape: list
    bytes: int
    fused_ms: float
    eager_ms: float
    copy_ms: float
    max_abs_err: float
    # class_means: the chunked segment kernel on the same call where the one-hot GEMM served
    # (triton.class_means._GEMM_DEVICES emptied), so that a run says which one wins
    segment_ms: Optional[float] = None

    JSON_EXTRA = (("fused_gbps", "fused_gbps"), ("floor_ratio", "floor_ratio"),
                  ("speedup_vs_eager", "speedup"), ("targeted", "targeted"))

    @property
    def floor_ratio(self) -> float:
        return self.fused_ms / self.copy_ms

    @property
    def targeted(self) -> bool:
        return self.op == "aggregate" and self.shape[2] == TARGET_P


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'op':<11} {'shape':<18} {'MB':>9} {'fused us':>10} {'eager us':>10} {'floor us':>10} "
            f"{'GB/s':>6} {'x floor':>8} {'x eager':>8} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "" if not r.targeted else (" ok" if r.floor_ratio <= TARGET else " MISS")
        lines.append(
            f"{r.op:<11} {'x'.join(map(str, r.shape)):<18} {r.bytes / 1e6:>9.2f} {r.fused_ms * 1e3:>10.1f} "
            f"{r.eager_ms * 1e3:>10.1f} {r.copy_ms * 1e3:>10.1f} {r.fused_gbps:>6.0f} {r.floor_ratio:>8.2f} "
            f"{r.speedup:>8.2f} {r.max_abs_err:>9.2e}{flag}"
            + (f"  segment kernel: {r.segment_ms * 1e3:.1f} us" if r.segment_ms is not None else ""))
    return "\n".join(lines)


def bench_aggregate(rt: common.Runtime, k: int, b: int, p: int, dtype: torch.dtype) -> Row:
    from pfl_kernels.reference import branch_aggregate as ref

    dev = rt.device
    gen = torch.Generator(device=dev).manual_seed(0)
    params = torch.randn(k, b, p, device=dev, generator=gen, dtype=torch.float32).to(dtype)
    alpha = torch.rand(k, b, device=dev, generator=gen) + 0.05
    counts = torch.randint(1, 1001, (k,), device=dev, generator=gen)
    out = torch.empty(b, p, device=dev, dtype=dtype)

    def fused():  # into a preallocated W, as the floor's copy writes a preallocated buffer
        return torch.ops.pfl.branch_aggregate.out(params, alpha, counts, out=out)

    def eager():
        weight = counts[:, None].to(alpha.dtype) * alpha
        return torch.einsum("kb,kbp->bp", (weight / weight.sum(0)).to(dtype), params)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # float64 check on a slice of P (the whole would double the memory of the largest cases)
    cols = slice(0, min(p, 1 << 20))
    want = ref.branch_aggregate(params[..., cols].double(), alpha.double(), counts)
    err = common.check(f"aggregate K={k} B={b} P={p}", fused()[:, cols], want, tol)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = op_bytes("aggregate", (k, b, p), elem)
    fused_ms, eager_ms, copy_ms = rt.time_against_copy(fused, eager, nbytes)
    del params, out
    return rt.annotate(Row("aggregate", [k, b, p], nbytes, fused_ms, eager_ms, copy_ms, err))


def bench_class_means(rt: common.Runtime, n: int, d: int, c: int, dtype: torch.dtype) -> Row:
    from pfl_kernels.reference import class_means as ref

    dev = rt.device
    gen = torch.Generator(device=dev).manual_seed(0)
    features = torch.randn(n, d, device=dev, generator=gen, dtype=torch.float32).to(dtype)
    labels = torch.randint(0, c, (n,), device=dev, generator=gen)

    def fused():
        return torch.ops.pfl.class_means(features, labels, c)

    def eager():
        sums = torch.zeros(c, d, device=dev).index_add_(0, labels, features.float())
        counts = torch.bincount(labels, minlength=c)
        return sums / counts.clamp_min(1)[:, None], counts

    means, counts = fused()
    want_means, want_counts = ref.class_means(features.double(), labels, c)
    if not torch.equal(counts, want_counts):
        raise AssertionError(f"class_means N={n} D={d} C={c}: counts differ")
    err = common.check(f"class_means N={n} D={d} C={c}", means, want_means, 1e-5)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = op_bytes("class_means", (n, d, c), elem)
    fused_ms, eager_ms, copy_ms = rt.time_against_copy(fused, eager, nbytes)
    from pfl_kernels.triton import class_means as tc

    # the segment kernel, the one-hot GEMM off
    segment_ms = rt.time_patched(fused, lambda: common.check(
        f"class_means N={n} D={d} C={c}, the segment kernel", fused()[0], want_means, 1e-5), tc, _GEMM_DEVICES=())
    return rt.annotate(Row("class_means", [n, d, c], nbytes, fused_ms, eager_ms, copy_ms, err, segment_ms))


def measure(rt: common.Runtime, args) -> list[Row]:
    """branch_aggregate then class_means over their grids (``--quick``: subsets; ``--dry-run``:
    tiny shapes), skipping params over ``MAX_BYTES``."""
    dtype = common.DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    if args.dry_run:
        grid, cm_grid = DRY_RUN_GRID
    elif args.quick:
        grid, cm_grid = [(20, p) for p in (10 ** 6, 10 ** 7)], [(10 ** 5, 256, c) for c in CLASSES]
    else:
        grid = [(k, p) for k in CLIENTS for p in PARAMS]
        cm_grid = [(n, d, c) for n in SAMPLES for d in DIMS for c in CLASSES]
    rows: list[Row] = []
    for k, p in grid:
        if k * BRANCHES * p * elem > MAX_BYTES:
            print(f"skip aggregate K={k} B={BRANCHES} P={p}: params exceed {MAX_BYTES >> 30} GiB")
            continue
        rows.append(bench_aggregate(rt, k, BRANCHES, p, dtype))
        common.print_rows(rows[-1:], format_table)
        rt.empty_cache()
    for n, d, c in cm_grid:
        rows.append(bench_class_means(rt, n, d, c, dtype))
        common.print_rows(rows[-1:], format_table)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="K=20 and P in {10^6, 10^7}; N=10^5, D=256 only")
    rt = common.start(args, "gpu_branch_aggregate.py", "pfl::branch_aggregate")
    if rt is None:
        return 2
    with rt:
        rows = measure(rt, args)
    print("\n" + format_table(rows))
    targeted = [r for r in rows if r.targeted]
    summary = {"aggregate_at_target_p": {
        "cases": len(targeted), "met": sum(r.floor_ratio <= TARGET for r in targeted),
        "worst_floor_ratio": max((r.floor_ratio for r in targeted), default=None)}}
    for op in ("aggregate", "class_means"):
        sel = [r for r in rows if r.op == op]
        if sel:
            summary[op] = {"cases": len(sel),
                           "geomean_floor_ratio": common.geomean([r.floor_ratio for r in sel]),
                           "geomean_speedup_vs_eager": common.geomean([r.speedup for r in sel])}
    print(summary)
    common.write_json(rt.json_path(args.json, "branch_aggregate_gpu"), "benchmarks/gpu_branch_aggregate.py", rt, {
        "config": {"dtype": args.dtype, "branches": BRANCHES, "timing": common.TIMING, "bytes": common.BYTES,
                   "floor": "device-to-device copy of the same bytes", "floor_ratio": "fused time / copy time",
                   "target": TARGET, "target_params": TARGET_P,
                   "eager": "normalized weights + torch.einsum; index_add_ + bincount"},
        "summary": summary,
        "rows": [r.to_json() for r in rows],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
