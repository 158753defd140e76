"""GPU benchmark of the Triton factorized-weight kernels (needs CUDA, torch >= 2.11, triton >= 3.6).

    python benchmarks/gpu_factorized.py [--dtype float32|bfloat16|float16] [--quick]

For every weight shape of ``SHAPES`` (Factorized-FL's ResNet-9 / LeNet-5 layers; rank 1,
mu and mask) and client count K in ``CLIENTS`` it

1. checks the fused op (``torch.ops.pfl.*`` on CUDA, i.e. the Triton kernels) against the
   float64 reference, and stops on a mismatch;
2. times, with ``triton.testing.do_bench`` (median; L2 flushed before each call):
   the fused forward and backward, the eager composition they replace
   (``pfl_kernels.reference.factorized``) and a device-to-device copy that moves the same
   number of bytes;
3. reports the bytes the op must move (each input read once, each output written once:
   see ``op_bytes``), the achieved bandwidth and its share of the copy's bandwidth
   (``copy time / fused time``; target >= 70% at the largest shape).

``TRITON_INTERPRET=1 python benchmarks/gpu_factorized.py --dry-run`` checks the script on a CPU.

Prints a table and writes JSON to ``benchmarks/results/factorized_gpu_<device>.json``.
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

# (shape, layout): ResNet-9 convs, LeNet-5 convs and LeNet-5 linears.
SHAPES = [
    ((128, 64, 5, 5), "spatial"), ((128, 128, 3, 3), "spatial"), ((256, 128, 3, 3), "spatial"),
    ((256, 256, 3, 3), "spatial"), ((6, 3, 5, 5), "spatial"), ((16, 6, 5, 5), "spatial"),
    ((120, 400), "linear"), ((84, 120), "linear"),
]
CLIENTS = [1, 20, 100]
RANK = 1
OUTPUT_MASK = (True, True, True, True)  # grads of u, v, mu and mask
TARGET = 0.70  # share of copy bandwidth at the largest shape
DRY_RUN_GRID = ([1, 3], [((6, 3, 5, 5), "spatial"), ((84, 120), "linear")])  # (clients, shapes) of --dry-run


def geometry(shape: Sequence[int], layout: str) -> tuple[int, int]:
    """(R, C) of the factor matrix (see ``pfl_kernels._layout``)."""
    from pfl_kernels._layout import layout_geometry
    rows, cols, _, _ = layout_geometry(shape, layout)
    return rows, cols


def op_bytes(direction: str, clients: int, rows: int, cols: int, rank: int, elem: int,
             output_mask: Sequence[bool] = OUTPUT_MASK, has_mu: bool = True,
             has_mask: bool = True) -> int:
    """Bytes an ideal kernel moves: every input it needs read once, every output written once.

    forward:  read u [K,R,r], v [K,r,C], mu and mask [K,R,C]; write W [K,R*C].
    backward: read G [K,R,C]; v if grad_u, u if grad_v, mask if grad_mu, mu if grad_mask;
              write each requested gradient (grad_u [K,R,r], grad_v [K,r,C],
              grad_mu and grad_mask [K,R,C]).
    The Triton backward also writes and re-reads small float32 partial sums of grad_u /
    grad_v (r/BLOCK of G's size); they are overhead, not counted.
    """
    k, n_rc, n_u, n_v = clients, rows * cols, rows * rank, rank * cols
    if direction == "forward":
        elems = n_u + n_v + n_rc  # u, v, W
        elems += n_rc if has_mu else 0
        elems += n_rc if has_mask else 0
        return k * elems * elem
    if direction != "backward":
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    want_u, want_v = output_mask[0], output_mask[1]
    want_mu, want_mask = output_mask[2] and has_mu, output_mask[3] and has_mask
    elems = n_rc  # G
    elems += (n_v + n_u) if want_u else 0  # read v, write grad_u
    elems += (n_u + n_v) if want_v else 0  # read u, write grad_v
    elems += (n_rc * (2 if has_mask else 1)) if want_mu else 0  # (read mask,) write grad_mu
    elems += 2 * n_rc if want_mask else 0  # read mu, write grad_mask
    return k * elems * elem


@dataclass
class Row(common.Measured):
    """One measurement: a shape, a client count and a direction."""

    shape: list
    layout: str
    clients: int
    direction: str
    bytes: int
    fused_ms: float
    eager_ms: float
    copy_ms: float
    max_abs_err: float

    JSON_EXTRA = (("fused_gbps", "fused_gbps"), ("copy_share", "copy_share"), ("speedup_vs_eager", "speedup"))

    @property
    def copy_share(self) -> float:
        """Achieved share of copy bandwidth for the same bytes: copy time / fused time."""
        return self.copy_ms / self.fused_ms


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width table for people."""
    head = (f"{'shape':<18} {'layout':<8} {'K':>4} {'dir':<4} {'MB':>9} {'fused us':>10} "
            f"{'eager us':>10} {'copy us':>9} {'GB/s':>8} {'%copy':>6} {'x eager':>8} {'max err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(str(s) for s in r.shape)
        lines.append(
            f"{shape:<18} {r.layout:<8} {r.clients:>4} {'fwd' if r.direction == 'forward' else 'bwd':<4} {r.bytes / 1e6:>9.2f} "
            f"{r.fused_ms * 1e3:>10.1f} {r.eager_ms * 1e3:>10.1f} {r.copy_ms * 1e3:>9.1f} "
            f"{r.fused_gbps:>8.0f} {100 * r.copy_share:>5.0f}% {r.speedup:>8.2f} {r.max_abs_err:>9.2e}")
    return "\n".join(lines)


def largest(rows: Sequence[Row]) -> list[Row]:
    """The rows (forward and backward) of the case with the most bytes."""
    top = max((r for r in rows if r.direction == "forward"), key=lambda r: r.bytes)
    return [r for r in rows if r.shape == top.shape and r.clients == top.clients]


def bench_case(rt: common.Runtime, shape, layout, clients, dtype, rank=RANK, output_mask=OUTPUT_MASK) -> list[Row]:
    """Check then time the forward and backward of one (shape, layout, K)."""
    from pfl_kernels.reference import factorized as ref

    dev = rt.device
    rows, cols = geometry(shape, layout)
    gen = torch.Generator(device=dev).manual_seed(0)
    u = torch.randn(clients, rows, rank, device=dev, generator=gen).to(dtype)
    v = torch.randn(clients, rank, cols, device=dev, generator=gen).to(dtype)
    mu = torch.randn(clients, rows, cols, device=dev, generator=gen).to(dtype)
    mask = (torch.rand(clients, rows, cols, device=dev, generator=gen) > 0.5).to(dtype)
    g = torch.randn(clients, *shape, device=dev, generator=gen).to(dtype)
    kw = {"shape": list(shape), "layout": layout}
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def fused_fwd():
        return torch.ops.pfl.factorized_weight(u, v, mu, mask, **kw)

    def fused_bwd():
        return torch.ops.pfl.factorized_weight_backward(g, u, v, mu, mask, **kw, output_mask=list(output_mask))

    def eager_fwd():
        return ref.factorized_weight(u, v, mu, mask, **kw)

    def eager_bwd():
        return ref.factorized_weight_backward(g, u, v, mu, mask, **kw, output_mask=list(output_mask))

    # 1. correctness against float64
    d = [t.double() for t in (g, u, v, mu, mask)]
    err_f = common.check(f"forward {shape} K={clients}", fused_fwd(), ref.factorized_weight(*d[1:], **kw), tol)
    want_b = ref.factorized_weight_backward(*d, **kw, output_mask=list(output_mask))
    err_b = 0.0
    for name, a, b in zip(("grad_u", "grad_v", "grad_mu", "grad_mask"), fused_bwd(), want_b):
        if b.numel():
            err_b = max(err_b, common.check(f"backward {name} {shape} K={clients}", a, b, tol))

    # 2. timings
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for direction, fused, eager, err in (("forward", fused_fwd, eager_fwd, err_f),
                                         ("backward", fused_bwd, eager_bwd, err_b)):
        nbytes = op_bytes(direction, clients, rows, cols, rank, elem, output_mask)
        fused_ms, eager_ms, copy_ms = rt.time_against_copy(fused, eager, nbytes)
        out.append(rt.annotate(Row(list(shape), layout, clients, direction, nbytes, fused_ms, eager_ms, copy_ms, err)))
    return out


def measure(rt: common.Runtime, args) -> list[Row]:
    """Forward and backward rows of every (K, shape) (``--quick``: K = 100; ``--dry-run``:
    ``DRY_RUN_GRID``)."""
    dtype = common.DTYPES[args.dtype]
    if args.dry_run:
        clients, shapes = DRY_RUN_GRID
    else:
        clients, shapes = ([100] if args.quick else CLIENTS), SHAPES
    rows = []
    for k in clients:
        for shape, layout in shapes:
            rows.extend(bench_case(rt, shape, layout, k, dtype))
            common.print_rows(rows[-2:], format_table)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="K=100 only")
    rt = common.start(args, "gpu_factorized.py", "pfl::factorized_weight")
    if rt is None:
        return 2
    with rt:
        rows = measure(rt, args)
    table = format_table(rows)
    print("\n" + table)
    top = largest(rows)
    verdicts = {r.direction: r.copy_share >= TARGET for r in top}
    summary = ", ".join(f"{r.direction} {100 * r.copy_share:.0f}% of copy bandwidth" for r in top)
    print(f"\nlargest case {'x'.join(map(str, top[0].shape))} K={top[0].clients}: {summary} "
          f"(target {100 * TARGET:.0f}%: {'met' if all(verdicts.values()) else 'MISSED'})")

    common.write_json(rt.json_path(args.json, "factorized_gpu"), "benchmarks/gpu_factorized.py", rt, {
        "config": {"dtype": args.dtype, "rank": RANK, "output_mask": list(OUTPUT_MASK),
                   "bias": "mu+mask", "timing": common.TIMING, "bytes": common.BYTES,
                   "copy_share": "copy time / fused time for the same bytes", "target": TARGET},
        "largest": {r.direction: {"copy_share": r.copy_share, "met": verdicts[r.direction]} for r in top},
        "rows": [r.to_json() for r in rows],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
