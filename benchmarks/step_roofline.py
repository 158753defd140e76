"""FLOPs and memory traffic of one training step, the floor under a GPU's time for it (on a CPU).

    python benchmarks/step_roofline.py [--model resnet9 --factorized --batch 128]
                                       [--bandwidth-tbs 3.35 --peak-tflops 495]

Runs one SGD step of the model (forward, cross-entropy, backward, the update) at the given
batch on CIFAR-shaped inputs, counting

* FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` (convolutions and matmuls);
* the bytes eager PyTorch moves: every ATen op's tensor inputs read once and its new outputs
  written once (``TrafficCounter``), views and detaches left out.  This is the traffic of the
  unfused op sequence eager mode runs on any device; cuDNN's own layout conversions come on
  top, so the floor it gives is a low one.

and prints the time each needs at the device's figures (default: an H100 SXM's HBM bandwidth
and TF32 dense peak).  A batched executor runs the same ops on K clients' tensors at once: the
same FLOPs and bytes per sample, so what it can save is the distance between the sequential
step's time and this floor.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

_NOT_TRAFFIC = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}


class TrafficCounter(TorchDispatchMode):
    """Within the mode, ``total`` is the bytes the ATen ops read and write: each op's tensor
    arguments once, and each output that is not one of its arguments (an in-place op's result
    is) once.  Ops that return views of their inputs move nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NOT_TRAFFIC or any(r.alias_info is not None and not r.alias_info.is_write
                                       for r in func._schema.returns):
            return out
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        moved = sum(a.numel() * a.element_size() for a in inputs)
        moved += sum(o.numel() * o.element_size() for o in tree_leaves(out)
                     if isinstance(o, torch.Tensor) and not any(o is a for a in inputs))
        self.total += moved
        self.by_op[str(func.overloadpacket.__name__)] += moved
        return out


def step_cost(model: torch.nn.Module, batch: int, input_shape=(3, 32, 32), classes: int = 10) -> tuple[int, int]:
    """(FLOPs, bytes moved) of one SGD step of ``model`` on a random batch (the second step: the
    first one's lazy initializations are not counted)."""
    x = torch.randn(batch, *input_shape)
    y = torch.randint(0, classes, (batch,))
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-0.01)
                p.grad = None

    step()
    traffic = TrafficCounter()
    with FlopCounterMode(display=False) as flops, traffic:
        step()
    return flops.get_total_flops(), traffic.total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet9", help="a model of pfl_algorithms.models (default resnet9)")
    parser.add_argument("--factorized", action="store_true", help="every layer factorized (pfl_kernels.nn.factorize)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--bandwidth-tbs", type=float, default=3.35, help="memory bandwidth, TB/s (H100 SXM: 3.35)")
    parser.add_argument("--peak-tflops", type=float, default=495.0, help="arithmetic peak, TFLOPS (H100 TF32: 495)")
    args = parser.parse_args(argv)
    from pfl_algorithms.models import build_model
    from pfl_kernels.nn import factorize

    torch.manual_seed(0)
    model = build_model(args.model, input_shape=(3, 32, 32), num_classes=10)
    if args.factorized:
        model = factorize(model)
    flops, moved = step_cost(model, args.batch)
    memory_ms = moved / (args.bandwidth_tbs * 1e12) * 1e3
    compute_ms = flops / (args.peak_tflops * 1e12) * 1e3
    print(f"{args.model}{' factorized' if args.factorized else ''}, batch {args.batch}: {flops / 1e9:.1f} GFLOP, "
          f"{moved / 1e9:.2f} GB moved ({flops / max(moved, 1):.0f} FLOP/byte); at {args.bandwidth_tbs:g} TB/s "
          f"{memory_ms:.2f} ms, at {args.peak_tflops:g} TFLOPS {compute_ms:.2f} ms: a step takes at least "
          f"{max(memory_ms, compute_ms):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
