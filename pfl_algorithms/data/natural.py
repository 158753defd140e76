"""The ``natural`` scenario: one client per writer (FEMNIST as LEAF splits it).

``num_clients`` writers are drawn at random (seeded) among those with at least
``min_samples`` samples, and client k is the k-th of them in increasing writer id.  With
``official_split`` (the default) a client's test split is its writer's samples from the
official test files, and the rest is split into train/val in the proportion of the run's
``split`` train and val fractions; otherwise the writer's samples are split like any
other client's.  ``Partition.info["writers"]`` records each client's writer name.
"""
from __future__ import annotations

import torch

from .datasets import ArrayDataset
from .deal import ClientDeal, Deal
from ..option_types import PositiveInt
from .label_skew import shuffle


def natural(dataset: ArrayDataset, num_clients: int, gen: torch.Generator, *,
            min_samples: PositiveInt = 10, official_split: bool = True) -> Deal:
    """Deal one writer per client (see the module docstring)."""
    if dataset.writers is None:
        raise ValueError(f"scenario 'natural' needs a dataset with writers (femnist); {dataset.name!r} has none")
    if official_split and dataset.test_mask is None:
        raise ValueError(f"official_split=True needs the dataset's official test set; {dataset.name!r} records "
                         "none: pass official_split=false")
    if int(min_samples) != min_samples or min_samples < 1:
        raise ValueError(f"min_samples must be an int >= 1, got {min_samples!r}")
    writers = dataset.writers.cpu().to(torch.int64)
    counts = torch.bincount(writers)
    eligible = torch.nonzero(counts >= min_samples).flatten()
    if eligible.numel() < num_clients:
        raise ValueError(f"natural: only {eligible.numel()} writers have >= {min_samples} samples, "
                         f"fewer than num_clients={num_clients}; lower one of them")
    chosen = eligible[torch.randperm(eligible.numel(), generator=gen)[:num_clients]].sort().values
    clients = []
    for writer in chosen.tolist():
        idx = shuffle(torch.nonzero(writers == writer).flatten(), gen)
        if official_split:
            is_test = dataset.test_mask.cpu()[idx]
            clients.append(ClientDeal(idx[~is_test], test=idx[is_test]))
        else:
            clients.append(ClientDeal(idx))
    names = dataset.writer_names
    info = {"writers": [names[w] if names else w for w in chosen.tolist()]}
    return Deal(clients, info=info)
