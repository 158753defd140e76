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
  random order), for synthetic data and CPU-sized runs.

Scenario-specific options are in ``SCENARIOS[name].defaults``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .datasets import ArrayDataset
from .partition import ClientSplit, Partition

COMMON_DEFAULTS = {"split": (0.8, 0.1, 0.1), "samples_per_client": None}
MAX_DIRICHLET_DRAWS = 1000


@dataclass(frozen=True)
class ScenarioSpec:
    """A registered scenario.

    Attributes:
        name: registry key.  description: one line for ``pfl list``.
        fn: ``fn(labels, num_classes, num_clients, generator, **specific) -> list[Tensor]``,
            each client's (shuffled) indices before the train/val/test split.
        defaults: every option it accepts (common ones included) and its default.
        permute_labels: give every client a random permutation of the class ids.
    """

    name: str
    description: str
    fn: Callable[..., list]
    defaults: dict = field(default_factory=dict)
    permute_labels: bool = False


def _shuffle(idx: Tensor, gen: torch.Generator) -> Tensor:
    return idx[torch.randperm(idx.numel(), generator=gen)]


def _class_indices(labels: Tensor, num_classes: int, gen: torch.Generator) -> list[Tensor]:
    """Each class's sample indices in a seeded random order."""
    return [_shuffle(torch.nonzero(labels == c).flatten(), gen) for c in range(num_classes)]


def _gather(pieces: list[list[Tensor]], gen: torch.Generator) -> list[Tensor]:
    """Concatenate each client's pieces and shuffle them, so a cap or split takes a random subset."""
    return [_shuffle(torch.cat(p) if p else torch.empty(0, dtype=torch.int64), gen) for p in pieces]


def iid(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator) -> list[Tensor]:
    """Each class dealt evenly over all clients (the released code's IID); where a class does
    not divide evenly, which clients get the one extra sample is drawn at random per class."""
    pieces: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for idx in _class_indices(labels, num_classes, gen):
        order = torch.randperm(num_clients, generator=gen).tolist()
        for client, chunk in zip(order, torch.tensor_split(idx, num_clients)):
            pieces[client].append(chunk)
    return _gather(pieces, gen)


def dirichlet(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator, *,
              alpha: float = 0.5, min_samples: int = 10) -> list[Tensor]:
    """Label skew: for each class, the clients' shares are drawn from Dirichlet(α·1) and the
    class's (shuffled) samples cut at floor(cumulative share · count), as the released code
    (and NIID-Bench) do.  The whole draw is repeated, from the same generator, until every
    client has at least ``min_samples`` samples (at most 1000 draws)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    if int(min_samples) != min_samples or min_samples < 0:
        raise ValueError(f"min_samples must be an int >= 0, got {min_samples!r}")
    counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    if num_clients * min_samples > labels.numel():
        raise ValueError(f"dirichlet cannot give {num_clients} clients {min_samples} samples each from "
                         f"{labels.numel()} samples; lower min_samples or num_clients")
    concentration = torch.full((num_classes, num_clients), float(alpha), dtype=torch.float64)
    for _ in range(MAX_DIRICHLET_DRAWS):
        shares = torch._sample_dirichlet(concentration, generator=gen)  # [classes, clients]
        cuts = torch.floor(torch.cumsum(shares, dim=1) * counts[:, None]).to(torch.int64)
        cuts[:, -1] = counts.to(torch.int64)  # the last client takes the rounding remainder
        sizes = torch.diff(cuts, dim=1, prepend=torch.zeros(num_classes, 1, dtype=torch.int64))
        if int(sizes.sum(0).min()) >= min_samples:
            break
    else:
        raise ValueError(f"dirichlet(alpha={alpha}) gave some client fewer than min_samples={min_samples} samples "
                         f"in {MAX_DIRICHLET_DRAWS} draws; lower min_samples or num_clients, or raise alpha")
    pieces: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for idx, row in zip(_class_indices(labels, num_classes, gen), sizes):
        for client, chunk in enumerate(torch.split(idx, row.tolist())):
            pieces[client].append(chunk)
    return _gather(pieces, gen)


def pathological(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator, *,
                 classes_per_client: int = 2) -> list[Tensor]:
    """Every client holds exactly ``classes_per_client`` classes.  Classes are laid out in a
    seeded random order and client i takes the next k of them, cyclically, so each class is
    held by about num_clients·k/num_classes clients; a class's samples are dealt evenly over
    its holders.  Classes nobody holds (num_clients·k < num_classes) go unused."""
    k = classes_per_client
    if int(k) != k or not 1 <= k <= num_classes:
        raise ValueError(f"classes_per_client must be an int in [1, {num_classes}], got {k!r}")
    order = torch.randperm(num_classes, generator=gen).tolist()
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client in range(num_clients):
        for j in range(k):
            holders[order[(client * k + j) % num_classes]].append(client)
    pieces: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for idx, held_by in zip(_class_indices(labels, num_classes, gen), holders):
        if not held_by:
            continue
        shuffled = [held_by[i] for i in torch.randperm(len(held_by), generator=gen).tolist()]
        for client, chunk in zip(shuffled, torch.tensor_split(idx, len(held_by))):
            pieces[client].append(chunk)
    return _gather(pieces, gen)


def _spec(name, description, fn, permute_labels=False, **specific) -> ScenarioSpec:
    return ScenarioSpec(name, description, fn, {**COMMON_DEFAULTS, **specific}, permute_labels)


SCENARIOS: dict[str, ScenarioSpec] = {spec.name: spec for spec in (
    _spec("iid", "each class dealt evenly over all clients", iid),
    _spec("dirichlet", "label skew: per-class client shares drawn from Dirichlet(alpha)", dirichlet,
          alpha=0.5, min_samples=10),
    _spec("pathological", "each client holds exactly classes_per_client classes", pathological,
          classes_per_client=2),
    _spec("permuted-iid", "iid plus a random permutation of class ids per client (label heterogeneity)", iid,
          permute_labels=True),
    _spec("permuted-dirichlet", "dirichlet plus a random permutation of class ids per client", dirichlet,
          permute_labels=True, alpha=0.5, min_samples=10),
)}


def split_sizes(n: int, fractions) -> tuple[int, int, int]:
    """(train, val, test) sizes of a client with ``n`` samples; see the module docstring."""
    train_f, val_f, test_f = fractions
    need = [int(f > 0 and n >= 3) for f in fractions]
    round_half_up = lambda x: int(math.floor(x + 0.5))
    n_test = min(max(round_half_up(test_f * n), need[2]), n - need[0] - need[1])
    n_val = min(max(round_half_up(val_f * n), need[1]), n - need[0] - n_test)
    return n - n_val - n_test, n_val, n_test


def _check_split(split) -> tuple[float, float, float]:
    try:
        fractions = tuple(float(f) for f in split)
    except TypeError:
        fractions = ()
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"split must be 3 non-negative fractions (train, val, test) summing to 1, got {split!r}")
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
        permutation of the class ids as its ``label_map``; elsewhere ``label_map`` is None.

    Raises:
        ValueError: an unknown scenario or option (the message lists the valid ones), a bad
            option value, or a client left with no samples.
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid scenarios: {sorted(SCENARIOS)}")
    spec = SCENARIOS[name]
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise ValueError(f"scenario {name!r} got unknown options {unknown}; valid options: {sorted(spec.defaults)}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}")
    resolved = {**spec.defaults, **options}
    fractions = _check_split(resolved["split"])
    resolved["split"] = fractions
    cap = resolved["samples_per_client"]
    if cap is not None and (int(cap) != cap or cap < 1):
        raise ValueError(f"samples_per_client must be None or a positive int, got {cap!r}")

    gen = torch.Generator().manual_seed(int(seed))
    labels = dataset.labels.detach().cpu().to(torch.int64)
    specific = {k: v for k, v in resolved.items() if k not in COMMON_DEFAULTS}
    shares = spec.fn(labels, dataset.num_classes, int(num_clients), gen, **specific)

    clients = []
    for client, idx in enumerate(shares):
        if cap is not None:
            idx = idx[:cap]
        if idx.numel() == 0:
            raise ValueError(f"scenario {name!r} left client {client} with no samples "
                             f"({len(dataset)} samples, {num_clients} clients); use fewer clients")
        n_train, n_val, n_test = split_sizes(idx.numel(), fractions)
        train, val, test = torch.split(idx, [n_train, n_val, n_test])
        label_map = torch.randperm(dataset.num_classes, generator=gen) if spec.permute_labels else None
        clients.append(ClientSplit(train.clone(), val.clone(), test.clone(), label_map))
    return Partition(name, clients, dataset.num_classes, resolved, int(seed), dataset.name, len(dataset))
