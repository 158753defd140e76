"""An algorithm defined outside the package, as a researcher writes one in their own module or
notebook: it registers itself, runs through ``runner.run`` with its settings, may be defined
again under the same name (a cell run twice, ``importlib.reload``), and a different class
under a taken name is refused."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.api import ALGORITHMS, Phase
from pfl_algorithms.runner import run
from tests.algorithms.test_cli import tiny_config

NAME = "test-own-prox"


@pytest.fixture(autouse=True)
def unregistered():
    yield
    ALGORITHMS.pop(NAME, None)


def define():
    """The README's FedProx, written outside the package."""
    @dataclass(frozen=True)
    class OwnSettings:
        mu: float = 0.01

    def proximal_term(mu):
        def proximal(view):
            total = 0.0
            for group in view.received():
                diff = view.group(group) - view.download.dense(group)
                view.grad(group).add_(diff, alpha=mu)
                total = total + diff.square().sum()
            return 0.5 * mu * total
        return proximal

    class OwnProx(FedAvg):
        name = NAME
        description = "FedAvg with a proximal term, defined in a test"
        Settings = OwnSettings

        def plan(self, client):
            return (Phase(grad_terms=(proximal_term(self.settings.mu),)),)

    return OwnProx


def test_an_algorithm_of_ones_own_registers_and_runs(tmp_path):
    own = define()
    assert ALGORITHMS[NAME] is own
    summary = run(tiny_config(algorithm=NAME, rounds=2, algorithm_settings={"mu": 0.5}), tmp_path / "r",
                  progress=False)
    assert 0 <= summary["final_mean_accuracy"] <= 1
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["algorithm"] == NAME and saved["algorithm_settings"] == {"mu": 0.5}
    with pytest.raises(ValueError, match=f"algorithm {NAME!r} has no setting \\['nu'\\]"):
        tiny_config(algorithm=NAME, algorithm_settings={"nu": 1.0})


def test_defining_it_again_replaces_it_and_another_class_is_refused():
    first = define()
    second = define()  # the same module and qualified name: a redefinition
    assert second is not first and ALGORITHMS[NAME] is second

    with pytest.raises(ValueError, match=f"two algorithms are named {NAME!r}: .*OwnProx and .*Other"):
        type("Other", (FedAvg,), {"name": NAME, "__module__": __name__})
    assert ALGORITHMS[NAME] is second
    with pytest.raises(ValueError, match="two algorithms are named 'fedavg'"):
        type("FedAvg", (FedAvg,), {"name": "fedavg", "__module__": __name__})
