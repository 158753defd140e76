"""GPU benchmark of the Triton weighted_average kernels (needs CUDA, torch >= 2.11, triton >= 3.6).

    python benchmarks/gpu_aggregate.py [--dtype float32|bfloat16|float16] [--quick]
    TRITON_INTERPRET=1 python benchmarks/gpu_aggregate.py --dry-run   # check the script on a CPU

For every K (= M clients) in ``CLIENTS`` and P in ``PARAMS`` that fits in ``MAX_BYTES`` of
params + out, with dense softmax weights and with weights thresholded to ``SPARSE_DENSITY``
nonzero per row (as after ``similarity_weights``), it

1. checks ``torch.ops.pfl.weighted_average`` on CUDA (the Triton kernels) against the float64
   reference on a slice of columns, and stops on a mismatch;
2. times, with ``triton.testing.do_bench`` (median; L2 flushed before each call),
   ``weighted_average(w, params, out=out)``, the BLAS product it replaces
   (``torch.mm(w, params, out=out)``: cuBLAS, full float32, TF32 off as by default) and a
   device-to-device copy of the bytes the op must move (params and weights read once, out
   written once);
3. reports the floor that binds the case, max(copy, torch.mm) (the copy where the product is
   memory bound: small K; torch.mm where it is arithmetic bound), and the ratio to it.
   Target: <= 1.2x the floor at P = 10^7 (dense).  For sparse weights torch.mm is no floor
   (it does all K·M products): the ratio is to the copy of the bytes the kept rows need
   (each kept (row, client) pair reads its client's row: nnz·P reads), and the speedup over
   torch.mm is reported.

Prints a table and writes JSON to ``benchmarks/results/aggregate_gpu_<device>.json``.
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
PARAMS = [65536, 10**5, 10**6, 10**7]
SPARSE_DENSITY = 0.05
MAX_BYTES = 48 << 30  # params + out, so that an 80 GB GPU holds them and the copy buffers
TARGET = 1.2  # time / floor, on the dense cases at TARGET_P
TARGET_P = 10**7
CHECK_COLS = 4096  # columns compared with the float64 reference
ALT_BLOCK_E = 8  # kept rows per step of the sparse kernel timed beside the default's
DRY_RUN_GRID = ([3, 20], [1000, 4099])  # (clients, params) of --dry-run


def op_bytes(clients: int, p: int, elem: int, nnz: Optional[int] = None) -> int:
    """Bytes an ideal kernel moves: params read once (sparse: each kept (row, client) pair
    reads its client's row, nnz·P elements, an upper bound since rows kept by several outputs
    may come from L2), weights read once (float32), out written once."""
    reads = clients * p if nnz is None else nnz * p
    return (reads + clients * p) * elem + clients * clients * 4


@dataclass
class Row(common.Measured):
    """One measurement: K, P, density."""

    clients: int
    params: int
    density: float
    bytes: int
    fused_ms: float
    eager_ms: float
    copy_ms: float
    max_abs_err: float
    # sparse: the kernel gathering ALT_BLOCK_E kept rows per step (the default gathers
    # triton.aggregate._SPARSE_BLOCK_E), timed beside it for the next choice of that default
    blocked_ms: Optional[float] = None
    # the 3xTF32 dense Triton kernel on the same call (triton.aggregate._PATH_OVERRIDE), every
    # density, so that a run says where it beats the path that serves
    dense_kernel_ms: Optional[float] = None

    JSON_EXTRA = (("fused_gbps", "fused_gbps"), ("floor_ms", "floor_ms"), ("floor_ratio", "floor_ratio"),
                  ("speedup_vs_mm", "speedup"), ("targeted", "targeted"))

    @property
    def floor_ms(self) -> float:
        """The floor that binds: max(copy, torch.mm) for dense weights, the copy for sparse."""
        return self.copy_ms if self.density < 1 else max(self.copy_ms, self.eager_ms)

    @property
    def floor_ratio(self) -> float:
        return self.fused_ms / self.floor_ms

    @property
    def targeted(self) -> bool:
        return self.density == 1.0 and self.params == TARGET_P


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'K':>5} {'P':>9} {'dens':>5} {'MB':>9} {'ours us':>10} {'mm us':>10} {'copy us':>10} "
            f"{'GB/s':>6} {'x floor':>8} {'x mm':>7} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        flag = "" if not r.targeted else (" ok" if r.floor_ratio <= TARGET else " MISS")
        lines.append(
            f"{r.clients:>5} {r.params:>9} {r.density:>5.2f} {r.bytes / 1e6:>9.1f} {r.fused_ms * 1e3:>10.1f} "
            f"{r.eager_ms * 1e3:>10.1f} {r.copy_ms * 1e3:>10.1f} {r.fused_gbps:>6.0f} {r.floor_ratio:>8.2f} "
            f"{r.speedup:>7.2f} {r.max_abs_err:>9.2e}{flag}"
            + (f"  {ALT_BLOCK_E} rows per step: {r.blocked_ms * 1e3:.1f} us" if r.blocked_ms is not None else "")
            + (f"  dense kernel: {r.dense_kernel_ms * 1e3:.1f} us" if r.dense_kernel_ms is not None else ""))
    return "\n".join(lines)


def summarize(rows: Sequence[Row]) -> dict:
    out = {}
    for name, sel in (("dense_target", [r for r in rows if r.targeted]),
                      ("dense", [r for r in rows if r.density == 1.0]),
                      ("sparse", [r for r in rows if r.density < 1.0])):
        if not sel:
            out[name] = {"cases": 0}
            continue
        worst = max(sel, key=lambda r: r.floor_ratio)
        out[name] = {
            "cases": len(sel), "met": sum(r.floor_ratio <= TARGET for r in sel),
            "worst_floor_ratio": worst.floor_ratio,
            "worst_case": {"clients": worst.clients, "params": worst.params},
            "geomean_floor_ratio": common.geomean([r.floor_ratio for r in sel]),
            "geomean_speedup_vs_mm": common.geomean([r.speedup for r in sel]),
        }
    return out


def make_weights(k: int, density: float, gen: torch.Generator, device: str) -> torch.Tensor:
    w = torch.softmax(torch.randn(k, k, device=device, generator=gen), -1)
    if density < 1:
        keep = torch.rand(k, k, device=device, generator=gen).argsort(1) < max(1, int(density * k))
        w = torch.softmax(torch.where(keep, w, -float("inf")), -1)
    return w


def bench_case(rt: common.Runtime, k: int, p: int, density: float, dtype: torch.dtype) -> Row:
    from pfl_kernels.reference import aggregate as ref

    device = rt.device
    gen = torch.Generator(device=device).manual_seed(0)
    w = make_weights(k, density, gen, device)
    params = torch.randn(k, p, device=device, generator=gen).to(dtype)
    out = torch.empty(k, p, device=device, dtype=dtype)
    w_mm = w.to(dtype)

    def fused():
        return torch.ops.pfl.weighted_average.out(w, params, out=out)

    def eager():
        return torch.mm(w_mm, params, out=out)

    fused()
    cols = min(p, CHECK_COLS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = common.check(f"K={k} P={p} density={density}", out[:, :cols],
                       ref.weighted_average(w.double(), params[:, :cols].double()), tol)
    elem = params.element_size()
    nnz = int((w != 0).sum()) if density < 1 else None
    nbytes = op_bytes(k, p, elem, nnz)
    fused_ms, eager_ms, copy_ms = rt.time_against_copy(fused, eager, nbytes)
    from pfl_kernels.triton import aggregate as ta

    # the 3xTF32 dense kernel on every call, whatever the density
    dense_kernel_ms = rt.time_patched(fused, lambda: common.check(
        f"K={k} P={p} density={density}, the dense kernel", out[:, :cols],
        ref.weighted_average(w.double(), params[:, :cols].double()), tol), ta, _PATH_OVERRIDE="dense") \
        if dtype != torch.float64 else None
    # the sparse kernel gathering ALT_BLOCK_E kept rows per step
    blocked_ms = rt.time_patched(fused, lambda: common.check(
        f"K={k} P={p} density={density}, {ALT_BLOCK_E} rows per step", out[:, :cols],
        ref.weighted_average(w.double(), params[:, :cols].double()), tol), ta, _SPARSE_BLOCK_E=ALT_BLOCK_E) \
        if density < 1 else None
    del params, out
    rt.empty_cache()
    return rt.annotate(Row(k, p, density, nbytes, fused_ms, eager_ms, copy_ms, err, blocked_ms, dense_kernel_ms))


def measure(rt: common.Runtime, args) -> list[Row]:
    """Every case of the grid (``--quick``: its subset; ``--dry-run``: tiny shapes) that fits."""
    dtype = common.DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    budget = min(MAX_BYTES, rt.free_bytes() // 2)
    if args.dry_run:
        clients, sizes = DRY_RUN_GRID
    else:
        clients = [20, 100] if args.quick else CLIENTS
        sizes = [10**6, 10**7] if args.quick else PARAMS
    rows = []
    for k in clients:
        for p in sizes:
            if 2 * k * p * elem > budget:
                continue
            for density in (1.0, SPARSE_DENSITY):
                rows.append(bench_case(rt, k, p, density, dtype))
                common.print_rows(rows[-1:], format_table)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="K=20 and 100 at P=10^6 and 10^7 only")
    rt = common.start(args, "gpu_aggregate.py", "pfl::weighted_average")
    if rt is None:
        return 2
    with rt:
        rows = measure(rt, args)
    print("\n" + format_table(rows))
    summary = summarize(rows)
    s = summary["dense_target"]
    if s["cases"]:
        print(f"dense at P={TARGET_P}: {s['met']}/{s['cases']} cases within {TARGET}x of the floor "
              f"(worst {s['worst_floor_ratio']:.2f}x at {s['worst_case']})")
    common.write_json(rt.json_path(args.json, "aggregate_gpu"), "benchmarks/gpu_aggregate.py", rt, {
        "config": {"dtype": args.dtype, "weights": "softmax, float32; sparse: top-5% random kept per row",
                   "timing": common.TIMING, "bytes": "params (sparse: nnz rows) and weights read once, out "
                   "written once (op_bytes)",
                   "floor": "dense: max(device copy of the same bytes, torch.mm); sparse: the copy",
                   "target": TARGET, "target_params": TARGET_P, "sparse_density": SPARSE_DENSITY},
        "summary": summary,
        "rows": [r.to_json() for r in rows],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
