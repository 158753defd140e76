"""Algorithm modules use only the public contract (``pfl_algorithms.api``), never engine internals."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import pfl_algorithms.algorithms as package
from pfl_algorithms.algorithms import ALGORITHMS

ALGORITHM_FILES = sorted(p for p in Path(package.__file__).parent.glob("*.py") if p.name != "__init__.py")
THIRD_PARTY = {"torch", "pfl_kernels", "numpy"}


def contract_violations(source: str, filename: str = "<module>") -> list[str]:
    """The imports of an algorithm module that reach past the contract: anything of
    ``pfl_algorithms`` other than ``api`` and sibling algorithm modules, and any third-party
    package other than torch, numpy and pfl_kernels."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # a sibling algorithm module
                continue
            if node.level == 2:
                if module != "api":
                    bad.append(f"from {'.' * node.level}{module} import ...")
                continue
            if node.level > 2:
                bad.append(f"from {'.' * node.level}{module} import ...")
                continue
            names = [module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name == "pfl_algorithms.api" or name.startswith("pfl_algorithms.algorithms"):
                continue
            if top == "pfl_algorithms" or not (top in THIRD_PARTY or top in sys.stdlib_module_names):
                bad.append(f"import {name}")
    return bad


@pytest.mark.parametrize("path", ALGORITHM_FILES, ids=lambda p: p.name)
def test_algorithm_modules_import_only_the_contract(path):
    assert contract_violations(path.read_text(), str(path)) == []


@pytest.mark.parametrize("line", [
    "from ..engine.federation import Federation",
    "from ..engine import client",
    "import pfl_algorithms.engine.rounds",
    "from pfl_algorithms.engine.bank import ClientBank",
    "from ..data import load_dataset",
    "from ...pfl_algorithms import engine",
    "import sklearn",
])
def test_the_check_catches_engine_imports(line):
    assert contract_violations(f"from ..api import Algorithm\n{line}\n") != []


def test_every_module_registers_what_it_defines():
    names = {cls.__module__.rsplit(".", 1)[1] for cls in ALGORITHMS.values()}
    assert names == {p.stem for p in ALGORITHM_FILES}


def test_prepare_model_gives_the_trained_model():
    """An algorithm's prepare_model replaces each cohort's template before banks and groups
    exist: here every Linear is factorized, so the bank holds u, v and mu, not the weights."""
    from pfl_algorithms.algorithms.fedavg import FedAvg
    from pfl_algorithms.engine.rounds import run_round
    from pfl_kernels.nn import FactorizedLinear, factorize
    from tests.algorithms.algorithms.federation_cases import make_federation

    class FactorizedFedAvg(FedAvg):
        def prepare_model(self, model):
            return factorize(model, rank=1)

    algorithm = FactorizedFedAvg()
    fed = make_federation(algorithm)
    module = fed.cohorts[0].module
    assert isinstance(module.head, FactorizedLinear)
    names = [name for name, _ in module.named_parameters()]
    assert any(name.endswith(".u") for name in names) and not any(name.endswith(".weight") for name in names)
    before = fed.cohorts[0].params.data.clone()
    run_round(fed, algorithm, 0)
    after = fed.cohorts[0].params.data
    assert torch.isfinite(after).all() and not torch.equal(before, after)


def test_prepare_model_must_return_a_module():
    from pfl_algorithms.algorithms.fedavg import FedAvg
    from tests.algorithms.algorithms.federation_cases import make_federation

    class Broken(FedAvg):
        def prepare_model(self, model):
            return None

    with pytest.raises(TypeError, match="prepare_model must return an nn.Module"):
        make_federation(Broken())


# ---------------------------------------------------------------- the head rule, declared


@pytest.mark.parametrize("algorithm, head", [("fedavg-classifier", "shared"), ("fedcma", "shared"),
                                             ("fedgen", "shared"), ("fedper", "local"), ("fedrep", "local"),
                                             ("pfedhn-pc", "local"), ("fedavg", None), ("pfedhn", None)])
def test_the_head_rule_is_a_declaration_checked_in_one_place(algorithm, head):
    """``Capabilities.head`` says whether an algorithm shares the classifier or keeps it local;
    ``config.check`` alone refuses a run that contradicts it, in one line naming the setting."""
    from pfl_algorithms.algorithms import ALGORITHMS
    from pfl_algorithms.config import RunConfig, check

    assert ALGORITHMS[algorithm].capabilities.head == head
    assert "check_config" not in vars(ALGORITHMS[algorithm])  # no rule of its own beside the declaration
    ok = dict(algorithm=algorithm, scenario="dirichlet")
    check(RunConfig(**ok))
    refused = {"shared": [dict(ok, keep_head_local=True), dict(algorithm=algorithm, scenario="permuted-iid")],
               "local": [dict(ok, keep_head_local=False)], None: []}[head]
    for values in refused:
        with pytest.raises(ValueError, match="keep_head_local=(True|False)|keeps it local by default") as error:
            check(RunConfig(**values))
        assert "\n" not in str(error.value) and repr(algorithm) in str(error.value)
    if head is None:
        for keep in (True, False):
            check(RunConfig(**ok, keep_head_local=keep))
