"""The settings of a run, from defaults, a TOML file and the command line, resolved and checked.

Precedence: defaults < config file < command-line flags < ``--set key=value``.  Wherever a
value comes from, ``check`` accepts it only if it has the type and range its setting declares
(see ``option_types``), and otherwise names the key in a one-line ValueError.  A ``--set``
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
from typing import Annotated, Any, Optional, Union

from .algorithms import ALGORITHMS
from .data import DATASETS, SCENARIOS
from .engine.conv_gemm import CHOICES as CONV_CHOICES
from .engine.executors import CHOICES as EXECUTOR_CHOICES
from .engine.optim import OPTIMIZERS, OptimizerSettings
from .models import MODELS
from .option_types import (NonNegativeFloat, NonNegativeInt, OneOf, PositiveFloat, PositiveInt, Range, check_options,
                           check_value, field_hints, keyword_hints)

# Scenarios where the classifier never leaves the client by default (the papers do so for
# fairness: a shared head cannot serve permuted label ids or different domains).
HEAD_LOCAL_SCENARIOS = ("permuted-iid", "permuted-dirichlet", "multi-domain")
OPTION_TABLES = ("algorithm_settings", "scenario_options", "dataset_options", "model_options")


@dataclass
class RunConfig:
    """Everything that defines a run (saved resolved as ``config.json`` in the run directory).

    Each field's type hint is its declaration: ``check`` accepts only values of that type
    and range (see ``option_types``)."""

    algorithm: str = "fedavg"
    dataset: str = "digits"
    scenario: str = "permuted-iid"
    model: str = "digits-cnn"
    # The defaults learn on the default data and model (digits, the digits CNN with GroupNorm):
    # 10 clients of about 144 training images, 9 steps of 16 per round (FedAvg 56.7% after 3
    # rounds; 20 clients, batches of 32 and no normalization stayed at chance).
    clients: PositiveInt = 10
    rounds: NonNegativeInt = 10
    # local_epochs, sample and momentum are None where they do not apply (with local_steps, with
    # clients_per_round, with another optimizer than SGD), and ``check`` records their defaults
    # where they do (1, 1.0, 0.9): a value given where it does not apply is refused, not
    # recorded and ignored, even when it equals the default.
    local_epochs: Optional[PositiveInt] = None  # 0 would train nothing yet still count the round's communication
    local_steps: Optional[PositiveInt] = None
    batch_size: PositiveInt = 16
    optimizer: Annotated[str, OneOf(tuple(OPTIMIZERS))] = "sgd"
    lr: Optional[PositiveFloat] = None  # None: the dataset's default_lr (0.05 on digits, see data.datasets)
    momentum: Optional[NonNegativeFloat] = None  # None: 0.9 with SGD, which alone takes it
    weight_decay: NonNegativeFloat = 0.0
    optimizer_state: Annotated[str, OneOf(("reset", "keep"))] = "reset"
    # The clients of a round: a fraction of all (1 and 1.0 alike mean all; None: all), or a count.
    sample: Optional[Annotated[float, Range(gt=0, le=1)]] = None
    clients_per_round: Optional[PositiveInt] = None  # a count; None: use sample
    eval_every: PositiveInt = 1
    # Evaluate only the clients with this role (fda: "target", the one client whose accuracy
    # FedDAF's tables report); None: every client.
    eval_role: Optional[str] = None
    checkpoint_every: PositiveInt = 1
    seed: Annotated[int, Range(ge=0, lt=2**64)] = 0  # torch.manual_seed takes [0, 2^64)
    device: str = "cpu"
    # Where client tasks run; None: threaded on a CPU, batched on CUDA (``engine.executors``).
    executor: Optional[Annotated[str, OneOf(EXECUTOR_CHOICES)]] = None
    workers: Optional[PositiveInt] = None  # tasks at once for the threaded executor (None: one per core)
    chunk_clients: Optional[PositiveInt] = None  # clients per chunk of the batched executor (None: from free memory)
    autocast: Optional[Annotated[str, OneOf(("bf16",))]] = None  # bf16: the training forward under bfloat16 autocast
    cuda_graphs: bool = True  # on CUDA, plain training steps replay as CUDA graphs (engine.step_graphs)
    # How the batched executor runs per-client convolutions (engine.conv_gemm): grouped or gemm.
    batched_conv: Annotated[str, OneOf(CONV_CHOICES)] = "grouped"
    data_root: Optional[str] = None  # None: $PFL_DATA_ROOT, else ./data
    augment: Optional[str] = None  # training-batch augmentation, e.g. "crop,flip" (see `pfl list`)
    samples_per_client: Optional[PositiveInt] = None
    keep_head_local: Optional[bool] = None  # None: True in HEAD_LOCAL_SCENARIOS
    finetune_epochs: Optional[NonNegativeInt] = None  # None: the algorithm's own (0; fedavg-ft: 1)
    algorithm_settings: dict = field(default_factory=dict)
    scenario_options: dict = field(default_factory=dict)
    dataset_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)

    def head_local(self) -> bool:
        return self.scenario in HEAD_LOCAL_SCENARIOS if self.keep_head_local is None else self.keep_head_local

    def finetune(self) -> int:
        """Epochs each client fine-tunes before evaluation (``finetune_epochs``, else the
        algorithm's default)."""
        if self.finetune_epochs is not None:
            return self.finetune_epochs
        return ALGORITHMS[self.algorithm].finetune_epochs

    def optimizer_settings(self) -> OptimizerSettings:
        """The clients' optimizer (``EngineSettings.optimizer``): ``momentum`` is SGD's (0.9
        where not given); ``check`` refuses it for the other optimizers."""
        momentum = {"momentum": _or(self.momentum, DEFAULT_MOMENTUM)} if self.optimizer == "sgd" else {}
        return OptimizerSettings(self.optimizer, lr=self.client_lr(), weight_decay=self.weight_decay, **momentum)

    def epochs(self) -> Optional[int]:
        """Local epochs per round: ``local_epochs``, else 1; None with ``local_steps``."""
        return None if self.local_steps is not None else _or(self.local_epochs, 1)

    def sample_fraction(self) -> float:
        """The fraction of clients drawn each round: ``sample``, else 1 (every client; with
        ``clients_per_round`` the count decides)."""
        return _or(self.sample, 1.0)

    def client_lr(self) -> float:
        """``lr``, else the dataset's default (``DatasetSpec.default_lr``)."""
        return DATASETS[self.dataset].default_lr if self.lr is None else self.lr

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT_MOMENTUM = 0.9  # SGD's momentum where a run gives none


def _or(value, default):
    return default if value is None else value


def _valid(kind: str, name, registry: dict) -> None:
    if not isinstance(name, str) or name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")


def option_hints(table: str, owner: str) -> dict:
    """The declared type of every option of ``owner`` (an algorithm, scenario, dataset or
    model name, after ``_valid``), by ``table`` prefix."""
    if table == "algorithm":
        return field_hints(ALGORITHMS[owner].Settings)
    if table == "scenario":
        return SCENARIOS[owner].hints
    if table == "dataset":
        return keyword_hints(DATASETS[owner].loader)
    return keyword_hints(MODELS[owner].builder)


# TOML-like words a --set value may use besides Python literals: nan and inf are numbers
# here so that ``--set alpha=nan`` is refused as a number out of range, not as a word.
_WORDS = {"true": True, "false": False, "none": None, "null": None, "nan": float("nan"), "inf": float("inf"),
          "+inf": float("inf"), "-inf": float("-inf")}


def parse_value(text: str) -> Any:
    """A ``--set`` value: a Python/TOML-like literal (numbers, true/false, none, nan, inf,
    lists), else the string itself."""
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def apply_sets(config: RunConfig, assignments: list[str]) -> None:
    """Route ``key=value`` assignments (``--set``) to the right table of ``config``
    (``check`` then validates the values)."""
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
        "algorithm": ("algorithm_settings", set(option_hints("algorithm", config.algorithm)), config.algorithm),
        "scenario": ("scenario_options", set(SCENARIOS[config.scenario].defaults) - {"samples_per_client"},
                     config.scenario),
        "dataset": ("dataset_options", set(DATASETS[config.dataset].defaults), config.dataset),
        "model": ("model_options", set(MODELS[config.model].defaults), config.model),
    }


def load_config_file(path: Union[str, Path]) -> dict:
    """The tables of a TOML config file (``.toml``) or a resolved ``config.json``.

    Raises:
        ValueError: naming the file, when it is missing, unreadable or not valid TOML/JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        else:
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the backport, a dependency there (pyproject.toml)
                import tomli as tomllib

            with path.open("rb") as f:
                values = tomllib.load(f)
    except OSError as error:
        raise ValueError(f"config file {str(path)!r} cannot be read: {error.strerror or error}") from error
    except ValueError as error:  # TOMLDecodeError, JSONDecodeError and UnicodeDecodeError are ValueErrors
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ValueError(f"config file {str(path)!r} is not valid {kind}: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a table of settings, not a {type(values).__name__}")
    return values


def config_from(values: dict) -> RunConfig:
    """A RunConfig from a dict of its fields (unknown keys raise, listing the valid ones;
    ``check`` validates the values)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; valid: {', '.join(sorted(fields))}")
    tables = {}
    for table in OPTION_TABLES:
        if table in values:
            tables[table] = dict(check_value(table, values[table], dict))
    return RunConfig(**{**values, **tables})


# Fields whose values do not change a run's numbers, so runs that differ only in them are
# the same experiment (``pfl compare`` pools them): where the data files are read from; where
# and how many client tasks run at once (each runs on one intra-op thread, so every executor
# and worker count gives bitwise the same run, see engine.executors); how often a checkpoint
# is written (a resumed run is bitwise the same).  ``seed`` is left out too, since the seeds
# are what an experiment is repeated over.
# ``cuda_graphs`` replays the same kernels (the sequential executor's captured Adam differs from
# its host step by float rounding, as the batched executor's reassociation does), and so does
# ``batched_conv`` (the same convolutions, summed in another order).
NOT_IN_IDENTITY = ("seed", "data_root", "executor", "workers", "chunk_clients", "checkpoint_every", "cuda_graphs",
                   "batched_conv")


def with_defaults(saved: dict) -> dict:
    """A saved config (``config.json``, a checkpoint's) with the fields it lacks at their
    defaults, as JSON values: a field added to RunConfig since the run was made (``autocast``,
    ``chunk_clients``) behaved then as its default does now.  A config saved before
    local_epochs, sample and momentum were None where they do not apply recorded their old
    defaults there (1, 1.0, 0.9), which nothing read: they read as None."""
    config = {**json.loads(json.dumps(dataclasses.asdict(RunConfig()))), **saved}
    for name, old_default, unused in _UNUSED_OLD_DEFAULTS:
        if config[name] == old_default and unused(config):
            config[name] = None
    return config


_UNUSED_OLD_DEFAULTS = (("local_epochs", 1, lambda c: c["local_steps"] is not None),
                        ("sample", 1.0, lambda c: c["clients_per_round"] is not None),
                        ("momentum", DEFAULT_MOMENTUM, lambda c: c["optimizer"] != "sgd"))


def _record_applied_defaults(config: RunConfig) -> None:
    """local_epochs, sample and momentum at their defaults where they apply, so that
    config.json records what the run does (as ``lr``); None where they do not."""
    config.local_epochs = config.epochs()
    if config.clients_per_round is None:
        config.sample = config.sample_fraction()
    if config.optimizer == "sgd":
        config.momentum = _or(config.momentum, DEFAULT_MOMENTUM)


def check(config: RunConfig) -> RunConfig:
    """Validate every field and option against its declared type and range (the message
    names the key), the names against their registries, and conflicting settings; values are
    normalized in place (an int given for a float becomes a float).  Returns ``config``."""
    for name, hint in field_hints(RunConfig).items():
        setattr(config, name, check_value(name, getattr(config, name), hint))
    owners = _owners(config)
    for table, (attr, names, owner) in owners.items():
        options = getattr(config, attr)
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"{table} {owner!r} has no setting {unknown}; valid: {', '.join(sorted(names)) or 'none'}")
        setattr(config, attr, check_options(table, options, option_hints(table, owner)))
    config.lr = config.client_lr()  # the dataset's default made explicit, so config.json records it
    if config.local_steps is not None and config.local_epochs is not None:
        raise ValueError("local_steps and local_epochs conflict: give one of them "
                         f"(local_steps={config.local_steps}, local_epochs={config.local_epochs})")
    if config.clients_per_round is not None and config.clients_per_round > config.clients:
        raise ValueError(f"clients_per_round={config.clients_per_round} but only clients={config.clients}")
    if config.clients_per_round is not None and config.sample is not None:
        # clients_per_round decides the cohort: a sample would be recorded and ignored
        raise ValueError("sample and clients_per_round conflict: give one of them "
                         f"(sample={config.sample}, clients_per_round={config.clients_per_round})")
    if config.optimizer != "sgd" and config.momentum is not None:
        # optimizer_settings passes momentum to SGD only: another value would be recorded and ignored
        raise ValueError(f"momentum is SGD's; optimizer {config.optimizer!r} does not take it "
                         f"(got momentum={config.momentum}); leave it out")
    _record_applied_defaults(config)
    _check_executor_options(config)
    config.optimizer_settings()  # raises on settings the optimizer refuses
    if config.data_root is not None and not Path(config.data_root).expanduser().is_dir():
        # a data root you name must exist (a typo would read the installed packages, or digits)
        raise ValueError(f"data_root {config.data_root} is not a directory")
    ALGORITHMS[config.algorithm].check_config(config)
    _check_scenario_values(config)
    _check_architectures(config)
    _check_validation_split(config)
    _check_samples_per_client(config)
    _check_roles(config)
    _check_head(config)
    _bound_embeddings(config)
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


# The client roles each scenario gives (``Partition.roles``).
SCENARIO_ROLES = {"fda": ("source", "target")}


def _bound_embeddings(config: RunConfig) -> None:
    """``Capabilities.bounded_embeddings``: on one architecture, the model's embedding takes
    'sigmoid' unless the run names an activation, made explicit here so config.json records it
    (a mixed federation's models get it in ``models.heterogeneous``).  Why, for Fed-CMA: with
    the models' ReLU the alignment term drove `pfl run fedcma --dataset digits --scenario
    dirichlet --rounds 5` down to 54.8%, against 72.1% with sigmoid (one seed)."""
    from .models.heterogeneous import EMBEDDING_BOUND

    one_architecture = config.scenario_options.get("architectures") is None
    if (ALGORITHMS[config.algorithm].capabilities.bounded_embeddings and one_architecture
            and "embedding_activation" in MODELS[config.model].defaults):
        config.model_options.setdefault("embedding_activation", EMBEDDING_BOUND)


def _check_roles(config: RunConfig) -> None:
    """An algorithm that needs client roles (FedDAF's source and target) refuses a scenario
    that does not give them; so does ``eval_role``."""
    given = SCENARIO_ROLES.get(config.scenario, ())
    if config.eval_role is not None and config.eval_role not in given:
        raise ValueError(f"eval_role={config.eval_role!r}: scenario {config.scenario!r} gives "
                         + (f"the roles {', '.join(given)}" if given else "no client roles")
                         + "; expected one of them or none (evaluate every client)")
    needed = ALGORITHMS[config.algorithm].capabilities.roles
    missing = [r for r in needed if r not in given]
    if missing:
        givers = [name for name, roles in SCENARIO_ROLES.items() if set(needed) <= set(roles)]
        raise ValueError(f"{config.algorithm!r} needs clients with the roles {', '.join(needed)}, which scenario "
                         f"{config.scenario!r} does not give; use --scenario {' or '.join(givers)}")


def _check_head(config: RunConfig) -> None:
    """An algorithm that shares the classifier head refuses a run that keeps it local, and one
    that keeps it local by definition refuses ``keep_head_local=False`` (``Capabilities.head``)."""
    head = ALGORITHMS[config.algorithm].capabilities.head
    if head == "shared" and config.head_local():
        why = ("keep_head_local=True" if config.keep_head_local else
               f"scenario {config.scenario!r} keeps it local by default")
        raise ValueError(f"{config.algorithm!r} shares the classifier head, but this run keeps it local ({why}); "
                         "run it with --keep-head-local false")
    if head == "local" and config.keep_head_local is False:
        raise ValueError(f"{config.algorithm!r} keeps the classifier head local by definition: keep_head_local=False "
                         "conflicts with it")


def _check_validation_split(config: RunConfig) -> None:
    """An algorithm that reads the clients' validation splits (``needs_validation``) refuses a
    split without one."""
    from .data.scenarios import check_split

    if not ALGORITHMS[config.algorithm].capabilities.needs_validation:
        return
    split = config.scenario_options.get("split", SCENARIOS[config.scenario].defaults["split"])
    if check_split(split, "scenario.split")[1] <= 0:
        raise ValueError(f"scenario.split={tuple(split)} leaves no validation split, but {config.algorithm!r} "
                         "reads each client's validation split: give it a fraction > 0")


def _check_samples_per_client(config: RunConfig) -> None:
    """A ``samples_per_client`` so small that the split leaves a client's train, validation or
    test split empty (a test split: nothing to measure accuracy on) is refused, naming the
    minimum (3 for the default split); a scenario's official test set is not split."""
    from .data.scenarios import check_split, split_sizes

    n = config.samples_per_client
    options = {**SCENARIOS[config.scenario].defaults, **config.scenario_options}
    if n is None or options.get("official_split"):
        return
    split = check_split(options["split"], "scenario.split")

    def empty(k: int) -> list[str]:
        return [name for name, fraction, size in zip(("train", "validation", "test"), split, split_sizes(k, split))
                if fraction > 0 and size == 0]

    missing = empty(n)
    if missing:
        minimum = next(k for k in range(n + 1, n + 100) if not empty(k))
        raise ValueError(f"--samples-per-client {n} is too small: scenario.split {tuple(split)} leaves each client's "
                         f"{' and '.join(missing)} split empty"
                         + (" (no test samples: no accuracy to measure)" if "test" in missing else "")
                         + f"; the minimum is {minimum}")


def _check_architectures(config: RunConfig) -> None:
    """A mixed federation (option ``architectures`` with two or more models) needs an algorithm
    that shares only the classifier: refuse the others, naming the algorithm and the cohorts."""
    architectures = config.scenario_options.get("architectures")
    if architectures is None:
        return
    entries = [architectures] if isinstance(architectures, str) else list(architectures)
    algorithm = ALGORITHMS[config.algorithm]
    if len(set(entries)) < 2 or algorithm.capabilities.mixed_architectures:
        return
    cohorts = {}
    for client in range(config.clients):  # client k gets entries[k % len(entries)] (data/scenarios.py)
        cohorts.setdefault(entries[client % len(entries)], []).append(client)
    named = "; ".join(f"{entry!r}: clients {', '.join(map(str, ids[:4]))}{', ...' if len(ids) > 4 else ''}"
                      for entry, ids in cohorts.items())
    allowed = sorted(n for n, cls in ALGORITHMS.items() if cls.capabilities.mixed_architectures)
    raise ValueError(f"{config.algorithm!r} trains one architecture on every client (it shares more than the "
                     f"classifier), but architectures gives {len(cohorts)} cohorts ({named}); use one architecture, "
                     f"or an algorithm that shares only the classifier: {', '.join(allowed)}")


def _check_executor_options(config: RunConfig) -> None:
    """An option of executors other than the one named is refused, not recorded and ignored:
    ``workers`` (threaded, batched, distributed), ``chunk_clients`` and ``batched_conv``
    (batched).  With no executor named (the device decides) every option may apply."""
    executor = config.executor
    if executor in (None, "auto"):
        return
    ignored = options_unused_by(config, executor)
    if ignored:
        raise ValueError(f"{ignored[0]} has no effect with executor={executor!r}; leave it out or choose an "
                         "executor that uses it")


def options_unused_by(config: RunConfig, executor: str) -> list[str]:
    """The executor options ``config`` gives (``name=value``) that ``executor`` does not use:
    ``workers`` is the threaded, batched and distributed executors', ``chunk_clients`` and
    ``batched_conv`` (other than its default) the batched executor's."""
    return [f"{name}={value}" for name, value, users in (
        ("workers", config.workers, ("threaded", "batched", "distributed")),
        ("chunk_clients", config.chunk_clients, ("batched",)),
        ("batched_conv", None if config.batched_conv == RunConfig.batched_conv else config.batched_conv, ("batched",)))
        if value is not None and executor not in users]


def _check_scenario_values(config: RunConfig) -> None:
    """What the scenario options' types cannot say: fractions that sum to 1, architecture
    entries that parse and whose options are of their model's declared types, no option
    given where it has no effect (before any data is loaded)."""
    from .data.scenarios import check_split, refuse_idle_options
    from .models.heterogeneous import parse_architecture

    refuse_idle_options(config.scenario, config.scenario_options)

    for key in ("split", "target_split"):
        if key in config.scenario_options:
            check_split(config.scenario_options[key], f"scenario.{key}")
    architectures = config.scenario_options.get("architectures")
    if architectures is not None:
        for entry in [architectures] if isinstance(architectures, str) else list(architectures):
            name, options = parse_architecture(entry)
            hints = option_hints("model", name)
            unknown = sorted(set(options) - set(hints))
            if unknown:
                raise ValueError(f"architectures entry {entry!r}: model {name!r} has no option {unknown}; "
                                 f"valid: {', '.join(sorted(hints)) or 'none'}")
            check_options(f"architectures entry {entry!r}: {name}", options, hints)
