"""``kill -9`` in the middle of a run, then ``--resume``: bitwise the run that was never killed,
for algorithms with extra client state (pFedMe's personal models) and phases with kept
optimizer states of their own (FedRep)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pfl_algorithms.engine.checkpoint import read_checkpoint
from tests.algorithms.state_checks import assert_same

# Two killed and resumed runs, about 40 s on 2 cores: scheduled early under xdist (tests/conftest.py),
# so that in the main+slow run of scripts/test.sh the file does not end the run alone.
pytestmark = pytest.mark.heavy(seconds=40)

ROUNDS = 8
ARGS = ["--dataset", "digits", "--clients", "6", "--rounds", str(ROUNDS), "--quiet"]
CASES = {"pfedme": ["--set", "inner_steps=2"], "fedrep": ["--set", "optimizer_state=keep", "--set", "head_epochs=1"]}


def pfl(*args) -> list[str]:
    return [sys.executable, "-m", "pfl_algorithms", "run", *args]


def metric_lines(out) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            break  # the line a kill cut
    return lines


@pytest.mark.slow  # end to end: a killed process, then a resumed one
@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_kill_9_then_resume_is_bitwise(tmp_path, algorithm):
    assert_kill_resume_bitwise(tmp_path, [algorithm, *ARGS, *CASES[algorithm]], ROUNDS)


def _same_runs(resumed_dir, whole_dir, rounds: int) -> tuple[list, dict]:
    """The metrics (but wall times) and final checkpoints of two run directories agree bit for
    bit over ``rounds`` rounds; returns the second's (metric lines, checkpoint)."""
    resumed, reference = metric_lines(resumed_dir), metric_lines(whole_dir)
    assert [r["round"] for r in resumed] == list(range(rounds))
    for a, b in zip(resumed, reference):
        a.pop("wall_s"), b.pop("wall_s")
        assert a == b
    final, want = read_checkpoint(resumed_dir / "checkpoint.pt"), read_checkpoint(whole_dir / "checkpoint.pt")
    assert_same(final["federation"], want["federation"])
    assert_same(final["algorithm"], want["algorithm"])
    return reference, want


def assert_kill_resume_bitwise(tmp_path, args: list[str], rounds: int, kill_after: int = 3) -> tuple[list, dict]:
    """``pfl run *args`` (an algorithm first, then options giving ``rounds`` rounds) once whole,
    once killed with SIGKILL after its ``kill_after``-th round and resumed: the same metrics and
    final checkpoint, bit for bit.  Returns the whole run's (metric lines, checkpoint)."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # The two runs go side by side (each pays torch's import once, at the same time): the
    # numbers cannot depend on it, every task runs on one intra-op thread.
    reference_run = subprocess.Popen(pfl(*args, "--out", str(whole)), stdout=subprocess.DEVNULL)
    process = subprocess.Popen(pfl(*args, "--out", str(killed)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while len(metric_lines(killed)) < kill_after and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert len(metric_lines(killed)) < rounds  # it really was killed mid-run
    assert reference_run.wait(timeout=600) == 0
    subprocess.run(pfl(args[0], "--out", str(killed), "--resume", "--quiet"), check=True, timeout=600,
                   stderr=subprocess.DEVNULL)
    assert not list(killed.glob(".*.tmp"))  # a write the kill cut short leaves nothing behind the resume
    return _same_runs(killed, whole, rounds)


def assert_resume_bitwise(tmp_path, args: list[str], rounds: int, stop_after: int = 2) -> tuple[list, dict]:
    """``pfl run *args`` (an algorithm first, then options giving ``rounds`` rounds) once whole,
    once stopped after its ``stop_after``-th round (what a kill right after that round's
    checkpoint leaves) and resumed with ``pfl run --resume`` in a fresh process, so nothing
    but the run directory carries over: the same metrics and final checkpoint, bit for bit.
    The first two runs go in this process (torch imported once); the real SIGKILL is
    :func:`assert_kill_resume_bitwise`'s.  Returns the whole run's (metric lines, checkpoint)."""
    from pfl_algorithms.cli import _parser, config_from_args
    from pfl_algorithms.runner import run

    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    config = lambda: config_from_args(_parser().parse_args(["run", *args]))  # noqa: E731
    run(config(), whole, progress=False)
    run(config(), stopped, progress=False, stop_after=stop_after)
    assert len(metric_lines(stopped)) == stop_after < rounds
    resumed = subprocess.run(pfl(args[0], "--out", str(stopped), "--resume", "--quiet"), timeout=600,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return _same_runs(stopped, whole, rounds)
