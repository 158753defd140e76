"""FedDAF's baselines: target-only's silence; then a few rounds on digits ``fda`` (the target's
loss goes down, the state stays finite, kill -9 and --resume is bitwise)."""
from __future__ import annotations

import math

import pytest
import torch

from pfl_algorithms.algorithms.target_only import TargetOnly
from pfl_algorithms.engine.rounds import run_round
from tests.algorithms.test_kill_resume import assert_kill_resume_bitwise

from .federation_cases import make_federation
from .test_baselines import batches_of, row, sgd_steps

TOL = dict(rtol=1e-12, atol=1e-12)
TARGET = 2  # make_federation's target for algorithms that need roles: the last of 3 clients


def rows(fed):
    return torch.stack([row(fed, k) for k in range(fed.num_clients)])


# ---------------------------------------------------------------- target-only


def test_target_only_sends_nothing_and_only_the_target_trains():
    algo = TargetOnly(target_lr=0.05)
    fed = make_federation(algo, steps=2)
    before = rows(fed).clone()
    want = sgd_steps(fed, TARGET, before[TARGET], batches_of(fed, TARGET, 0), lr=0.05)
    record = run_round(fed, algo, 0)
    assert fed.comm.total("up") == fed.comm.total("down") == 0
    assert torch.equal(rows(fed)[:TARGET], before[:TARGET])  # the sources did not move
    torch.testing.assert_close(row(fed, TARGET), want, **TOL)
    assert math.isnan(record.train_loss[0]) and math.isnan(record.train_loss[1])  # no batch at all
    assert math.isfinite(record.train_loss[TARGET])


def test_settings_and_roles_are_checked():
    for cls, bad, key in ((TargetOnly, {"target_lr": 0.0}, "target_lr"),
                          (TargetOnly, {"target_batch_size": 0}, "target_batch_size")):
        with pytest.raises(ValueError, match=key):
            cls(**bad)
    from pfl_algorithms.config import RunConfig, check
    for name in ("target-only",):
        with pytest.raises(ValueError, match="needs clients with the roles source, target.*--scenario fda"):
            check(RunConfig(algorithm=name, scenario="dirichlet"))
    with pytest.raises(ValueError, match="exactly one target"):
        make_federation(TargetOnly(), roles={"source": [0], "target": [1, 2]})


# ---------------------------------------------------------------- digits fda, end to end

ROUNDS = 4


def assert_finite(state, path="state"):
    if isinstance(state, torch.Tensor):
        assert not state.is_floating_point() or torch.isfinite(state).all(), path
    elif isinstance(state, dict):
        for key, value in state.items():
            assert_finite(value, f"{path}.{key}")


@pytest.mark.parametrize("algorithm", ["target-only"])
def test_digits_fda_target_loss_goes_down_and_kill_9_resume_is_bitwise(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    args = [algorithm, "--dataset", "digits", "--scenario", "fda", "--clients", "5", "--rounds", str(ROUNDS),
            "--quiet", "--set", "noise=0.6", "--set", "target_fraction=0.5"]
    reference, state = assert_kill_resume_bitwise(tmp_path, args, ROUNDS, kill_after=2)
    target = "4"
    losses = [m["train_loss"][target] for m in reference]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert_finite(state["federation"])
    assert_finite(state["algorithm"])
    if algorithm == "target-only":
        assert all(m["bits_up"] == m["bits_down"] == 0 for m in reference)
        assert all(math.isnan(m["train_loss"][k]) for m in reference for k in "0123")
