"""GPU benchmark of the batched executor against the sequential one, in one run.

    python benchmarks/gpu_executor.py [--dry-run] [--json PATH]

Jobs (CIFAR-shaped synthetic data from a fixed seed: each class a random image under noise,
FedAvg rounds of local training without
evaluation unless said, SGD lr 0.01, both executors from the same initial state):

1. ``lenet5``: 20 clients x 500 samples, LeNet-5, batch 64, 1 epoch a round.  Target: batched
   >= 10x sequential.  Also batched under bfloat16 autocast (``--autocast bf16``), and the
   effect of bf16 on accuracy: the train-set accuracy after 20 rounds, float32 against bf16.
   This job also times its per-client convolutions as im2col and batched GEMMs ("+gemm-conv",
   ``--batched-conv gemm``) instead of vmap's grouped convolutions (on an H100: 6x slower).
   Each job times the grouped convolutions in channels-last memory ("+nhwc", ``--batched-conv
   grouped-nhwc``), in float32 and under bf16, and each client's convolution as its own dense
   one ("+per-client", ``--batched-conv per-client``), in float32 and under bf16.
   Each job also times the bound of batching with these kernels ("one-model", and under bf16):
   one model trained on all the clients' samples at batch 20 x the job's, the same samples and
   FLOPs as a round, in dense convolutions.  A target it does not reach is out of reach of any
   batched executor that runs the same kernels.
2. ``resnet9-factorized``: 20 clients x 512 samples, ResNet-9 with every layer factorized,
   batch 128.  Target: batched >= 3x sequential.  Also batched under bfloat16 autocast: on the
   H200 this job ran its convolutions' arithmetic at about 65 TFLOPS, batched and sequential
   alike, where bf16 can pay (LeNet-5's round is bound by its kernels' count, not arithmetic).
3. ``factorized-fl-table1``: one Factorized-FL CIFAR-10 setting of its Table 1 end to end
   (``pfl run factorized-fl-beta``: 20 clients, 50 rounds, 5 local epochs, ResNet-9, the released
   code's optimizer, 3000 CIFAR-shaped synthetic samples per client, evaluation every round),
   on the batched executor.  Target: <= 5 minutes.  ``--quick`` runs 3 of its rounds and
   projects the 50: the time to the end of round 1 (setup, captures) plus 49 times the median
   of the later rounds.

Every job's target rows (sequential and batched, captured) run first, then Table 1, then the
rows only reported, so that ``gpu_check.sh``'s stage cap, where it cuts the run short, takes
those first.  Every executor runs as a user gets it, its plain steps replayed as CUDA graphs
(``--cuda-graphs``, the default), and uncaptured (``-eager``), so each target is met or not
against the sequential executor as it runs by default, and the rows show what capture gives.

Rows go to ``benchmarks/results/executor_gpu_<device>.json``, written after every job (its
``complete`` is false until the last one ends).  ``--dry-run`` runs every job on the CPU at
tiny sizes (3 clients, 1 round and no warm-up, small batches; its timings mean nothing) and
writes to a temporary folder: ``tests/algorithms/engine/test_gpu_executor_script.py`` runs it
in CI.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_common import DRY_RUN_RESULTS, RESULTS, launch_mode, sanitize  # noqa: E402
from pfl_algorithms.algorithms.fedavg import FedAvg  # noqa: E402
from pfl_algorithms.data.partition import ClientSplit  # noqa: E402
from pfl_algorithms.engine.federation import EngineSettings  # noqa: E402
from pfl_algorithms.engine.optim import OptimizerSettings  # noqa: E402
from pfl_algorithms.engine.local import LocalSchedule, evaluate  # noqa: E402
from pfl_algorithms.engine.rounds import federation_for, run_round  # noqa: E402
from pfl_algorithms.models import build_model  # noqa: E402
from pfl_kernels.nn import factorize  # noqa: E402

FULL = {"clients": 20, "lenet_samples": 500, "resnet_samples": 512, "rounds": 3, "accuracy_rounds": 20, "image": 32,
        "warm_up": True, "table1": dict(clients=20, rounds=50, local_epochs=5, samples_per_client=3000)}
# The dry run checks the script, not speeds: 16x16 images, a quarter of CIFAR's compute (on an
# AVX2-only CPU, without bf16 instructions, a bf16 ResNet-9 round of 32x32 images took 25-40 s
# and the whole dry run 461 s of the CI's main phase), and no warm-up rounds: they run the same
# code as the timed round, and a CPU captures nothing (the dry-run test: 123 s with them, 48 s
# without, alone on that CPU).  ResNet-9 takes one batch of 8 a client, which runs every step's
# code as two do (`--dry-run --profile` alone on that CPU: 44 s with two, 26 s with one; its
# bf16 rows are most of it, bf16 convolutions there being emulated).
DRY = {"clients": 3, "lenet_samples": 40, "resnet_samples": 8, "rounds": 1, "accuracy_rounds": 1, "image": 16,
       "warm_up": False, "table1": dict(clients=3, rounds=1, local_epochs=1, samples_per_client=16)}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def federation(model_name: str, *, factorized: bool, clients: int, samples: int, batch: int, executor: str,
               device: str, autocast: Optional[str] = None, cuda_graphs: bool = True, batched_conv: str = "grouped",
               image: int = 32):
    """A FedAvg federation of random CIFAR-shaped shards (3 x ``image`` x ``image``) on ``device``,
    the same for every executor."""
    gen = torch.Generator().manual_seed(0)
    # Each class a fixed random image under noise of the same size: learnable (LeNet-5, batched:
    # 18% train accuracy after 5 rounds, 86% after 20, on a CPU), so that the accuracy effect of
    # bf16 says something (random labels left both at chance on the H200); a round's speed does
    # not depend on the data.
    labels = torch.randint(0, 10, (clients * samples,), generator=gen)
    templates = torch.randn(10, 3, image, image, generator=gen)
    inputs = torch.randn(clients * samples, 3, image, image, generator=gen) + 1.0 * templates[labels]
    torch.manual_seed(0)
    model = build_model(model_name, input_shape=(3, image, image), num_classes=10)
    if factorized:
        model = factorize(model)
    empty = torch.empty(0, dtype=torch.int64)
    splits = [ClientSplit(train=torch.arange(k * samples, (k + 1) * samples), val=empty, test=empty)
              for k in range(clients)]
    settings = EngineSettings(rounds=10 ** 6, eval_every=10 ** 6, optimizer=OptimizerSettings(lr=0.01, momentum=0.9),
                              schedule=LocalSchedule(batch_size=batch, epochs=1), executor=executor,
                              autocast=autocast, cuda_graphs=cuda_graphs, batched_conv=batched_conv)
    algorithm = FedAvg()
    return federation_for(algorithm, model, inputs, labels, splits, settings, device=device), algorithm


def time_rounds(fed, algorithm, rounds: int, device: str, warm: int = 2) -> float:
    """Median seconds of ``rounds`` rounds after ``warm`` warm-up rounds (every step of a round
    captured by then: a short last batch is seen once a round)."""
    for round_ in range(warm):
        run_round(fed, algorithm, round_)
    times = []
    for round_ in range(warm, warm + rounds):
        synchronize(device)
        start = time.perf_counter()
        run_round(fed, algorithm, round_)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def train_accuracy(fed) -> float:
    """Mean over clients of the accuracy of each client's model on its training shard."""
    accuracies = []
    cohort = fed.cohorts[0]
    for client in range(fed.num_clients):
        row = cohort.row(client)
        cohort.work.load(cohort.params.row(row), cohort.buffers.row(row), cohort.int_buffers.row(row))
        accuracies.append(evaluate(cohort.work.module, fed.inputs, fed.labels, fed.clients[client].train)[0])
    return sum(accuracies) / len(accuracies)


ONE_MODEL = "one-model"  # speed_job's bound: one model on every client's samples at once
CONV_KEYS = {"grouped": "", "gemm": "+gemm-conv", "grouped-nhwc": "+nhwc", "per-client": "+per-client"}  # --batched-conv -> a row's suffix


Variant = tuple  # (executor, autocast, captured, batched_conv)


def target_variants() -> list[Variant]:
    """The rows a job's target needs: the sequential and the batched executor as a user gets
    them (captured)."""
    return [("sequential", None, True, "grouped"), ("batched", None, True, "grouped")]


def reported_variants(*, bf16: bool, gemm: bool) -> list[Variant]:
    """The rows a job reports besides its target (module docstring), run after every job's
    target rows and Table 1, so that a stage cut short at its cap loses these first."""
    variants = [("sequential", None, False, "grouped"), ("batched", None, False, "grouped")]  # uncaptured
    if bf16:
        variants.append(("batched", "bf16", True, "grouped"))
    if gemm:  # the per-client convolutions as im2col and batched GEMMs (``--batched-conv gemm``)
        variants.append(("batched", None, True, "gemm"))
    # The grouped convolutions in channels-last memory (``--batched-conv grouped-nhwc``): no
    # NCHW/NHWC conversions around cuDNN's kernels, the bias in the call.
    variants.append(("batched", None, True, "grouped-nhwc"))
    if bf16:
        variants.append(("batched", "bf16", True, "grouped-nhwc"))
    # Each client's convolution as its own dense one (``--batched-conv per-client``): the
    # sequential executor's convolution kernels, everything else of the step batched.
    variants.append(("batched", None, True, "per-client"))
    if bf16:
        # On the H200 (b05605a) cuDNN's bf16 weight gradient of the grouped convolutions
        # (wgrad_alg1_engine) took 278 of the 480 ms of kernels of a bf16 ResNet-9 round, where
        # its dense bf16 kernels are the sequential executor's.
        variants.append(("batched", "bf16", True, "per-client"))
    # The bound of batching with these kernels: one model trained on every client's samples at
    # once, batch clients x batch (the same samples and FLOPs as a round of either executor, in
    # dense convolutions, which grouped ones do not beat).  Where it is not 'target' times the
    # sequential round, no batched executor built on the same kernels can be.  (cuDNN's
    # autotuner, which this job timed before, changed neither round on an H100: 28.3 against
    # 27.8 ms, 338.5 against 338.7 ms.)
    variants.append((ONE_MODEL, None, True, "grouped"))
    if bf16:
        variants.append((ONE_MODEL, "bf16", True, "grouped"))
    return variants


def speed_job(name: str, model: str, factorized: bool, samples: int, batch: int, target: float, sizes: dict,
              device: str, *, variants: list[Variant], seconds: dict, rows: list, on_row: Callable[[], None]) -> None:
    """Each variant's round time (``executor``, ``autocast``, captured or uncaptured ('-eager'),
    ``batched_conv``), and its speed-up over the sequential executor as it runs by default
    (captured) and uncaptured, from ``seconds`` (each timed row's round time by its key, kept
    across the calls of one job).  Rows are appended to ``rows`` as each variant ends,
    ``on_row`` called after each (the caller saves), and a variant that fails leaves a row with
    its ``error`` instead of ending the job (on an H100 the bf16 ResNet-9 variant failed and
    took every other ResNet-9 figure with it)."""
    clients = sizes["clients"]
    for executor, autocast, graphs, conv in variants:
        key = executor + ("+bf16" if autocast else "") + CONV_KEYS[conv] + ("" if graphs else "-eager")
        one = executor == ONE_MODEL
        fed = None
        try:
            fed, algorithm = federation(model, factorized=factorized, clients=1 if one else clients,
                                        samples=clients * samples if one else samples,
                                        batch=clients * batch if one else batch,
                                        executor="sequential" if one else executor, device=device,
                                        autocast=autocast, cuda_graphs=graphs, batched_conv=conv,
                                        image=sizes["image"])
            # Two warm-up rounds where steps are captured (a short last batch's is captured in
            # its second round), one where nothing is.
            warm = (2 if graphs else 1) if sizes["warm_up"] else 0
            seconds[key] = time_rounds(fed, algorithm, sizes["rounds"], device, warm=warm)
            rows.append({"job": name, "executor": key, "round_s": seconds[key],
                         "samples_per_s": clients * samples / seconds[key],
                         "batch": clients * batch if one else batch, "steps": dict(fed.step_graphs.counts)})
        except Exception as exc:  # noqa: BLE001 -- recorded in the row and printed; the other variants still run
            error = f"{type(exc).__name__}: {exc}"
            print(f"{name} {key}: FAILED: {error}", file=sys.stderr, flush=True)
            rows.append({"job": name, "executor": key, "error": error[:1000]})
        finally:
            if fed is not None:
                fed.close()
        _speedups([row for row in rows if row["job"] == name], seconds, target)
        on_row()


def _speedups(rows: list[dict], seconds: dict, target: float) -> None:
    """Each timed row's speed-ups over the two sequential rows (None until both are timed), and
    the plain batched row's target; a failed row keeps its error."""
    sequential, eager = seconds.get("sequential"), seconds.get("sequential-eager")
    for row in rows:
        if "error" in row:
            continue
        row["speedup_vs_sequential"] = None if sequential is None else sequential / row["round_s"]
        row["speedup_vs_sequential_eager"] = None if eager is None else eager / row["round_s"]
        row["target"] = target if row["executor"] == "batched" else None
        row["met"] = (None if row["target"] is None or row["speedup_vs_sequential"] is None
                      else row["speedup_vs_sequential"] >= target)


def _ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def profile_round(sizes: dict, device: str, top: int = 18, *, model: str = "lenet5", factorized: bool = False,
                  samples: Optional[int] = None, batch: int = 64, host: bool = True, executor: str = "batched",
                  autocast: Optional[str] = None) -> str:
    """Where one captured round of ``model`` on ``executor`` spends its time, as text for the
    log: the host's Python functions (cProfile, by own time; ``host``) and the device's kernels
    (torch.profiler, by device time).  A batched round can be far slower than its GPU work
    would say; this says why."""
    import cProfile
    import io
    import pstats

    fed, algorithm = federation(model, factorized=factorized, clients=sizes["clients"],
                                samples=samples or sizes["lenet_samples"], batch=batch, executor=executor, device=device,
                                autocast=autocast, image=sizes["image"])
    if sizes["warm_up"]:
        time_rounds(fed, algorithm, 1, device, warm=2)  # rounds 0-2: every step captured by round 3
    out = io.StringIO()
    if host:
        profiler = cProfile.Profile()
        synchronize(device)
        profiler.enable()
        run_round(fed, algorithm, 3)
        synchronize(device)
        profiler.disable()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, acc_events=True) as prof:  # one cycle (see _gpu_common.kernel_ms)
        run_round(fed, algorithm, 4)
        synchronize(device)
    fed.close()
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    out.write(prof.key_averages().table(sort_by=sort, row_limit=top))
    if host:
        out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return out.getvalue()


def accuracy_effect(sizes: dict, device: str) -> dict:
    """LeNet-5's mean train accuracy after a few batched rounds, float32 against bf16 autocast."""
    result = {}
    for autocast in (None, "bf16"):
        fed, algorithm = federation("lenet5", factorized=False, clients=sizes["clients"],
                                    samples=sizes["lenet_samples"], batch=64, executor="batched", device=device,
                                    autocast=autocast, image=sizes["image"])
        for round_ in range(sizes["accuracy_rounds"]):
            run_round(fed, algorithm, round_)
        result["bf16" if autocast else "float32"] = train_accuracy(fed)
        fed.close()
    return result


def table1_job(sizes: dict, device: str, out: Path, *, rounds: Optional[int] = None) -> dict:
    """The Factorized-FL Table 1 setting end to end through ``pfl run``'s runner; ``rounds``:
    run only that many of its rounds and project the whole (module docstring)."""
    from pfl_algorithms.config import RunConfig
    from pfl_algorithms.runner import run

    table = dict(sizes["table1"])
    paper_rounds = table["rounds"]
    if rounds is not None:
        table["rounds"] = min(rounds, paper_rounds)
    config = RunConfig(algorithm="factorized-fl-beta", dataset="synthetic-cifar", scenario="iid", model="resnet9",
                       batch_size=256, lr=1e-3, momentum=0.9, weight_decay=1e-6, executor="batched", device=device,
                       **table)
    ends = []
    start = time.perf_counter()
    summary = run(config, out / "factorized-fl-table1", overwrite=True, progress=False,
                  on_round=lambda record: ends.append(time.perf_counter()))
    seconds = time.perf_counter() - start
    later = sorted(b - a for a, b in zip(ends, ends[1:]))
    projected = seconds if table["rounds"] == paper_rounds or not later else (
        ends[0] - start + (paper_rounds - 1) * later[len(later) // 2])
    return {"job": "factorized-fl-table1", "executor": "batched", "rounds_run": table["rounds"],
            "wall_s": seconds, "paper_rounds": paper_rounds, "projected_s": projected, "target_s": 300.0,
            "met": projected <= 300.0, "rounds": summary["rounds"],
            "final_mean_accuracy": summary["final_mean_accuracy"]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (CI)")
    parser.add_argument("--quick", action="store_true", help="one timed round per variant (the full grid else)")
    parser.add_argument("--json", type=Path, default=None, help="where the rows go")
    parser.add_argument("--profile", action="store_true",
                        help="also print a profile of one batched LeNet-5 round (host functions, device kernels) and the "
                             "device kernels of one factorized ResNet-9 round: batched, batched under bf16, sequential")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_executor: no CUDA device; run with --dry-run to check the script on a CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    sizes = DRY if args.dry_run else (dict(FULL, rounds=1) if args.quick else FULL)
    name = "dry run (CPU)" if args.dry_run else torch.cuda.get_device_name()
    path = args.json or (DRY_RUN_RESULTS if args.dry_run else RESULTS) / f"executor_gpu_{sanitize(name)}.json"
    result = {"suite": "executor_gpu", "machine": {"device": name, "torch": torch.__version__,
                                                   "platform": platform.platform(), "dry_run": args.dry_run},
              "complete": False, "rows": [], "bf16_accuracy": None, "table1": None}

    def save() -> None:
        # After every job, so that a run cut short (gpu_check.sh's stage timeout) keeps the jobs
        # that finished; "complete" says whether every job did.
        result["machine"].update(launch_mode())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))

    rows = result["rows"]
    # (name, model, factorized, samples, batch, target, bf16, gemm); no GEMM lowering for
    # ResNet-9: on an H100 it made even LeNet-5's batched round 6x slower (161 against 26 ms),
    # and ResNet-9's im2col would hold about 0.85 GB per client per step.  --quick leaves the
    # GEMM row out for LeNet-5 too, measured twice.
    jobs = [("lenet5", "lenet5", False, sizes["lenet_samples"], 64, 10.0, True, not args.quick),
            ("resnet9-factorized", "resnet9", True, sizes["resnet_samples"], 128 if not args.dry_run else 8, 3.0,
             True, False)]
    seconds = {name: {} for name, *_ in jobs}
    # The targets first, then Table 1, then what is only reported: a stage cut short at its cap
    # (gpu_check.sh) loses the reported rows before any target.
    for name, model, factorized, samples, batch, target, _, _ in jobs:
        speed_job(name, model, factorized, samples, batch, target, sizes, device, variants=target_variants(),
                  seconds=seconds[name], rows=rows, on_row=save)
    with tempfile.TemporaryDirectory() as scratch:
        table1 = result["table1"] = table1_job(sizes, device, Path(scratch), rounds=3 if args.quick else None)
    save()
    for name, model, factorized, samples, batch, target, bf16, gemm in jobs:
        speed_job(name, model, factorized, samples, batch, target, sizes, device,
                  variants=reported_variants(bf16=bf16, gemm=gemm), seconds=seconds[name], rows=rows, on_row=save)
    accuracy = result["bf16_accuracy"] = accuracy_effect(sizes, device)
    result["complete"] = True
    save()
    order = [name for name, *_ in jobs]
    for row in sorted(rows, key=lambda row: order.index(row["job"])):
        if "error" in row:
            print(f"{row['job']:<20} {row['executor']:<26} FAILED: {row['error'][:200]}")
            continue
        print(f"{row['job']:<20} {row['executor']:<26} {row['round_s'] * 1e3:9.1f} ms/round "
              f"{row['samples_per_s']:10.0f} samples/s  x{_ratio(row['speedup_vs_sequential'])} "
              f"(x{_ratio(row['speedup_vs_sequential_eager'])} over sequential-eager)"
              + (f"  target >= {row['target']:g}: {'met' if row['met'] else 'NOT met'}" if row["target"] else ""))
    print(f"bf16 autocast, LeNet-5 train accuracy after {sizes['accuracy_rounds']} rounds: "
          f"float32 {accuracy['float32']:.4f}, bf16 {accuracy['bf16']:.4f}")
    print(f"factorized-fl-table1 end to end: {table1['rounds_run']} rounds in {table1['wall_s']:.1f} s, "
          f"{table1['paper_rounds']} rounds {'projected' if table1['rounds_run'] < table1['paper_rounds'] else 'took'} "
          f"{table1['projected_s']:.1f} s (target <= 300 s: {'met' if table1['met'] else 'NOT met'})")
    print(f"saved {path}", flush=True)
    if args.profile:  # last: a profiler that fails on some machine costs no measurement
        print("== profile of one batched LeNet-5 round\n" + profile_round(sizes, device), flush=True)
        # ResNet-9 ran no faster batched than sequential, and its batched round took the same
        # time under bf16 autocast (on an H100, 338.6 against 338.7 ms; both executors at about
        # the FP32 units' 60 TFLOPS): which kernels take the time, do the bf16 round's
        # convolutions run in bf16, and how do the grouped ones compare with the sequential
        # executor's?  The device's kernels only.
        resnet = dict(model="resnet9", factorized=True, samples=sizes["resnet_samples"],
                      batch=128 if not args.dry_run else 8, host=False)
        for title, options in (("batched", {}), ("batched, bf16 autocast", dict(autocast="bf16")),
                               ("sequential", dict(executor="sequential"))):
            print(f"== device kernels of one factorized ResNet-9 round ({title})\n"
                  + profile_round(sizes, device, **resnet, **options), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
