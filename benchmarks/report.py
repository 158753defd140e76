"""Run the CPU benchmark suites of pfl-kernels and print their ratios.

    python benchmarks/report.py [--quick] [--suite NAME|all] [--json PATH]
                                [--benchmark-json PATH]

Runs each suite (``benchmarks/bench_<suite>.py``, default: all of them, one after the
other) under pytest-benchmark in a child process (with OMP_WAIT_POLICY=PASSIVE, so idle
OpenMP threads do not spin on the 2 cores the measurements share; the round suites leave
OpenMP's default, at which their multi-threaded baseline loops are fastest: ``Suite``), groups each measurement
with its baseline and prints one table per suite: per case and shape, the medians, their
ratio and whether the target is met.

* factorized suite (``bench_factorized.py``):
  reconstruct forward / backward: ratio = eager time / fused time (speed-up), target >= 2.0;
  layer fwd+bwd: ratio = factorized layer time / dense layer time (cost), target <= 1.10.
* branch suite (``bench_branch.py``, B in {2, 5, 10} for the ops, B = 5 for the layers):
  combine forward / backward: ratio = eager / fused (speed-up) and ours/floor = fused time /
  the time of a copy moving the op's minimum traffic (lower is better, 1 = copy speed);
  layer fwd+bwd: ratio = multi-branch layer time / dense layer time (cost).  The issue's
  targets hold at B = 5 and resnet9-conv256-256k3 only (ops: <= 1.5 x floor and >= 1.0
  speed-up; layer: <= 1.15); other rows have none ("-").

Each table is also saved as JSON (default ``benchmarks/results/<suite>_cpu.json``, or
``<suite>_cpu_quick.json`` with --quick, which git ignores) with the machine and the
implementations that were active (``pfl_kernels.backend_info()`` of the measuring
process).  --json / --benchmark-json name the file of a single suite; with several suites
the suite's name is added to the file name.  A missed target is reported, not an error:
the exit status is 0 unless the benchmarks themselves fail.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Case:
    """How the sides of a case are compared.

    Every case compares 'ours' with 'baseline' (``ratio``); a case whose suite also measures
    a 'floor' side adds ours / floor (lower is better) with its own target.
    """

    title: str
    speedup: bool  # ratio = baseline / ours (higher is better); else ours / baseline (lower is better)
    target: Optional[float]
    floor_target: Optional[float] = None  # ours / floor <= this
    # The targets hold only for the rows whose extra_info has these values (None: every row).
    target_at: Optional[dict] = None

    @property
    def ratio_definition(self) -> str:
        return "baseline / ours (speed-up)" if self.speedup else "ours / baseline (cost)"

    def ratio(self, ours_s: float, baseline_s: float) -> float:
        return baseline_s / ours_s if self.speedup else ours_s / baseline_s

    def applies(self, info: dict) -> bool:
        return self.target_at is None or all(info.get(k) == v for k, v in self.target_at.items())

    def ratio_target(self, info: dict) -> Optional[dict]:
        if self.target is None or not self.applies(info):
            return None
        return {"op": ">=" if self.speedup else "<=", "value": self.target}

    def floor_ratio_target(self, info: dict) -> Optional[dict]:
        if self.floor_target is None or not self.applies(info):
            return None
        return {"op": "<=", "value": self.floor_target}


def _met(ratio: Optional[float], target: Optional[dict]) -> Optional[bool]:
    if ratio is None or target is None:
        return None
    return ratio >= target["value"] if target["op"] == ">=" else ratio <= target["value"]


def _target_text(target: Optional[dict]) -> str:
    return "-" if target is None else f"{target['op']} {target['value']:.2f}"


# The targets of the branch suite's issue: the ops at B = 5 and the 256->256 k3 shape; the
# layer (measured at B = 5) for MultiBranchConv2d against nn.Conv2d.
_BRANCH_TARGET_AT = {"shape": "resnet9-conv256-256k3", "branches": 5}
_BRANCH_LAYER_TARGET_AT = {"layer": "conv"}
# The layer target of the factorized suite's issue is for FactorizedConv2d (32x32 inputs);
# the linear layers' ratios are reported without one.
_FACTORIZED_LAYER_TARGET_AT = {"layout": "spatial"}


@dataclass(frozen=True)
class Suite:
    """A benchmark file and how to read its results."""

    name: str
    cases: dict  # the ``case`` names of the benchmark file -> Case, in the order of the table
    ops: tuple  # substrings of the ops behind 'fused': their CPU backend is checked for the note
    reference_note: str  # printed when those ops ran the plain-PyTorch reference
    legend: str
    # OMP_WAIT_POLICY of the child: PASSIVE keeps idle OpenMP threads from spinning against
    # the measured ones; None leaves OpenMP's default.  The round suites use the default: there
    # the baseline is a loop on several intra-op threads, which PASSIVE slows about 2x (every
    # small op wakes sleeping threads; the pFedMB loop took 1.42 s a round under PASSIVE, 0.78 s
    # without), while our single-threaded client tasks do not change.
    wait_policy: Optional[str] = "PASSIVE"

    @property
    def bench_file(self) -> str:
        return f"benchmarks/bench_{self.name}.py"

    @property
    def default_json(self) -> Path:
        return RESULTS / f"{self.name}_cpu.json"

    @property
    def quick_json(self) -> Path:
        # Quick runs (the demo) go elsewhere, untracked, so they never overwrite a recorded full run.
        return RESULTS / f"{self.name}_cpu_quick.json"


_TIMES_LEGEND = ("Times are medians over rounds (and over repeats, when measured more than once); iqr ="
                 " the largest interquartile range of the pair's measurements, relative to its median.")

SUITES = {
    "factorized": Suite(
        name="factorized",
        cases={
            "reconstruct_forward": Case("reconstruct fwd", speedup=True, target=2.0),
            "reconstruct_backward": Case("reconstruct bwd", speedup=True, target=2.0),
            "layer_train_step": Case("layer fwd+bwd", speedup=False, target=1.10,
                                     target_at=_FACTORIZED_LAYER_TARGET_AT),
        },
        ops=("factorized_weight",),
        reference_note=("NOTE: the factorized ops ran the plain-PyTorch reference on CPU, so the fused "
                        "side is the eager code behind a custom op: expect reconstruct ratios near 1."),
        legend=("ours / baseline: fused / eager for the reconstruction ops, factorized / dense for "
                "the layers (batch 32, 32x32 inputs, rank 1).\nratio: eager/fused (speed-up, higher "
                "is better) for reconstruct, factorized/dense (cost, lower is better) for layers.\n"
                "The layer target is for FactorizedConv2d; the linear layers are reported without one.\n"
                + _TIMES_LEGEND),
    ),
    "branch": Suite(
        name="branch",
        cases={
            "combine_forward": Case("combine fwd", speedup=True, target=1.0, floor_target=1.5,
                                    target_at=_BRANCH_TARGET_AT),
            "combine_backward": Case("combine bwd", speedup=True, target=1.0, floor_target=1.5,
                                     target_at=_BRANCH_TARGET_AT),
            "layer_train_step": Case("layer fwd+bwd", speedup=False, target=1.15,
                                     target_at=_BRANCH_LAYER_TARGET_AT),
        },
        ops=("branch_combine",),
        reference_note=("NOTE: the branch ops ran the plain-PyTorch reference on CPU, so the fused "
                        "side is the eager code behind a custom op: expect combine ratios near 1."),
        legend=("ours / baseline: fused / eager (torch.einsum, and its autograd for bwd) for the combine "
                "ops, multibranch / dense for the layers (B = 5, batch 32, 32x32 inputs, no bias).\n"
                "ratio: eager/fused (speed-up, higher is better) for combine, multibranch/dense (cost, "
                "lower is better) for layers.\n"
                "floor: dst.copy_(src), preallocated, moving the op's minimum traffic (fwd (B+1)*N + B, "
                "bwd (2B+1)*N + 2B float32); ours/floor: fused / floor (lower is better, 1 = copy speed).\n"
                "At the small LeNet-5 shapes a copy takes a few us: ours/floor there mostly measures the "
                "op's fixed cost per call, not its traffic.\n"
                "Targets: the ops at B = 5 and resnet9-conv256-256k3, the conv layers ('-': none); "
                "met: all targets of the row.\n"
                + _TIMES_LEGEND),
    ),
    "branch_aggregate": Suite(
        name="branch_aggregate",
        cases={"aggregate": Case("aggregate", speedup=True, target=None, floor_target=1.5),
               "aggregate-bf16": Case("aggregate bf16", speedup=True, target=None, floor_target=1.5)},
        ops=("branch_aggregate",),
        reference_note=("NOTE: branch_aggregate ran the plain-PyTorch reference on CPU, so the fused side "
                        "is eager code behind a custom op."),
        legend=("ours / baseline: fused pfl::branch_aggregate.out (into a preallocated W, as the floor's "
                "dst) / eager normalized weights + torch.einsum('kb,kbp->bp') (BLAS), which allocates its "
                "result as research code does.\nratio: eager/fused (speed-up, higher is better).\n"
                "floor: dst.copy_(src), preallocated, moving the op's minimum traffic (K*B*P + B*P + "
                "2*K*B + K float32); ours/floor: fused / floor (lower is better). Target: <= 1.5 x floor "
                "on every row.\nShape: K clients, B branches, P parameters per branch (float32).\n"
                "aggregate bf16: bfloat16 params and W (float32 accumulation); baseline: the einsum on params "
                "upcast to float32; floor: the copy of the op's bytes (2 per param).\n"
                + _TIMES_LEGEND),
    ),
    "class_means": Suite(
        name="class_means",
        cases={"class_means": Case("class means", speedup=True, target=None, floor_target=1.5),
               "class_means-bf16": Case("class means bf16", speedup=True, target=None, floor_target=1.5)},
        ops=("class_means",),
        reference_note=("NOTE: class_means ran the plain-PyTorch reference on CPU, so the fused side is "
                        "eager code behind a custom op."),
        legend=("ours / baseline: fused pfl::class_means / eager index_add_ + bincount + divide.\n"
                "ratio: eager/fused (speed-up, higher is better).\nfloor: dst.copy_(src) of N*D float32 "
                "(a copy of the features, preallocated); ours/floor: fused / floor (lower is better). "
                "Target: <= 1.5 x floor on every row.\nShape: N samples, D dims, C classes.\n"
                "class means bf16: bfloat16 features (float32 sums and means); baseline: the same on features "
                "upcast to float32; floor: the copy of the bfloat16 features.\n"
                + _TIMES_LEGEND),
    ),
    "similarity": Suite(
        name="similarity",
        cases={
            "cosine": Case("pairwise cosine", speedup=True, target=None, floor_target=1.5),
            "sqdist": Case("pairwise sqdist", speedup=True, target=None, floor_target=1.5),
            "weights": Case("similarity weights", speedup=True, target=None),
            "cosine-bf16": Case("pairwise cosine bf16", speedup=True, target=None),
        },
        ops=("pairwise_cosine", "pairwise_sqdist", "similarity_weights"),
        reference_note=("NOTE: the similarity ops ran the plain-PyTorch reference on CPU, so the fused side "
                        "is eager code behind a custom op."),
        legend=("ours / baseline: fused pfl::pairwise_cosine / F.normalize + mm; fused pfl::pairwise_sqdist / "
                "torch.cdist(x, x)**2; fused pfl::similarity_weights / eager topk + masks + softmax "
                "(tau 0.9, scale 20, min_keep 4).\nratio: baseline/fused (speed-up, higher is better).\n"
                "floor: torch.mm(x, x.t()) on the same [K, D] x (the product the op is bound by); ours/floor: "
                "fused / mm (lower is better). Target: <= 1.5 x floor on every cosine and sqdist row.\n"
                "Shape: K clients, D parameters (float32); weights: sim [K, K]. Inputs of 4 GB or more are "
                "skipped.\npairwise cosine bf16: bfloat16 x (float32 accumulation and result); baseline: F.normalize "
                "on x upcast to float32 + mm; floor: torch.mm in bfloat16 (result rounded to bfloat16, less "
                "precise; no target).\n" + _TIMES_LEGEND),
    ),
    "aggregate": Suite(
        name="aggregate",
        cases={"dense": Case("dense weights", speedup=False, target=1.1),
               "sparse": Case("5% nonzero weights", speedup=True, target=5.0),
               "dense-bf16": Case("dense, bf16 params", speedup=True, target=None)},
        ops=("weighted_average",),
        reference_note="NOTE: weighted_average ran the plain-PyTorch reference on CPU.",
        legend=("ours: pfl::weighted_average(w, params, out=out); baseline: torch.mm(w, params, out=out), "
                "same shapes, float32 (the BLAS product the op replaces, and the floor of a dense product).\n"
                "ratio: ours / torch.mm for dense weights (cost, lower is better, target <= 1.1); torch.mm / "
                "ours for 5%-nonzero weights (speed-up, target >= 5 at K=1000, P=1e5).\n"
                "Shape: K=M clients, P params per client.\n"
                "dense, bf16 params: bfloat16 params and out, float32 weights; baseline: torch.mm on params upcast "
                "to float32 (the eager code with float32 accumulation); floor: torch.mm in bfloat16 (bf16 weights "
                "and output, less precise; no target). ratio: baseline / ours.\n" + _TIMES_LEGEND),
    ),
    "round_end": Suite(
        name="round_end",
        cases={"round_end": Case("round end", speedup=True, target=10.0, target_at={"clients": 1000})},
        ops=("pairwise_cosine", "similarity_weights", "weighted_average"),
        reference_note="NOTE: the similarity/aggregation ops ran the plain-PyTorch reference on CPU.",
        legend=("ours: pairwise_cosine -> similarity_weights -> weighted_average over banks; baseline: the "
                "released Factorized-FL server's loops over clients, kept clients and state-dict keys (in "
                "torch).\nratio: baseline / ours (speed-up). Target >= 10 at K=1000, P=1e5, D=65536, 5% kept.\n"
                + _TIMES_LEGEND),
    ),
    "fedavg_round": Suite(
        name="fedavg_round",
        cases={"fedavg_round": Case("fedavg round", speedup=True, target=1.5)},
        ops=("weighted_average",),
        reference_note="NOTE: weighted_average ran the plain-PyTorch reference on CPU.",
        legend=("ours: one FedAvg round of pfl_algorithms' engine (banks, flat working model, flat SGD, "
                "clients trained concurrently, weighted_average); baseline: benchmarks/plain_fedavg_loop.py "
                "(deepcopy per client, DataLoader, torch.optim.SGD, state_dict averaging).\n"
                "Job: 20 clients x 250 CIFAR-shaped samples, LeNet-5, batch 64, 1 epoch, SGD lr 0.01.\n"
                "ratio: baseline / ours (speed-up). Target >= 1.5. The whole 10-round command against the "
                "plain script: benchmarks/fedavg_command.py.\n" + _TIMES_LEGEND),
        wait_policy=None,
    ),
    "executor": Suite(
        name="executor",
        cases={"executor_round": Case("executor round", speedup=True, target=None)},
        ops=("factorized_weight",),
        reference_note="NOTE: the factorized ops ran the plain-PyTorch reference on CPU.",
        legend=("ours: --executor batched (20 clients in one vmapped forward/backward per step); baseline: "
                "--executor threaded (one client per core, one intra-op thread each). One FedAvg round of local "
                "training, no evaluation, SGD lr 0.01, 20 clients.\nratio: threaded / batched time (speed-up of "
                "batched; below 1 threaded is faster). No target: --executor auto picks batched on a CPU only for "
                "models of at most engine.executors.AUTO_CPU_MAX_PARAMETERS parameters, from these numbers.\n"
                + _TIMES_LEGEND),
        wait_policy=None,
    ),
    "factorized_fl_round": Suite(
        name="factorized_fl_round",
        cases={"factorized_fl_round": Case("factorized-fl beta round", speedup=True, target=2.0)},
        ops=("factorized_weight", "pairwise_cosine", "similarity_weights", "weighted_average"),
        reference_note="NOTE: the factorized and server ops ran the plain-PyTorch reference on CPU.",
        legend=("ours: one factorized-fl-beta round of pfl_algorithms' engine (fused factorized layers, banks, "
                "matching and aggregation by pairwise_cosine -> similarity_weights -> weighted_average); "
                "baseline: benchmarks/plain_factorized_fl_loop.py, the released loop (deepcopy per client, eager "
                "weight reconstruction, DataLoader, per-client matching and per-key state_dict averaging).\n"
                "Job: 20 clients x 250 CIFAR-shaped samples, LeNet-5 factorized (rank 1, view layout), batch 64, "
                "1 epoch, SGD lr 0.01.\nratio: baseline / ours (speed-up). Target >= 2.\n" + _TIMES_LEGEND),
        wait_policy=None,
    ),
    "pfedmb_round": Suite(
        name="pfedmb_round",
        cases={"pfedmb_round": Case("pfedmb round", speedup=True, target=1.5),
               "pfedmb_round_loop_1thread": Case("pfedmb round, loop on 1 thread", speedup=True, target=None)},
        ops=("branch_combine", "branch_aggregate"),
        reference_note="NOTE: the branch ops ran the plain-PyTorch reference on CPU.",
        legend=("ours: one pfedmb round of pfl_algorithms' engine (fused branch_combine in every layer, banks, the "
                "alpha and branch phases as a plan, clients trained concurrently, one branch_aggregate per alpha); "
                "baseline: benchmarks/plain_pfedmb_loop.py (deepcopy per client, a Python loop over the branches "
                "in every layer at every forward, DataLoader, two torch.optim.SGD, per-key, per-branch and "
                "per-client loops for Eq. 5).\n"
                "Job: 15 clients x 250 CIFAR-shaped samples, LeNet-5 with every layer multi-branch (B = 5, "
                "softmax alpha), batch 64, 1 epoch on alpha (lr 0.01) then 1 on the branches (lr 0.05), Eq. 5; "
                "both sides on all cores (the loop: torch.set_num_threads(cores); ours: one client per core).\n"
                "ratio: baseline / ours (speed-up). Target >= 1.5.\n"
                "pfedmb round, loop on 1 thread: the same with the loop on one intra-op thread (ours unchanged), "
                "for information, no target (the loop's faster setting under OMP_WAIT_POLICY=PASSIVE; with the "
                "default policy this suite runs under, 2 threads are faster).\n" + _TIMES_LEGEND),
        wait_policy=None,
    ),
    "pool": Suite(
        name="pool",
        cases={"relu_max_pool": Case("relu + max pool", speedup=True, target=None)},
        ops=("relu_max_pool2d",),
        reference_note=("NOTE: relu_max_pool2d ran the plain-PyTorch reference on CPU, so the fused side is "
                        "eager code behind a custom op."),
        legend=("ours / baseline: pfl_kernels.ops.relu_max_pool2d / F.max_pool2d(F.relu(x), 2); forward and "
                "backward of a batch of 64 channels-last float32 maps (N x C x H x W).\n"
                "ratio: baseline / ours (speed-up). No target.\n" + _TIMES_LEGEND),
    ),
    "augment": Suite(
        name="augment",
        cases={"crop_flip": Case("crop + flip", speedup=True, target=None),
               "factorized_fl": Case("factorized-fl", speedup=True, target=None)},
        ops=(),
        reference_note="",
        legend=("ours: pfl_algorithms.data.augment.make_augmentation(spec)(x, generator) on the normalized batch "
                "(per-sample parameters drawn on the CPU, batched tensor ops); baseline: the same transforms one image "
                "at a time in a Python loop, as a torchvision-style DataLoader transform (per-sample draws, the same "
                "tensor ops, Normalize, torch.stack).\n"
                "Batch 256 of 3x32x32 float32 (16 with --quick). crop_flip: RandomCrop(32, padding=4) + "
                "RandomHorizontalFlip(); factorized_fl: RandomResizedCrop(32), RandomHorizontalFlip(), "
                "RandomApply([ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), RandomGrayscale(0.2).\n"
                "ratio: baseline / ours (speed-up). No target.\n" + _TIMES_LEGEND),
    ),
}


def run_benchmarks(suite: Suite, raw_json: Path, quick: bool, storage: Path) -> int:
    """Run the suite's benchmark file in a child pytest, writing pytest-benchmark's JSON to ``raw_json``.

    ``storage`` is a scratch folder for pytest-benchmark's run storage (nothing is saved
    there, but the plugin creates it, by default as .benchmarks/ in the repository).
    """
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if suite.wait_policy is not None:
        env["OMP_WAIT_POLICY"] = suite.wait_policy
    env.pop("PFL_BENCH_QUICK", None)
    if quick:
        env["PFL_BENCH_QUICK"] = "1"
    cmd = [sys.executable, "-m", "pytest", suite.bench_file, "-q", "-p", "no:cacheprovider",
           "--benchmark-enable", "--benchmark-quiet", f"--benchmark-json={raw_json}",
           f"--benchmark-storage=file://{storage}"]
    policy = f"OMP_WAIT_POLICY={suite.wait_policy} " if suite.wait_policy else "(OMP_WAIT_POLICY unset) "
    print(f"$ {'PFL_BENCH_QUICK=1 ' if quick else ''}{policy}{' '.join(cmd[2:-2])}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _side(measurements: list[dict]) -> dict:
    """One side of a pair over its repeats: median of the per-repeat medians, worst spread."""
    stats = [m["stats"] for m in measurements]
    return {"impl": measurements[0]["extra_info"]["impl"],
            "median_s": _median([st["median"] for st in stats]),
            "medians_s": [st["median"] for st in stats],
            "max_rel_iqr": max(st["iqr"] / st["median"] for st in stats),
            "rounds": [st["rounds"] for st in stats],
            "iterations": [st["iterations"] for st in stats]}


def build_rows(raw: dict, cases: dict) -> list[dict]:
    """Group the sides ('ours', 'baseline' and maybe 'floor') of each (case, shape, B), in the suite's order.

    A side measured several times (repeats, spread over the run) counts the median of its
    per-repeat medians, so a burst of load from elsewhere that spoiled one repeat is
    outvoted; a ratio is that of the two sides' medians.  The per-repeat ratios (each of
    two measurements taken back to back) are kept to show how stable the ratio is.
    """
    found: dict[tuple, dict] = {}
    for bench in raw["benchmarks"]:
        info = bench["extra_info"]
        if info.get("case") not in cases:
            continue
        key = (info["case"], info["shape"], info.get("branches"))
        entry = found.setdefault(key, {"info": info, "repeats": {}})
        entry["repeats"].setdefault(info.get("repeat", 0), {})[info["side"]] = bench
    rows = []
    # The table's order: by case as in ``cases``, then by shape (and B) as the suite ran them.
    for (name, shape, branches), entry in sorted(found.items(), key=lambda kv: list(cases).index(kv[0][0])):
        case, info = cases[name], entry["info"]
        repeats = [r for _, r in sorted(entry["repeats"].items())]
        row = {"case": name, "shape": shape, "weight_shape": info["weight_shape"]}
        for key in ("layout", "branches", "traffic_bytes"):
            if key in info:
                row[key] = info[key]
        for side in ("ours", "baseline", "floor"):
            if any(side in r for r in repeats):
                row[side] = _side([r[side] for r in repeats if side in r])

        def ratio(num: str, den: str, fn) -> tuple[Optional[float], list[float]]:
            total = (fn(row[num]["median_s"], row[den]["median_s"]) if num in row and den in row else None)
            per_repeat = [fn(r[num]["stats"]["median"], r[den]["stats"]["median"])
                          for r in repeats if num in r and den in r]
            return total, per_repeat

        value, per_repeat = ratio("ours", "baseline", case.ratio)
        target = case.ratio_target(info)
        row.update(ratio=value, ratios_per_repeat=per_repeat, ratio_definition=case.ratio_definition,
                   target=target, met=_met(value, target))
        if "floor" in row or case.floor_target is not None:
            value, per_repeat = ratio("ours", "floor", lambda ours, floor: ours / floor)
            target = case.floor_ratio_target(info)
            row.update(floor_ratio=value, floor_ratios_per_repeat=per_repeat,
                       floor_ratio_definition="ours / floor (cost against the copy of the same bytes)",
                       floor_target=target, floor_met=_met(value, target))
        rows.append(row)
    return rows


def _targets(row: dict) -> list[Optional[bool]]:
    """Whether each target stated for the row is met (None: not measured)."""
    return [row[met] for target, met in (("target", "met"), ("floor_target", "floor_met"))
            if row.get(target) is not None]


def _row_met(row: dict) -> str:
    targets = _targets(row)
    if not targets:
        return "-"
    if False in targets:
        return "NO"
    return "n/a" if None in targets else "yes"


def _fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def _fmt_ratio(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _spread(row: dict) -> str:
    """The largest relative IQR of the row's sides: how far its ratios can be trusted."""
    sides = [row[s] for s in ("ours", "baseline", "floor") if s in row]
    return f"{max(s['max_rel_iqr'] for s in sides):.0%}" if sides else "n/a"


def format_table(rows: list[dict], cases: dict) -> str:
    """One line per row; the B and floor columns only where some row has them."""
    repeated = any(len(row["ratios_per_repeat"]) > 1 for row in rows)
    with_b = any("branches" in row for row in rows)
    with_floor = any("floor_ratio" in row for row in rows)
    header = (("case", "shape", "weight") + (("B",) if with_b else ())
              + ("ours", "median", "baseline", "median", "ratio", "target")
              + (("floor", "ours/floor", "target") if with_floor else ()) + ("met", "iqr")
              + (("per repeat",) if repeated else ())
              + (("ours/floor per repeat",) if repeated and with_floor else ()))
    lines = []
    for row in rows:
        ours, base = row.get("ours", {}), row.get("baseline", {})
        cells = (cases[row["case"]].title, row["shape"], "x".join(map(str, row["weight_shape"])))
        if with_b:
            cells += (str(row.get("branches", "")),)
        cells += (ours.get("impl", "?"), _fmt_time(ours.get("median_s")),
                  base.get("impl", "?"), _fmt_time(base.get("median_s")),
                  _fmt_ratio(row["ratio"]), _target_text(row["target"]))
        if with_floor:
            cells += (("", "", "") if "floor_ratio" not in row else
                      (_fmt_time(row.get("floor", {}).get("median_s")), _fmt_ratio(row["floor_ratio"]),
                       _target_text(row["floor_target"])))
        cells += (_row_met(row), _spread(row))
        if repeated:
            cells += (" ".join(f"{r:.2f}" for r in row["ratios_per_repeat"]),)
            if with_floor:
                cells += (" ".join(f"{r:.2f}" for r in row.get("floor_ratios_per_repeat", [])),)
        lines.append(cells)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *lines]]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_backends(backend_info: dict) -> str:
    """The CPU rows of ``backend_info()``: which implementation each op ran with."""
    lines = []
    for op, devices in backend_info.items():
        entry = devices.get("cpu", {})
        reason = f"  ({entry['reason']})" if entry.get("reason") else ""
        lines.append(f"  {op:<34} {entry.get('implementation', '?')}{reason}")
    return "\n".join(lines)


def machine_summary(raw: dict) -> dict:
    """The machine and setup of the measuring process (from pytest-benchmark's JSON)."""
    info = raw["machine_info"]
    pfl = info.get("pfl", {})
    return {
        "mode": "quick" if pfl.get("quick") else "full",
        "date": raw.get("datetime"),
        "platform": platform.platform(),
        "cpu": info.get("cpu", {}).get("brand_raw", info.get("processor", "")),
        "cpu_count": pfl.get("cpu_count"),
        "cpu_capability": pfl.get("cpu_capability", ""),
        "torch_version": pfl.get("torch_version"),
        "torch_num_threads": pfl.get("torch_num_threads"),
        "omp_wait_policy": pfl.get("omp_wait_policy"),
        "python_version": info.get("python_version"),
        "pytest_benchmark_version": raw.get("version"),
        "backend_info": pfl.get("backend_info", {}),
    }


def count_targets(rows: list[dict]) -> tuple[int, int, int]:
    """(met, stated, not measured) over every target of every row."""
    targets = [t for row in rows for t in _targets(row)]
    return sum(t is True for t in targets), len(targets), sum(t is None for t in targets)


def print_report(suite: Suite, machine: dict, rows: list[dict]) -> None:
    print()
    print(f"pfl-kernels CPU benchmarks ({machine['mode']} mode), {machine['date']}")
    print(f"torch {machine['torch_version']}, {machine['torch_num_threads']} threads, "
          f"{machine['cpu_count']} CPUs ({machine['cpu']}, {machine['cpu_capability'] or '?'}), {machine['platform']}, "
          f"OMP_WAIT_POLICY={machine['omp_wait_policy']}")
    print("\nImplementations on CPU (pfl_kernels.backend_info() in the measuring process):")
    print(format_backends(machine["backend_info"]))
    if any(d.get("cpu", {}).get("implementation") == "reference"
           for op, d in machine["backend_info"].items() if any(name in op for name in suite.ops)):
        print(suite.reference_note)
    print()
    print(format_table(rows, suite.cases))
    print("\n" + suite.legend)
    met, stated, unmeasured = count_targets(rows)
    print(f"\nTargets met: {met} of {stated}" + (f" ({unmeasured} not measured)" if unmeasured else ""))


def report_suite(suite: Suite, quick: bool, json_path: Path, benchmark_json: Optional[Path]) -> int:
    """Run one suite, print its table and save it as JSON; the child pytest's exit status."""
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = benchmark_json.resolve() if benchmark_json else Path(tmp) / "raw.json"
        status = run_benchmarks(suite, raw_path, quick, Path(tmp) / "storage")
        if not raw_path.exists():
            print(f"error: the {suite.name} benchmarks did not run (pytest exit status {status})",
                  file=sys.stderr)
            return status or 1
        raw = json.loads(raw_path.read_text())

    machine = machine_summary(raw)
    rows = build_rows(raw, suite.cases)
    print_report(suite, machine, rows)
    met, stated, _ = count_targets(rows)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({
        "suite": suite.bench_file, "machine": machine, "rows": rows,
        "targets_met": met, "targets_total": stated, "rows_total": len(rows)}, indent=2) + "\n")
    print(f"Saved {json_path}")
    if status != 0:
        print(f"error: some {suite.name} benchmarks failed (pytest exit status {status})", file=sys.stderr)
    return status


def _for_suite(path: Optional[Path], suite: str, several: bool) -> Optional[Path]:
    """``path`` as given for a single suite; with several, the suite's name added to the file name."""
    if path is None or not several:
        return path
    return path.with_name(f"{path.stem}_{suite}{path.suffix}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds per measurement (same shapes): under a minute per suite")
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all",
                        help="which suite to run (default: all, one after the other)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to save the ratio table (default benchmarks/results/<suite>_cpu.json, "
                             "or <suite>_cpu_quick.json with --quick)")
    parser.add_argument("--benchmark-json", type=Path, default=None,
                        help="also keep pytest-benchmark's raw JSON (every timing) at this path")
    args = parser.parse_args(argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    several = len(names) > 1

    status = 0
    for name in names:
        suite = SUITES[name]
        if several:
            print(f"\n=== {name} suite ({suite.bench_file}) ===", flush=True)
        json_path = _for_suite(args.json, name, several) or (suite.quick_json if args.quick else suite.default_json)
        suite_status = report_suite(suite, args.quick, json_path, _for_suite(args.benchmark_json, name, several))
        status = status or suite_status
    return status


if __name__ == "__main__":
    sys.exit(main())
