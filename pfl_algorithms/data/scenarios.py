"""Scenarios: how a pooled dataset is dealt out to clients (partitioners), by name.

Every scenario is deterministic for its seed (one ``torch.Generator``, never the global
RNG), gives clients disjoint samples (each sample used at most once) and splits each
client's share into train/val/test.  Options shared by all scenarios:

- ``split`` = (train, val, test) fractions, default (0.8, 0.1, 0.1) as the released
  Factorized-FL code.  A client with n samples gets round(test·n) test and round(val·n)
  validation samples (round half up), the rest for training; a client with n >= 3 samples
  gets at least one sample in every split whose fraction is > 0 (taken from the others).
  The split is random within the client (not stratified by class).
- ``samples_per_client``: None, or a cap on each client's share (its first ones in a seeded
  random order), for CPU-sized runs.  A client holding fewer samples keeps them all, with a
  ``ShortShareWarning``.  (``run_data.load_run_data`` also sizes synthetic data so that every
  client gets that many.)
- ``architectures``: None, or a list of model names (Fed-CMA's model heterogeneity): client
  k gets ``architectures[k % len(architectures)]``, recorded in the manifest.  The models
  must end in the same embedding size (``models.build_client_models`` checks it).

Scenario-specific options are in ``SCENARIOS[name].defaults`` (their declared types in
``SCENARIOS[name].hints``: the common ones below, the others the keyword-only parameters of
the scenario's function) and the docstrings of
``label_skew.py``, ``multi_domain.py``, ``fda.py`` and ``natural.py``.  Scenarios that shift
inputs (feature-shift domains, fda's noisy target) record the shifts in the partition;
``Partition.apply_transforms(dataset)`` gives the inputs the clients see.  An option given
where it has no effect is refused (``refuse_idle_options``): fda's ``alpha``, ``min_samples``
and ``target_share`` with a ``target_domain``; multi-domain's ``shifts`` outside
``domains='feature-shift'`` and its ``min_samples`` without ``alpha``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .datasets import ArrayDataset
from .deal import ClientDeal, Deal
from .fda import fda
from .label_skew import dirichlet, iid, pathological
from .multi_domain import DEFAULT_SHIFTS, multi_domain
from .natural import natural
from ..option_types import PositiveInt, SplitFractions, keyword_hints
from .partition import ClientSplit, Partition

COMMON_DEFAULTS = {"split": (0.8, 0.1, 0.1), "samples_per_client": None, "architectures": None}
COMMON_HINTS = {"split": SplitFractions, "samples_per_client": Optional[PositiveInt],
                "architectures": Union[None, str, Sequence[str]]}


class ShortShareWarning(UserWarning):
    """``samples_per_client`` asks for more samples than some client holds."""


@dataclass(frozen=True)
class ScenarioSpec:
    """A registered scenario.

    Attributes:
        name: registry key.  description: one line for ``pfl list``.
        fn: ``fn(dataset, num_clients, generator, **specific) -> Deal``: each client's
            (shuffled) indices before the train/val/test split, and what it records.
        defaults: every option it accepts (common ones included) and its default.
        idle: ``idle(resolved options) -> {option: why}``: the options that have no effect at
            these settings (e.g. fda's ``alpha`` with a ``target_domain``); one the caller
            gives is refused, so that partition.json never records a setting that did nothing.
    """

    name: str
    description: str
    fn: Callable[..., Deal]
    defaults: dict = field(default_factory=dict)
    idle: Callable[[dict], dict] = lambda options: {}

    @property
    def hints(self) -> dict:
        """The declared type of every option (see ``option_types``)."""
        return {**COMMON_HINTS, **keyword_hints(self.fn)}


def _label_skew(partitioner, permute_labels: bool):
    """A label-skew partitioner (``label_skew.py``) as a scenario function; with
    ``permute_labels`` every client (client 0 included) gets a uniformly random permutation
    of the class ids as its label map, drawn after the shares in client order."""
    def deal(dataset: ArrayDataset, num_clients: int, gen: torch.Generator, **options) -> Deal:
        shares = partitioner(dataset.labels.detach().cpu().to(torch.int64), dataset.num_classes, num_clients, gen,
                             **options)
        clients = [ClientDeal(share) for share in shares]
        if permute_labels:
            for client in clients:
                client.label_map = torch.randperm(dataset.num_classes, generator=gen)
        return Deal(clients)

    deal.__doc__ = partitioner.__doc__
    deal.__wrapped__ = partitioner  # so that its options' declared types are found
    return deal


def _spec(name, description, fn, idle=None, **specific) -> ScenarioSpec:
    return ScenarioSpec(name, description, fn, {**COMMON_DEFAULTS, **specific}, idle or (lambda options: {}))


def _fda_idle(options: dict) -> dict:
    """fda's options that do nothing: with a ``target_domain`` the sources are dealt evenly by
    class within their domains, and the target holds that domain."""
    if options["target_domain"] is None:
        return {}
    why = f"with target_domain={options['target_domain']!r} (its sources are dealt evenly by class in each domain)"
    return {"alpha": why, "min_samples": why, "target_share": why}


def _multi_domain_idle(options: dict) -> dict:
    """multi-domain's options that do nothing: ``shifts`` outside feature-shift domains, and
    ``min_samples`` without a Dirichlet ``alpha`` (the even split has no minimum to keep)."""
    idle = {}
    if options["domains"] != "feature-shift":
        idle["shifts"] = f"with domains={options['domains']!r} (only domains='feature-shift' shifts inputs)"
    if options["alpha"] is None:
        idle["min_samples"] = "without alpha (each domain is dealt evenly by class; min_samples is for Dirichlet shares)"
    return idle


SCENARIOS: dict[str, ScenarioSpec] = {spec.name: spec for spec in (
    _spec("iid", "each class dealt evenly over all clients", _label_skew(iid, False)),
    _spec("dirichlet", "label skew: per-class client shares drawn from Dirichlet(alpha)",
          _label_skew(dirichlet, False), alpha=0.5, min_samples=10),
    _spec("pathological", "each client holds exactly classes_per_client classes", _label_skew(pathological, False),
          classes_per_client=2, layout="cyclic"),
    _spec("permuted-iid", "iid plus a random permutation of class ids per client (label heterogeneity)",
          _label_skew(iid, True)),
    _spec("permuted-dirichlet", "dirichlet plus a random permutation of class ids per client",
          _label_skew(dirichlet, True), alpha=0.5, min_samples=10),
    _spec("multi-domain", "clients on different domains: a dataset's domains, CIFAR-100 superclasses, feature shifts",
          multi_domain, _multi_domain_idle, domains="dataset", shifts=DEFAULT_SHIFTS, alpha=None, min_samples=1, relabel=None,
          permute_labels=False),
    _spec("fda", "FedDAF: Dirichlet sources and one scarce, noisy or domain-shifted target (the last client)",
          fda, _fda_idle, alpha=1.0, min_samples=10, target_domain=None, noise=0.0, target_fraction=1.0,
          target_split=(0.2, 0.0, 0.8), target_share=None),
    _spec("natural", "one client per writer (FEMNIST), with the writers' official test samples",
          natural, min_samples=10, official_split=True),
)}


def refuse_idle_options(name: str, options: dict) -> None:
    """Refuse any of the given ``options`` of scenario ``name`` that has no effect at these
    settings (``ScenarioSpec.idle``): a setting partition.json records must be one that acted.

    Raises:
        ValueError: one line naming the first such option and why it does nothing.
    """
    idle = SCENARIOS[name].idle({**SCENARIOS[name].defaults, **options})
    given = [option for option in options if option in idle]
    if given:
        raise ValueError(f"scenario {name!r}: {given[0]} has no effect {idle[given[0]]}; leave it out")


def split_sizes(n: int, fractions) -> tuple[int, int, int]:
    """(train, val, test) sizes of a client with ``n`` samples; see the module docstring."""
    train_f, val_f, test_f = fractions
    need = [int(f > 0 and n >= 3) for f in fractions]
    round_half_up = lambda x: int(math.floor(x + 0.5))
    n_test = min(max(round_half_up(test_f * n), need[2]), n - need[0] - need[1])
    n_val = min(max(round_half_up(val_f * n), need[1]), n - need[0] - n_test)
    return n - n_val - n_test, n_val, n_test


def check_split(split, key: str = "split") -> tuple[float, float, float]:
    """``split`` as (train, val, test) fractions, after checking they are 3 finite numbers
    >= 0 that sum to 1 (ValueError naming ``key`` otherwise)."""
    try:
        fractions = tuple(float(f) for f in split) if not isinstance(split, (str, bytes)) else ()
    except (TypeError, ValueError):
        fractions = ()
    if (len(fractions) != 3 or not all(math.isfinite(f) and f >= 0 for f in fractions)
            or abs(sum(fractions) - 1) > 1e-6):
        raise ValueError(f"{key} must be 3 fractions >= 0 (train, val, test) summing to 1, got {split!r}")
    return fractions


def make_partition(name: str, dataset: ArrayDataset, num_clients: int, *, seed: int, **options) -> Partition:
    """Deal ``dataset`` out to ``num_clients`` clients with scenario ``name``.

    Args:
        name: a key of ``SCENARIOS``.
        dataset: the pooled dataset (its labels are read on the CPU).
        num_clients: K >= 1.
        seed: the only source of randomness; the same seed gives the same partition.
        options: see ``SCENARIOS[name].defaults`` and the module docstring.

    Returns:
        a ``Partition`` whose ``options`` hold every option with defaults filled in.  In the
        permuted scenarios every client (client 0 included) gets a uniformly random
        permutation of the class ids as its ``label_map``; multi-domain scenarios may relabel
        (see ``multi_domain.py``); elsewhere ``label_map`` is None.  Apply the partition's
        input shifts, if any, with ``partition.apply_transforms(dataset)``.

    Raises:
        ValueError: an unknown scenario or option (the message lists the valid ones), a bad
            option value, or a client left with no samples.

    Warns:
        ShortShareWarning: ``samples_per_client`` is more than some client holds.
    """
    partition, shares = partition_with_shares(name, dataset, num_clients, seed=seed, **options)
    warn_short_shares(partition.options["samples_per_client"], shares)
    return partition


def partition_with_shares(name: str, dataset: ArrayDataset, num_clients: int, *, seed: int,
                          **options) -> tuple[Partition, list[int]]:
    """``make_partition`` without its warning: (the partition, how many samples each client
    was dealt before the ``samples_per_client`` cap)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid scenarios: {sorted(SCENARIOS)}")
    spec = SCENARIOS[name]
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise ValueError(f"scenario {name!r} got unknown options {unknown}; valid options: {sorted(spec.defaults)}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}")
    if num_clients > len(dataset):  # before dealing: 10^8 clients hung building their lists
        raise ValueError(f"clients={num_clients} but {dataset.name} has {len(dataset)} samples: some client would get "
                         f"no samples")
    resolved = {**spec.defaults, **options}
    fractions = check_split(resolved["split"])
    resolved["split"] = fractions
    cap = resolved["samples_per_client"]
    if cap is not None and (isinstance(cap, bool) or int(cap) != cap or cap < 1):
        raise ValueError(f"samples_per_client must be None or a positive int, got {cap!r}")

    architectures = _check_architectures(resolved["architectures"])
    resolved["architectures"] = architectures
    refuse_idle_options(name, options)

    gen = torch.Generator().manual_seed(int(seed))
    specific = {k: v for k, v in resolved.items() if k not in COMMON_DEFAULTS}
    deal = spec.fn(dataset, int(num_clients), gen, **specific)

    clients = []
    for client, share in enumerate(deal.clients):
        clients.append(_split_client(name, client, share, fractions, cap, len(dataset), int(num_clients)))
        if architectures is not None:
            clients[-1].architecture = architectures[client % len(architectures)]
    # Noise seeds come from the same generator, after everything else, and are recorded.
    transforms = [{**t, "seed": int(torch.randint(0, 2**62, (1,), generator=gen))} for t in deal.transforms]
    partition = Partition(name, clients, dataset.num_classes, resolved, int(seed), dataset.name, len(dataset),
                          deal.output_classes, deal.domain_names, transforms, deal.info)
    return partition, [int(share.indices.numel()) for share in deal.clients]


def short_shares(cap, shares: list[int]) -> list[int]:
    """The clients dealt fewer than ``cap`` samples (none when ``cap`` is None)."""
    return [] if cap is None else [client for client, size in enumerate(shares) if size < cap]


def warn_short_shares(cap, shares: list[int]) -> None:
    """A ``ShortShareWarning`` when ``samples_per_client=cap`` exceeds some client's share."""
    short = short_shares(cap, shares)
    if short:
        fewest = min(short, key=lambda client: shares[client])
        warnings.warn(f"samples_per_client={cap} is more than {len(short)} of {len(shares)} clients hold (client "
                      f"{fewest} has {shares[fewest]}); they keep all their samples", ShortShareWarning, stacklevel=3)


def _split_client(scenario: str, client: int, share: ClientDeal, fractions, cap, num_samples: int,
                  num_clients: int) -> ClientSplit:
    """Cap, split and thin one client's share (see the module docstring and ``ClientDeal``)."""
    idx = share.indices if cap is None else share.indices[:cap]
    fixed_test = share.test
    if idx.numel() + (0 if fixed_test is None else fixed_test.numel()) == 0:
        raise ValueError(f"scenario {scenario!r} left client {client} with no samples "
                         f"({num_samples} samples, {num_clients} clients); use fewer clients")
    own = fractions if share.split is None else check_split(share.split, f"client {client}'s split")
    if fixed_test is not None:
        total = own[0] + own[1]
        own = (own[0] / total, own[1] / total, 0.0) if total > 0 else (1.0, 0.0, 0.0)
    n_train, n_val, n_test = split_sizes(idx.numel(), own)
    train, val, test = torch.split(idx, [n_train, n_val, n_test])
    if fixed_test is not None:
        test = fixed_test
    if share.keep_train < 1.0 and train.numel():
        train = train[:max(1, int(math.floor(share.keep_train * train.numel() + 0.5)))]
    return ClientSplit(train.clone(), val.clone(), test.clone(), share.label_map, share.domain)


def _check_architectures(value):
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = ()
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"architectures must be None or a non-empty list of model names, got {value!r}")
    return names
