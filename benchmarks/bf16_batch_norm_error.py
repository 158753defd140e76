"""How far a bfloat16 BatchNorm's gradients are from float64, per way of computing it.

A bfloat16 input with float32 weight, bias and running statistics (what autocast hands a
BatchNorm after a convolution), training mode, forward and backward.  Ways:

* ``unbatched``: one client's ``F.batch_norm`` as the sequential executor calls it (whatever
  kernel ATen picks for this device);
* ``folded``: the batched executor's fold (``folded_channels.folded_batch_norm``: one native
  mixed BatchNorm over the clients' channels);
* ``float32``: the input cast to float32 and the output back (``MixedBatchNorm``'s way).

Each row gives, over every client and channel, the largest error of the weight, bias and input
gradients against float64 on the same bfloat16 values, scaled by the sum of the magnitudes
that the gradient adds up (Σ|dy·x̂| for the weight, Σ|dy| for the bias, max |dx| for the
input): bfloat16 rounding of the terms alone keeps it near 2^-8 = 0.0039.

    python benchmarks/bf16_batch_norm_error.py [--device cuda]

Writes ``benchmarks/results/bf16_batch_norm_<device>.json``.  On an H200 (torch 2.11) the
native mixed kernel, unbatched and folded alike, had weight and bias gradients off by up to
1.2e-3 of that scale (3% of the gradient's value where its terms cancel; pytorch#156513 reports
that kernel); float32 was within 3e-8, as every way is on a CPU.  The fold keeps the native
kernel, so the batched executor computes what the sequential one does.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pfl_algorithms.engine import folded_channels  # noqa: E402

SHAPES = {"test [3 x 7, 5, 3, 4]": (3, 7, 5, 3, 4), "resnet9 layer [8 x 64, 128, 16, 16]": (8, 64, 128, 16, 16)}


def _inputs(shape, device):
    clients, n, c = shape[:3]
    g = torch.Generator().manual_seed(5)
    weight = 1 + 0.3 * torch.randn(clients, c, generator=g)
    bias = torch.randn(clients, c, generator=g)
    x = (3 * torch.randn(*shape, generator=g) + 2).to(torch.bfloat16)
    dy = torch.randn(*shape, generator=g).to(torch.bfloat16)
    return [t.to(device) for t in (weight, bias, x, dy)]


def _grads(way, weight, bias, x, dy):
    """Weight, bias and input gradients of every client in float64, the way ``way`` computes them."""
    w, b, xs = (t.clone().requires_grad_() for t in (weight, bias, x))
    clients, c = weight.shape
    if way in ("unbatched", "float32"):
        outs = []
        for k in range(clients):
            xk = xs[k].float() if way == "float32" else xs[k]
            out = F.batch_norm(xk, torch.zeros(c, device=x.device), torch.ones(c, device=x.device), w[k], b[k], True)
            outs.append(out.to(x.dtype))
        out = torch.stack(outs)
    else:
        bn = nn.BatchNorm2d(c).to(x.device)
        stats = {"running_mean": torch.zeros(clients, c, device=x.device),
                 "running_var": torch.ones(clients, c, device=x.device),
                 "num_batches_tracked": torch.zeros(clients, dtype=torch.int64, device=x.device)}
        with folded_channels.FoldedChannels():
            out = vmap(lambda p, s, xi: functional_call(bn, {**p, **s}, (xi,)))({"weight": w, "bias": b}, stats, xs)
    out.backward(dy)
    return w.grad.double(), b.grad.double(), xs.grad.double()


def _reference(weight, bias, x, dy):
    """The float64 gradients (weight, bias, input) and what each sums (module docstring): one
    computation per shape, which every way is compared with."""
    w, b, xs = (t.double().requires_grad_() for t in (weight, bias, x))
    dims = (1, 3, 4)
    mean = xs.mean(dims, keepdim=True)
    var = xs.var(dims, unbiased=False, keepdim=True)
    x_hat = (xs - mean) / torch.sqrt(var + 1e-5)
    out = x_hat * w[:, None, :, None, None] + b[:, None, :, None, None]
    out.backward(dy.double())
    scales = ((dy.double() * x_hat.detach()).abs().sum(dims), dy.double().abs().sum(dims), xs.grad.abs().amax())
    return (w.grad, b.grad, xs.grad), scales


def _errors(reference, got):
    """Each gradient's largest error against float64, scaled by what it sums (module docstring)."""
    (want_w, want_b, want_x), (scale_w, scale_b, scale_x) = reference
    return {"weight": float(((got[0] - want_w).abs() / scale_w).max()),
            "bias": float(((got[1] - want_b).abs() / scale_b).max()),
            "input": float((got[2] - want_x).abs().max() / scale_x)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="where the rows go (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    print(f"{'shape':38s} {'way':14s} {'weight':>9s} {'bias':>9s} {'input':>9s}")
    for name, shape in SHAPES.items():
        inputs = _inputs(shape, device)
        reference = _reference(*inputs)
        for way in ("unbatched", "folded", "float32"):
            errors = _errors(reference, _grads(way, *inputs))
            rows.append({"shape": name, "way": way, **errors})
            print(f"{name:38s} {way:14s} {errors['weight']:9.2e} {errors['bias']:9.2e} {errors['input']:9.2e}")
    slug = (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu").lower().replace(" ", "_")
    path = args.json or Path(__file__).resolve().parent / "results" / f"bf16_batch_norm_{slug}.json"
    path.write_text(json.dumps({"device": slug, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
