"""``--executor distributed`` under torchrun (gloo on a CPU, 2 processes) gives bitwise the
metrics and final checkpoint of a sequential run: each client's training is the same
computation on one intra-op thread, and the replicated server sees the uploads in the same
order.  A checkpoint written by 2 processes resumes on 1."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from pfl_algorithms.config import RunConfig
from pfl_algorithms.engine.checkpoint import read_checkpoint
from pfl_algorithms.engine.executors import CHOICES, choose_executor
from pfl_algorithms.runner import run
from tests.algorithms.state_checks import assert_same

pytestmark = [pytest.mark.heavy(seconds=110),  # scheduled first under xdist (tests/conftest.py)
              pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                 reason="torch.distributed with the gloo backend is not available in this torch build")]

TIMEOUT = 300
ARGS = ["--dataset", "digits", "--clients", "5", "--rounds", "3", "--quiet"]
# The command-line runs take one algorithm, the one with the most client state (kept optimizer
# state, fedrep's head epochs): every algorithm's two-process run is compared with its sequential
# run, state included, by test_every_algorithm_on_two_processes_equals_sequential, and fedavg's
# through the command line by test_a_killed_torchrun_job_resumes.
FEDREP_KEEP = ["fedrep", "--set", "optimizer_state=keep", "--set", "head_epochs=1"]


def pfl(*args) -> list[str]:
    return [sys.executable, "-m", "pfl_algorithms", "run", *args]


def torchrun(nproc: int, *command) -> list[str]:
    """``torchrun`` on one node with ``nproc`` processes, its rendezvous on a free port (c10d
    with port 0: a fixed --master-port collides when test runs overlap)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", *command]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def env() -> dict:
    # The repository on the path: torchrun runs a script from its own folder.
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def start(command, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), **kwargs)


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, err[-3000:]
    return out


def metric_lines(out) -> list[dict]:
    lines = []
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        try:
            lines.append(json.loads(line))
        except ValueError:
            break  # the line a kill cut
        lines[-1].pop("wall_s")
    return lines


def assert_same_run(a, b) -> None:
    """Bitwise the same metrics lines (wall time aside) and final checkpoint."""
    assert metric_lines(a) == metric_lines(b)
    x, y = read_checkpoint(a / "checkpoint.pt"), read_checkpoint(b / "checkpoint.pt")
    assert_same(x["federation"], y["federation"])
    assert_same(x["algorithm"], y["algorithm"])


def test_two_processes_equal_sequential_bitwise(tmp_path):
    args = [*FEDREP_KEEP, *ARGS]
    sequential, distributed = tmp_path / "sequential", tmp_path / "distributed"
    # Side by side: the numbers do not depend on it (one intra-op thread per task).
    reference = start(pfl(*args, "--executor", "sequential", "--out", str(sequential)))
    job = start(torchrun(2, "-m", "pfl_algorithms", "run", *args, "--executor", "distributed",
                         "--out", str(distributed)))
    printed = finish(job)
    finish(reference)
    assert printed.count("final mean accuracy") == 1  # rank 0 alone reports
    assert_same_run(distributed, sequential)
    assert json.loads((distributed / "executor.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in distributed.iterdir()) == sorted(p.name for p in sequential.iterdir())


# Fed-CMA on 6 clients of three architectures (client c has the c % 3-th): each cohort has a client
# on each of the 2 ranks, so each rank answers the class-mean statistics of one of its cohort's
# senders where a sequential run answers both.  Those answers once depended on how many senders one
# call answered (round 1's train_loss 2.8239848613739014 against 2.823984742164612), which the
# float64 one-architecture federations of distributed_every_algorithm.py did not show.
MIXED_ARCHITECTURES = '["digits-cnn(embedding_dim=32)", "mlp(hidden=(64, 32))", "fedgen-cnn"]'
FEDCMA_MIXED = ["fedcma", "--scenario", "dirichlet", "--keep-head-local", "false", "--clients", "6", "--rounds", "2",
                "--samples-per-client", "40", "--quiet"]


def test_fedcma_with_each_cohort_on_both_ranks_equals_sequential_bitwise(tmp_path):
    config = tmp_path / "architectures.toml"
    config.write_text(f"[scenario_options]\narchitectures = {MIXED_ARCHITECTURES}\n")
    args = [*FEDCMA_MIXED, "--config", str(config)]
    sequential, distributed = tmp_path / "sequential", tmp_path / "distributed"
    reference = start(pfl(*args, "--executor", "sequential", "--out", str(sequential)))
    finish(start(torchrun(2, "-m", "pfl_algorithms", "run", *args, "--executor", "distributed",
                          "--out", str(distributed))))
    finish(reference)
    architectures = json.loads((sequential / "config.json").read_text())["scenario_options"]["architectures"]
    assert len(architectures) == 3
    assert_same_run(distributed, sequential)


STOP_AFTER_2 = textwrap.dedent("""
    import sys
    from pathlib import Path
    from pfl_algorithms.cli import _parser, config_from_args
    from pfl_algorithms.runner import run
    args = _parser().parse_args(["run", *sys.argv[2:]])
    run(config_from_args(args), Path(sys.argv[1]), progress=False, stop_after=2)
""")


def test_a_two_process_checkpoint_resumes_on_one(tmp_path):
    # fedrep with kept optimizer state: the checkpoint must hold rank 1's clients' rows and
    # optimizer state, which only rank 1 computed.  The resume is a plain ``pfl run --resume``
    # of the saved config (executor 'distributed'): without torchrun, a world of one process.
    args = [*FEDREP_KEEP, "--dataset", "digits", "--clients", "5", "--rounds", "4", "--quiet",
            "--set", "checkpoint_every=1"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    script = tmp_path / "stop_after_2.py"
    script.write_text(STOP_AFTER_2)
    reference = start(pfl(*args, "--executor", "sequential", "--out", str(whole)))
    finish(start(torchrun(2, str(script), str(stopped), *args, "--executor", "distributed")))
    assert [line["round"] for line in metric_lines(stopped)] == [0, 1]
    assert read_checkpoint(stopped / "checkpoint.pt")["federation"]["round"] == 2
    finish(start(pfl(args[0], "--out", str(stopped), "--resume", "--quiet")))
    finish(reference)
    assert_same_run(stopped, whole)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from the parent ids in /proc/<pid>/stat."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
    found, pending = [], [pid]
    while pending:
        above = pending.pop()
        children = [child for child, parent in parents.items() if parent == above]
        found += children
        pending += children
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="finding torchrun's workers needs /proc")
def test_a_killed_torchrun_job_resumes(tmp_path):
    args = ["fedavg", "--dataset", "digits", "--clients", "5", "--rounds", "8", "--quiet", "--set", "checkpoint_every=1"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    reference = start(pfl(*args, "--executor", "sequential", "--out", str(whole)))
    job = start(torchrun(2, "-m", "pfl_algorithms", "run", *args, "--executor", "distributed", "--out", str(killed)))
    deadline = time.monotonic() + TIMEOUT
    while len(metric_lines(killed)) < 2 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # torchrun starts its workers in sessions of their own: kill -9 each process of the job.
    for pid in [job.pid, *descendants(job.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.communicate()
    assert len(metric_lines(killed)) < 8  # it really was killed mid-run
    finish(start(torchrun(2, "-m", "pfl_algorithms", "run", "fedavg", "--out", str(killed), "--resume", "--quiet")))
    finish(reference)
    assert_same_run(killed, whole)


def test_distributed_is_a_choice_passed_through():
    assert "distributed" in CHOICES
    assert choose_executor("distributed", device="cpu", parameters=10) == ("distributed", "asked for")


def test_several_processes_need_the_distributed_executor(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = RunConfig(algorithm="fedavg", dataset="digits", clients=2, rounds=1, executor="threaded")
    with pytest.raises(ValueError, match="launched with 2 processes .* pass --executor distributed"):
        run(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_incomplete_torchrun_environment_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = RunConfig(algorithm="fedavg", dataset="digits", clients=2, rounds=1, executor="distributed")
    with pytest.raises(ValueError, match="WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER_PORT is not"):
        run(config, tmp_path / "out", progress=False)


def test_every_algorithm_on_two_processes_equals_sequential():
    # Catches client-side code that would keep state outside the banks (it would stay on the
    # owner's rank) and server code that would read a client's rows (stale off its owner).
    script = os.path.join(os.path.dirname(__file__), "distributed_every_algorithm.py")
    printed = finish(start(torchrun(2, script)))
    assert json.loads(printed.strip().splitlines()[-1]) == {}


# ---- what travels between ranks: read like a checkpoint, nothing in it is run ------------------

class _RunsCode:
    """Unpickled plainly, calls ``os.system``: what a hostile peer would send."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train_result():
    import torch

    from pfl_algorithms.engine.client import EvalResult, TrainResult
    from pfl_algorithms.engine.local import LocalResult
    from pfl_algorithms.engine.messages import Message, Sparse

    upload = Message(tensors={"body": torch.arange(6.0), "head": Sparse(torch.tensor([0.0, 2.0, -3.0]), 1.0, 2)},
                     extras={"means": torch.ones(2, 3), "weights": [0.5, 1], "nested": {"n": 3}}, num_examples=40)
    return [TrainResult(client=3, local=LocalResult(loss=0.25, samples=40, steps=3, finite=True), upload=upload),
            EvalResult(client=1, accuracy=0.5, loss=float("nan"), samples=8), {"rows": torch.tensor([1, 3])}]


def test_a_payload_round_trips_with_the_engine_results():
    from pfl_algorithms.config import RunConfig
    from pfl_algorithms.engine.distributed import decode, encode

    value = _train_result()
    back = decode(encode(value), "cpu")
    assert_same(back[2], value[2])
    assert back[0].client == 3 and back[0].local == value[0].local and back[0].upload.num_examples == 40
    assert back[0].upload.dense("head").tolist() == [0.0, 2.0, -3.0]
    assert back[0].upload.tensors["head"].threshold == 1.0 and back[0].upload.bits() == value[0].upload.bits()
    assert_same(dict(back[0].upload.extras), dict(value[0].upload.extras))
    assert back[1].accuracy == 0.5 and back[1].loss != back[1].loss
    config = RunConfig(algorithm="fedavg", clients=3, algorithm_settings={"mu": 0.1})
    assert decode(encode({"config": config, "state": None}), "cpu")["config"] == config


@pytest.mark.parametrize("gadget", ["os.system", "builtins.eval", "a class not allowed"])
def test_a_payload_carrying_a_pickled_callable_is_refused_and_nothing_runs(tmp_path, gadget):
    import io

    import torch

    from pfl_algorithms.engine.distributed import decode

    marker = tmp_path / "pwned"

    class _Eval:
        def __reduce__(self):
            return eval, (f"open({str(marker)!r}, 'w')",)

    value = {"os.system": _RunsCode(marker), "builtins.eval": _Eval(),
             "a class not allowed": torch.nn.Identity()}[gadget]
    buffer = io.BytesIO()
    torch.save([_train_result()[0], {"x": value}], buffer)
    with pytest.raises(ValueError, match="refusing the payload from rank 1: it holds something other than") as error:
        decode(buffer.getvalue(), "cpu", "rank 1")
    assert "\n" not in str(error.value)
    assert not marker.exists()
    with pytest.raises(ValueError, match="refusing the payload from a peer"):
        decode(b"not a payload", "cpu")


_GATHER_SCRIPT = textwrap.dedent("""
    import os, sys, json, torch, torch.distributed as dist
    from pfl_algorithms.engine.distributed import all_gather, broadcast_from_leader
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gathered = all_gather({"rank": rank, "t": torch.full((rank + 1,), float(rank))}, "cpu")
    start = broadcast_from_leader({"config": "from rank 0", "n": 7} if rank == 0 else None)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "gathered": [[g["rank"], g["t"].tolist()] for g in gathered], "start": start}, f)
    dist.destroy_process_group()
""")


def test_all_gather_and_broadcast_between_two_processes(tmp_path):
    script = tmp_path / "gather.py"
    script.write_text(_GATHER_SCRIPT)
    finish(start(torchrun(2, str(script), str(tmp_path))))
    lines = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for line in lines:
        assert line["gathered"] == [[0, [0.0]], [1, [1.0, 1.0]]]
        assert line["start"] == {"config": "from rank 0", "n": 7}
