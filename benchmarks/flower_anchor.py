"""The anchor FedAvg job through Flower's simulation: pfl's Flower app against Flower's own
PyTorch quickstart pattern, same job, same data, same Ray backend.

The job (as ``fedavg_command.py``): synthetic-cifar, 20 clients x 250 samples (IID), LeNet-5,
batch 64, 1 local epoch, SGD lr 0.01 without momentum, every client every round, 10 rounds.

* ``ours``: ``PflStrategy`` in the ServerApp and pfl's ClientApp (``pfl_algorithms.flower``)
  running ``pfl run fedavg``'s config (evaluation only after the last round, as the command
  benchmark; the test split is empty, so it costs one message round trip, no compute);
* ``quickstart``: Flower's quickstart-pytorch written for this job: a ClientApp that loads the
  global ``state_dict`` from the message's ``ArrayRecord``, trains a torch LeNet-5 over a
  shuffled ``DataLoader`` of its partition (the same client's samples as pfl's partition gives
  it), replies ``ArrayRecord(model.state_dict())`` and ``num-examples``; the ServerApp runs the
  stock ``flwr.serverapp.strategy.FedAvg(fraction_train=1.0, fraction_evaluate=0.0)``.

Each side runs in a fresh process (``run_simulation``, 20 SuperNodes, Ray with 2 CPUs and one
per ClientApp actor), the two alternating, ``--repeats`` times; reported: the wall time of the
whole process (Ray's start included) and the ServerApp's own time (its ``main``: the rounds
alone), medians, and the ratio quickstart / ours (> 1: our integration is faster).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/flower_anchor.py [--repeats 3] [--json PATH]
    python benchmarks/flower_anchor.py --quick     # 3 clients x 40 samples, 2 rounds, 1 repeat (CI)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: pfl_algorithms and benchmarks from this checkout
    sys.path.insert(0, str(ROOT))

FULL = {"clients": 20, "samples": 250, "rounds": 10}
QUICK = {"clients": 3, "samples": 40, "rounds": 2}
BATCH, LR = 64, 0.01
SIDES = ("ours", "quickstart")
# Ray as in the Flower tests: 2 CPUs, one per ClientApp actor (both sides alike), no dashboard.
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
           "init_args": {"num_cpus": 2, "include_dashboard": False}}


def run_config(clients: int, samples: int, rounds: int):
    """``pfl run fedavg``'s RunConfig for the job (the flags of ``fedavg_command.py``)."""
    from pfl_algorithms.config import RunConfig, check

    return check(RunConfig(algorithm="fedavg", dataset="synthetic-cifar", model="lenet5", scenario="iid",
                           clients=clients, samples_per_client=samples, scenario_options={"split": (1.0, 0.0, 0.0)},
                           batch_size=BATCH, lr=LR, momentum=0.0, local_epochs=1, rounds=rounds, eval_every=rounds,
                           checkpoint_every=rounds, executor="sequential"))


# ---------------------------------------------------------------- the quickstart pattern

_PARTITIONS: dict = {}


def load_partition(config, partition_id: int):
    """Client ``partition_id``'s training samples as a ``TensorDataset``: the very tensors pfl's
    partition gives it (label map applied), loaded once per process as the quickstart caches
    its ``FederatedDataset``."""
    import torch
    from torch.utils.data import TensorDataset

    from pfl_algorithms.data.run_data import load_run_data

    if not _PARTITIONS:
        dataset, partition = load_run_data(config.dataset, config.scenario, config.clients, seed=config.seed,
                                           scenario_options=config.scenario_options,
                                           samples_per_client=config.samples_per_client)
        for i, split in enumerate(partition.clients):
            labels = dataset.labels[split.train]
            if split.label_map is not None:
                labels = split.label_map[labels]
            _PARTITIONS[i] = TensorDataset(dataset.inputs[split.train], torch.as_tensor(labels))
    return _PARTITIONS[partition_id]


def quickstart_apps(config):
    """(ServerApp, ClientApp) of Flower's quickstart-pytorch pattern for ``config``'s job; the
    ServerApp reports its main's wall time in ``timing``."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    from benchmarks.plain_fedavg_loop import LeNet5

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        model = LeNet5(num_classes=10)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        data = load_partition(config, int(context.node_config["partition-id"]))
        optimizer = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        model.train()
        total, batches = 0.0, 0
        for x, y in DataLoader(data, batch_size=BATCH, shuffle=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"train_loss": total / batches, "num-examples": len(data)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()
    timing: dict = {}

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        start = time.perf_counter()
        torch.manual_seed(config.seed)
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=config.clients,
                          min_available_nodes=config.clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(LeNet5(num_classes=10).state_dict()),
                                train_config=ConfigRecord({"lr": LR}), num_rounds=config.rounds)
        timing.update(server_s=time.perf_counter() - start, rounds=len(result.train_metrics_clientapp))

    return server_app, client_app, timing


# ---------------------------------------------------------------- one side, in this process

def run_side(side: str, job: dict) -> dict:
    """Run ``side`` once in this process; {server_s: the ServerApp main's wall time, rounds}."""
    from flwr.simulation import run_simulation

    config = run_config(**job)
    if side == "ours":
        from flwr.serverapp import ServerApp

        from pfl_algorithms.flower.app import run_server
        from pfl_algorithms.flower.client import make_client_app

        # make_server_app's main, with a clock around it (the same run_server call)
        server_app, timing = ServerApp(), {}

        @server_app.main()
        def main(grid, context) -> None:
            begin = time.perf_counter()
            strategy = run_server(config, grid, timeout=3600.0)
            timing.update(server_s=time.perf_counter() - begin, rounds=len(strategy.history))

        client_app = make_client_app(config)
    elif side == "quickstart":
        server_app, client_app, timing = quickstart_apps(config)
    else:
        raise ValueError(f"unknown side {side!r}")
    run_simulation(server_app, client_app, num_supernodes=config.clients, backend_config=BACKEND)
    if timing.get("rounds") != config.rounds or "server_s" not in timing:
        raise RuntimeError(f"{side}: the ServerApp did not finish its {config.rounds} rounds ({timing})")
    return {"server_s": timing["server_s"], "rounds": timing["rounds"]}


# ---------------------------------------------------------------- the comparison

def timed_child(side: str, quick: bool, result: Path) -> tuple[float, float]:
    """(process wall time, ServerApp time) of one side in a fresh interpreter."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--result", str(result)]
    if quick:
        cmd.append("--quick")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, json.loads(result.read_text())["server_s"]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", "--dry-run", action="store_true", dest="quick",
                        help="a tiny job (3 clients x 40 samples, 2 rounds), one repeat: checks the script runs")
    parser.add_argument("--json", default=None, help="where to save the results (default benchmarks/results/"
                                                     "flower_anchor_cpu.json, or flower_anchor_quick.json)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child: run one side
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    job = QUICK if args.quick else FULL
    if args.side:
        logging.getLogger("flwr").setLevel(logging.WARNING)
        Path(args.result).write_text(json.dumps(run_side(args.side, job)))
        return 0

    repeats = 1 if args.quick else args.repeats
    load = os.getloadavg()[0]
    walls: dict = {side: [] for side in SIDES}
    servers: dict = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for side in SIDES:  # alternating, so drifts in the machine's load hit both
                wall, server = timed_child(side, args.quick, Path(tmp) / f"{side}{repeat}.json")
                walls[side].append(wall)
                servers[side].append(server)
                print(f"repeat {repeat} {side}: process {wall:.2f} s, ServerApp {server:.2f} s", flush=True)
    median_wall = {side: statistics.median(v) for side, v in walls.items()}
    median_server = {side: statistics.median(v) for side, v in servers.items()}
    ratio_wall = median_wall["quickstart"] / median_wall["ours"]
    ratio_server = median_server["quickstart"] / median_server["ours"]
    print(f"\n{job['rounds']}-round FedAvg, {job['clients']} clients x {job['samples']} samples, Flower simulation "
          f"(median of {repeats}): ServerApp ours {median_server['ours']:.2f} s, quickstart "
          f"{median_server['quickstart']:.2f} s, ratio quickstart/ours {ratio_server:.2f}; whole process ours "
          f"{median_wall['ours']:.2f} s, quickstart {median_wall['quickstart']:.2f} s, ratio {ratio_wall:.2f}")
    result = {"job": dict(job, batch=BATCH, lr=LR, local_epochs=1, model="lenet5", dataset="synthetic-cifar"),
              "quick": args.quick, "repeats": repeats, "process_s": walls, "server_s": servers,
              "median_process_s": median_wall, "median_server_s": median_server,
              "ratio_quickstart_over_ours_server": ratio_server, "ratio_quickstart_over_ours_process": ratio_wall,
              "cpu": cpu_name(), "cpu_count": os.cpu_count(), "load_1min_at_start": load,
              "load_1min_at_end": os.getloadavg()[0], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "ray_backend": BACKEND, "flwr": _flwr_version()}
    default = f"flower_anchor_{'quick' if args.quick else 'cpu'}.json"
    path = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Saved {path}")
    return 0


def _flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")


if __name__ == "__main__":
    sys.exit(main())
