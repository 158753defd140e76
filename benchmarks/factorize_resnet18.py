"""Wall and CPU time of ``factorize`` on ResNet-18, against the conversion it replaced.

ResNet-18 is written out here with torchvision's layer shapes and initialisation (11,689,512
parameters: conv1 64x3x7x7, four stages of two BasicBlocks with 64/128/256/512 channels and
1x1 downsampling convs, fc 512->1000; convs Kaiming-normal fan_out, BatchNorm 1/0), so the
script needs only torch.  Two sides convert fresh deep copies of one such model, all 21
Conv2d/Linear layers (rank 1, layout 'spatial'), in one process under the same thread settings:

* ours: ``pfl_kernels.nn.factorize``: the top singular vectors from the Gram matrix of each
  layer's (R, C) matrix (9 x 262,144 for a 512->512 conv), on one intra-op thread;
* svd: the conversion before: a full ``torch.linalg.svd`` of each matrix, on the caller's
  intra-op threads (the same code with those two parts swapped back).

After one untimed call of each side (first-call costs: MKL's code paths, thread pools), the
sides alternate, the first of each pair alternating too, ``--repeats`` times; printed: each
side's median wall (``time.perf_counter``) and CPU (``time.process_time``, all threads) time
and the ratio of the wall medians.  Target: ours under 2 s of wall time on 2 cores.  It also
prints what ``sparsity_loss`` is after the README's ``factorize(model, exclude=["fc"])``, with
both reductions (the figures the README's λ guidance quotes).

    python benchmarks/factorize_resnet18.py [--repeats 5] [--threads N] [--json PATH]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from pfl_kernels.nn import factorize, factorized_layers, sparsity_loss  # noqa: E402
from pfl_kernels.nn import factorized as factorized_module  # noqa: E402

TARGET_S = 2.0


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs with BatchNorm, a 1x1 conv shortcut where the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18(): the same parameters, under the same names, initialised the same way."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_channels = [], 64
        for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(in_channels, channels, stride), BasicBlock(channels, channels, 1)))
            in_channels = channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def svd_rank_factors(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors as ``from_dense`` computed them before: from a full SVD of ``m``."""
    left, sing, right = torch.linalg.svd(m, full_matrices=False)
    r = min(rank, sing.numel())
    root = sing[:r].sqrt()
    u = m.new_zeros(m.shape[0], rank)
    v = m.new_zeros(rank, m.shape[1])
    u[:, :r] = left[:, :r] * root
    v[:r] = root[:, None] * right[:r]
    return u, v


def svd_factorize(model: nn.Module) -> nn.Module:
    """``factorize(model)`` with the SVD factors, on the caller's threads: the conversion before."""
    with mock.patch.object(factorized_module, "best_rank_factors", svd_rank_factors), \
            mock.patch.object(factorized_module, "_one_thread_on_cpu", lambda device: nullcontext()):
        return factorize(model)


SIDES = {"ours": factorize, "svd": svd_factorize}


def timed(convert, model: nn.Module) -> tuple[float, float]:
    """(wall, CPU) seconds of ``convert(model)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    convert(model)
    return time.perf_counter() - wall, time.process_time() - cpu


def sparsity_figures(model: nn.Module) -> dict:
    """``sparsity_loss`` after the README's ``factorize(model, exclude=["fc"])``, both reductions."""
    model = factorize(copy.deepcopy(model), exclude=["fc"])
    entries = sum(layer.mu.numel() for layer in factorized_layers(model))
    return {"call": 'factorize(model, exclude=["fc"])', "mu_entries": entries,
            "sum": sparsity_loss(model).item(), "mean": sparsity_loss(model, reduction="mean").item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first (default: torch's)")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "factorize_resnet18_cpu.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    # The machine may be shared: its load, before and after, says how busy it was.
    load_before = os.getloadavg()
    torch.manual_seed(0)
    model = ResNet18()
    print(f"ResNet-18: {sum(p.numel() for p in model.parameters()):,} parameters; {threads} intra-op threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}", flush=True)
    for convert in SIDES.values():  # warm-up, untimed
        convert(copy.deepcopy(model))
    times = {side: {"wall_s": [], "cpu_s": []} for side in SIDES}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(reversed(SIDES))
        for side in order:
            wall, cpu = timed(SIDES[side], copy.deepcopy(model))
            times[side]["wall_s"].append(wall)
            times[side]["cpu_s"].append(cpu)
            print(f"repeat {repeat} {side}: wall {wall:.2f} s, CPU {cpu:.2f} s", flush=True)
    medians = {side: {key: statistics.median(values) for key, values in t.items()} for side, t in times.items()}
    ratio = medians["svd"]["wall_s"] / medians["ours"]["wall_s"]
    met = medians["ours"]["wall_s"] < TARGET_S
    print(f"\nfactorize(resnet18), median of {args.repeats}: ours wall {medians['ours']['wall_s']:.2f} s "
          f"(CPU {medians['ours']['cpu_s']:.2f} s), svd wall {medians['svd']['wall_s']:.2f} s "
          f"(CPU {medians['svd']['cpu_s']:.2f} s); svd/ours {ratio:.1f}x; target ours < {TARGET_S:.0f} s: "
          f"{'met' if met else 'missed'}")
    sparsity = sparsity_figures(model)
    print(f"sparsity_loss after {sparsity['call']}: sum {sparsity['sum']:,.0f}, mean {sparsity['mean']:.4g} "
          f"over {sparsity['mu_entries']:,} mu entries (0 at the papers' init: mu zeros)")
    result = {"times": times, "median": medians, "ratio_svd_over_ours_wall": ratio, "target_s": TARGET_S,
              "met": met, "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "torch_version": torch.__version__, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "sparsity_loss": sparsity}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"Saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
