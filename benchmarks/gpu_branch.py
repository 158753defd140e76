"""GPU benchmark of the Triton multi-branch kernels (needs CUDA, torch >= 2.11, triton >= 3.6).

    python benchmarks/gpu_branch.py [--dtype float32|bfloat16|float16] [--quick] [--shared]

For every weight shape of ``SHAPES`` (pFedMB's LeNet-5 and ResNet-9 layers), branch count B
in ``BRANCHES`` and client count K in ``CLIENTS`` it

1. checks the fused ops (``torch.ops.pfl.branch_combine`` / ``branch_combine_backward`` on
   CUDA, i.e. the Triton kernels) against the float64 reference, and stops on a mismatch;
2. times, with ``triton.testing.do_bench`` (median; L2 flushed before each call):
   the fused forward and backward (both gradients), the eager code they replace
   (``torch.einsum`` and its autograd backward) and the floor: a device-to-device copy
   that moves the same number of bytes;
3. reports the bytes the op must move (each input read once, each output written once:
   see ``op_bytes``), the achieved bandwidth, the ratio to the floor (fused time / copy
   time; target <= 1.2 on the large cases) and the speedup over eager.

Weights are per client ([K, B, *shape]); ``--shared`` passes branches shared by all clients
as ``weights.expand(K, ...)`` instead (read once: fewer bytes).

``TRITON_INTERPRET=1 python benchmarks/gpu_branch.py --dry-run`` checks the script on a CPU.

Prints a table and writes JSON to ``benchmarks/results/branch_gpu_<device>.json``.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import _gpu_common as common  # noqa: E402

# pFedMB LeNet-5 (convs, linears) and ResNet-9 convs.
SHAPES = [
    (6, 3, 5, 5), (16, 6, 5, 5), (120, 400), (84, 120), (10, 84),
    (128, 64, 5, 5), (128, 128, 3, 3), (256, 128, 3, 3), (256, 256, 3, 3),
]
BRANCHES = [2, 5, 10]
CLIENTS = [1, 20]
TARGET = 1.2  # fused time / floor (copy) time, on the cases that move at least BIG_BYTES
BIG_BYTES = 16 << 20  # below this, launch latency dominates both the op and the copy
DRY_RUN_GRID = ([1, 3], [2], [(6, 3, 5, 5), (10, 84)])  # (clients, branches, shapes) of --dry-run


def op_bytes(direction: str, clients: int, branches: int, n: int, elem: int, shared: bool = False) -> int:
    """Bytes an ideal kernel moves: every input it needs read once, every output written once.

    forward:  read weights [K, B, N] (shared: [B, N]) and alpha [K, B]; write W [K, N].
    backward: read G [K, N], weights and alpha; write grad_weights [K, B, N] (always per
              client: the autograd engine sums it over K for shared branches) and
              grad_alpha [K, B].
    The Triton backward also writes and re-reads small float32 partial sums of grad_alpha
    ([K, N / BLOCK_N, B]); they are overhead, not counted.
    """
    k, b = clients, branches
    w_read = (1 if shared else k) * b * n
    if direction == "forward":
        return (w_read + k * b + k * n) * elem
    if direction != "backward":
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return (k * n + w_read + k * b + k * b * n + k * b) * elem


@dataclass
class Row(common.Measured):
    """One measurement: a shape, B, K and a direction."""

    shape: list
    branches: int
    clients: int
    direction: str
    bytes: int
    fused_ms: float
    eager_ms: float
    copy_ms: float
    max_abs_err: float

    JSON_EXTRA = (("fused_gbps", "fused_gbps"), ("floor_ratio", "floor_ratio"),
                  ("speedup_vs_eager", "speedup"), ("big", "big"))

    @property
    def floor_ratio(self) -> float:
        """Fused time / floor (copy of the same bytes) time: 1.0 is the floor."""
        return self.fused_ms / self.copy_ms

    @property
    def big(self) -> bool:
        return self.bytes >= BIG_BYTES


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table for people."""
    head = (f"{'shape':<14} {'B':>3} {'K':>3} {'dir':<4} {'MB':>8} {'fused us':>9} {'eager us':>9} "
            f"{'floor us':>9} {'GB/s':>6} {'x floor':>8} {'x eager':>8} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(str(s) for s in r.shape)
        flag = "" if not r.big else (" ok" if r.floor_ratio <= TARGET else " MISS")
        lines.append(
            f"{shape:<14} {r.branches:>3} {r.clients:>3} {'fwd' if r.direction == 'forward' else 'bwd':<4} "
            f"{r.bytes / 1e6:>8.2f} {r.fused_ms * 1e3:>9.1f} {r.eager_ms * 1e3:>9.1f} {r.copy_ms * 1e3:>9.1f} "
            f"{r.fused_gbps:>6.0f} {r.floor_ratio:>8.2f} {r.speedup:>8.2f} {r.max_abs_err:>9.2e}{flag}")
    return "\n".join(lines)


def summarize(rows: Sequence[Row]) -> dict:
    """Per direction over the big cases: how many are within TARGET of the floor, the worst."""
    out = {}
    for direction in ("forward", "backward"):
        big = [r for r in rows if r.direction == direction and r.big]
        if not big:
            out[direction] = {"cases": 0}
            continue
        worst = max(big, key=lambda r: r.floor_ratio)
        out[direction] = {
            "cases": len(big), "met": sum(r.floor_ratio <= TARGET for r in big),
            "worst_floor_ratio": worst.floor_ratio,
            "worst_case": {"shape": worst.shape, "branches": worst.branches, "clients": worst.clients},
            "geomean_floor_ratio": common.geomean([r.floor_ratio for r in big]),
            "geomean_speedup_vs_eager": common.geomean([r.speedup for r in big]),
        }
    return out


def bench_case(rt: common.Runtime, shape, branches, clients, dtype, shared=False) -> list[Row]:
    """Check then time the forward and backward of one (shape, B, K)."""
    from pfl_kernels.reference import branch as ref

    dev = rt.device
    n = math.prod(shape)
    gen = torch.Generator(device=dev).manual_seed(0)
    if shared:
        base = torch.randn(branches, *shape, device=dev, generator=gen).to(dtype)
        weights = base.expand(clients, *base.shape)
    else:
        weights = torch.randn(clients, branches, *shape, device=dev, generator=gen).to(dtype)
    alpha = torch.softmax(torch.randn(clients, branches, device=dev, generator=gen), -1).to(dtype)
    g = torch.randn(clients, *shape, device=dev, generator=gen).to(dtype)
    mask = [True, True]
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def fused_fwd():
        return torch.ops.pfl.branch_combine(weights, alpha)

    def fused_bwd():
        return torch.ops.pfl.branch_combine_backward(g, weights, alpha, mask)

    # Eager: torch.einsum and its autograd backward (graph built once, replayed).
    w_leaf = weights.detach().clone().requires_grad_(True) if not shared else \
        weights.detach()[0].clone().requires_grad_(True)
    a_leaf = alpha.detach().clone().requires_grad_(True)

    def eager_graph():
        w = w_leaf.expand(clients, *w_leaf.shape) if shared else w_leaf
        return torch.einsum("kb,kbn->kn", a_leaf, w.reshape(clients, branches, n))

    def eager_fwd():
        with torch.no_grad():
            return eager_graph()

    eager_out = eager_graph()
    g_flat = g.reshape(clients, n)

    def eager_bwd():
        return torch.autograd.grad(eager_out, (w_leaf, a_leaf), g_flat, retain_graph=True)

    # 1. correctness against float64
    d_w, d_a, d_g = weights.double(), alpha.double(), g.double()
    err_f = common.check(f"forward {shape} B={branches} K={clients}", fused_fwd(),
                         ref.branch_combine(d_w, d_a), tol)
    err_b = 0.0
    got = fused_bwd()
    want = ref.branch_combine_backward(d_g, d_w, d_a, mask)
    for name, a, b in zip(("grad_weights", "grad_alpha"), got, want):
        # grad_alpha sums N products: compare relative to its scale
        scale = max(1.0, b.abs().max().item()) if name == "grad_alpha" else 1.0
        err_b = max(err_b, common.check(f"backward {name} {shape} B={branches} K={clients}",
                                        a / scale, b / scale, tol))

    # 2. timings
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for direction, fused, eager, err in (("forward", fused_fwd, eager_fwd, err_f),
                                         ("backward", fused_bwd, eager_bwd, err_b)):
        nbytes = op_bytes(direction, clients, branches, n, elem, shared)
        fused_ms, eager_ms, copy_ms = rt.time_against_copy(fused, eager, nbytes)
        out.append(rt.annotate(Row(list(shape), branches, clients, direction, nbytes, fused_ms, eager_ms, copy_ms, err)))
    return out


def measure(rt: common.Runtime, args) -> list[Row]:
    """Forward and backward rows of every (K, B, shape) (``--quick``: K = 20, B = 5;
    ``--dry-run``: ``DRY_RUN_GRID``)."""
    dtype = common.DTYPES[args.dtype]
    if args.dry_run:
        clients, branch_counts, shapes = DRY_RUN_GRID
    else:
        clients = [20] if args.quick else CLIENTS
        branch_counts = [5] if args.quick else BRANCHES
        shapes = SHAPES
    rows = []
    for k in clients:
        for branches in branch_counts:
            for shape in shapes:
                rows.extend(bench_case(rt, shape, branches, k, dtype, args.shared))
                common.print_rows(rows[-2:], format_table)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="K=20 and B=5 only",
                             flags={"--shared": "branches shared by all clients (expanded)"})
    rt = common.start(args, "gpu_branch.py", "pfl::branch_combine")
    if rt is None:
        return 2
    with rt:
        rows = measure(rt, args)
    print("\n" + format_table(rows))
    summary = summarize(rows)
    for direction, s in summary.items():
        if s["cases"]:
            print(f"{direction}: {s['met']}/{s['cases']} cases moving >= {BIG_BYTES >> 20} MiB within "
                  f"{TARGET}x of the floor (worst {s['worst_floor_ratio']:.2f}x at {s['worst_case']}; "
                  f"geomean {s['geomean_floor_ratio']:.2f}x of the floor, "
                  f"{s['geomean_speedup_vs_eager']:.2f}x faster than eager)")

    suffix = "_shared" if args.shared else ""
    common.write_json(rt.json_path(args.json, f"branch_gpu{suffix}"), "benchmarks/gpu_branch.py", rt, {
        "config": {"dtype": args.dtype, "shared_weights": args.shared, "output_mask": [True, True],
                   "timing": common.TIMING, "bytes": common.BYTES,
                   "floor": "device-to-device copy of the same bytes",
                   "floor_ratio": "fused time / copy time", "target": TARGET, "big_bytes": BIG_BYTES,
                   "eager": "torch.einsum forward; its autograd backward (torch.autograd.grad)"},
        "summary": summary,
        "rows": [r.to_json() for r in rows],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
