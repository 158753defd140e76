"""The settings of a run, from defaults, a TOML file and the command line, resolved and checked.

Precedence: defaults < config file < command-line flags < ``--set key=value``.  A ``--set``
key is routed to whichever of the algorithm, the scenario, the dataset or the model has a
setting of that name (a name two of them share must be qualified, e.g.
``--set scenario.alpha=0.1``); an unknown key is an error listing the valid ones.

Config file layout (every table optional)::

    algorithm = "fedavg"          # any RunConfig field at the top level
    rounds = 20
    [algorithm_settings]          # or [scenario_options], [dataset_options], [model_options]
    mu = 0.01
"""
from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .algorithms import ALGORITHMS
from .data import DATASETS, SCENARIOS
from .models import MODELS

# Scenarios where the classifier never leaves the client by default (the papers do so for
# fairness: a shared head cannot serve permuted label ids or different domains).
HEAD_LOCAL_SCENARIOS = ("permuted-iid", "permuted-dirichlet", "multi-domain")
OPTION_TABLES = ("algorithm_settings", "scenario_options", "dataset_options", "model_options")


@dataclass
class RunConfig:
    """Everything that defines a run (saved resolved as ``config.json`` in the run directory)."""

    algorithm: str = "fedavg"
    dataset: str = "digits"
    scenario: str = "permuted-iid"
    model: str = "digits-cnn"
    clients: int = 20
    rounds: int = 10
    local_epochs: int = 1
    local_steps: Optional[int] = None
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer_state: str = "reset"
    sample: Union[float, int] = 1.0
    eval_every: int = 1
    checkpoint_every: int = 1
    seed: int = 0
    device: str = "cpu"
    workers: Optional[int] = None  # clients trained at once on CPU (None: one per core)
    data_root: Optional[str] = None  # None: $PFL_DATA_ROOT, else ./data
    augment: Optional[str] = None  # training-batch augmentation, e.g. "crop,flip" (see `pfl list`)
    samples_per_client: Optional[int] = None
    keep_head_local: Optional[bool] = None  # None: True in HEAD_LOCAL_SCENARIOS
    algorithm_settings: dict = field(default_factory=dict)
    scenario_options: dict = field(default_factory=dict)
    dataset_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)

    def head_local(self) -> bool:
        return self.scenario in HEAD_LOCAL_SCENARIOS if self.keep_head_local is None else self.keep_head_local

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _valid(kind: str, name: str, registry: dict) -> None:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")


def _settings_fields(algorithm: str) -> dict:
    cls = ALGORITHMS[algorithm].Settings
    return {f.name: f.default for f in dataclasses.fields(cls)}


def parse_value(text: str) -> Any:
    """A ``--set`` value: a Python/TOML-like literal (numbers, true/false, lists), else the string."""
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_sets(config: RunConfig, assignments: list[str]) -> None:
    """Route ``key=value`` assignments (``--set``) to the right table of ``config``."""
    for assignment in assignments:
        if "=" not in assignment:
            raise ValueError(f"--set expects key=value, got {assignment!r}")
        key, text = assignment.split("=", 1)
        key, value = key.strip(), parse_value(text.strip())
        run_fields = {f.name for f in dataclasses.fields(RunConfig)} - set(OPTION_TABLES)
        if key in run_fields:
            setattr(config, key, value)
            continue
        owners = _owners(config)
        if "." in key:
            table, name = key.split(".", 1)
            if table not in owners:
                raise ValueError(f"--set {key}: unknown prefix {table!r}; valid: {', '.join(owners)}")
            if name not in owners[table][1]:
                raise ValueError(f"--set {key}: {table} {owners[table][2]!r} has no setting {name!r}; "
                                 f"valid: {', '.join(sorted(owners[table][1])) or 'none'}")
            getattr(config, owners[table][0])[name] = value
            continue
        matches = [table for table, (_, names, _) in owners.items() if key in names]
        if not matches:
            valid = sorted(run_fields | {n for _, names, _ in owners.values() for n in names})
            raise ValueError(f"--set {key}: no setting of that name; valid: {', '.join(valid)}")
        if len(matches) > 1:
            raise ValueError(f"--set {key}: ambiguous between {', '.join(matches)}; write e.g. {matches[0]}.{key}")
        getattr(config, owners[matches[0]][0])[key] = value


def _owners(config: RunConfig) -> dict:
    """table prefix -> (attribute of RunConfig, accepted names, the owner's name)."""
    _valid("algorithm", config.algorithm, ALGORITHMS)
    _valid("scenario", config.scenario, SCENARIOS)
    _valid("dataset", config.dataset, DATASETS)
    _valid("model", config.model, MODELS)
    return {
        "algorithm": ("algorithm_settings", set(_settings_fields(config.algorithm)), config.algorithm),
        "scenario": ("scenario_options", set(SCENARIOS[config.scenario].defaults) - {"samples_per_client"},
                     config.scenario),
        "dataset": ("dataset_options", set(DATASETS[config.dataset].defaults), config.dataset),
        "model": ("model_options", set(MODELS[config.model].defaults), config.model),
    }


def load_config_file(path: Union[str, Path]) -> dict:
    """The tables of a TOML config file (``.toml``) or a resolved ``config.json``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    if path.suffix == ".json":
        return json.loads(path.read_text())
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)


def config_from(values: dict) -> RunConfig:
    """A RunConfig from a dict of its fields (unknown keys raise, listing the valid ones)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; valid: {', '.join(sorted(fields))}")
    config = RunConfig(**{k: (dict(v) if k in OPTION_TABLES else v) for k, v in values.items()})
    return config


def check(config: RunConfig) -> RunConfig:
    """Validate names, option names and conflicting settings; returns ``config``."""
    owners = _owners(config)
    for table, (attr, names, owner) in owners.items():
        unknown = sorted(set(getattr(config, attr)) - names)
        if unknown:
            raise ValueError(f"{table} {owner!r} has no setting {unknown}; valid: {', '.join(sorted(names)) or 'none'}")
    for name in ("clients", "batch_size", "eval_every", "checkpoint_every"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(config.rounds, bool) or not isinstance(config.rounds, int) or config.rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0, got {config.rounds!r}")
    if config.local_steps is not None and config.local_epochs != RunConfig.local_epochs:
        raise ValueError("local_steps and local_epochs conflict: give one of them "
                         f"(local_steps={config.local_steps}, local_epochs={config.local_epochs})")
    if isinstance(config.sample, int) and not isinstance(config.sample, bool) and config.sample > config.clients:
        raise ValueError(f"sample={config.sample} clients per round but only clients={config.clients}")
    if config.algorithm == "fedper" and config.keep_head_local is False:
        raise ValueError("fedper keeps the head local by definition: keep_head_local=False conflicts with it")
    architectures = config.scenario_options.get("architectures")
    if architectures is not None:
        from .models.heterogeneous import parse_architecture

        for entry in [architectures] if isinstance(architectures, str) else list(architectures):
            parse_architecture(entry)
    if config.augment is not None:
        from .data.augment import make_augmentation

        make_augmentation(config.augment, mean=None, std=None)  # raises on a bad spec
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} was asked for but torch sees no CUDA device")
    elif config.device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {config.device!r}")
    return config
