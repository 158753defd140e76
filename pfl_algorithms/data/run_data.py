"""A run's data: the pooled dataset and its partition, with ``samples_per_client`` meaning
what it says.

On real data ``samples_per_client`` caps each client's share (a client holding fewer keeps
them all, with a ``ShortShareWarning``).  Synthetic data (a dataset with a ``size_option``)
has no fixed size, so unless that option is given explicitly the pool is generated large
enough for every client to get ``samples_per_client`` samples: K·(n + classes) samples
first, which the even scenarios (iid, permuted-iid) always deal at least n per client, then
twice as many until every client has n, at most ``MAX_DOUBLINGS`` times (a skewed scenario
may leave a client short, which then warns as on real data).
"""
from __future__ import annotations

from typing import Optional

from .datasets import DATASETS, ArrayDataset, load_dataset
from .partition import Partition
from .scenarios import partition_with_shares, short_shares, warn_short_shares

MAX_DOUBLINGS = 6


def load_run_data(dataset: str, scenario: str, clients: int, *, seed: int, root=None,
                  dataset_options: Optional[dict] = None, scenario_options: Optional[dict] = None,
                  samples_per_client: Optional[int] = None) -> tuple[ArrayDataset, Partition]:
    """(the pooled dataset, its partition over ``clients`` clients) for a run.

    Args:
        dataset, scenario: registry names.  clients: K.  seed: seeds both.
        root: the data root of file-backed datasets.
        dataset_options, scenario_options: their options (``samples_per_client`` apart).
        samples_per_client: None, or the samples each client should hold (see the module
            docstring).

    Warns:
        ShortShareWarning: some client holds fewer than ``samples_per_client`` samples.
    """
    dataset_options = dict(dataset_options or {})
    scenario_options = dict(scenario_options or {})
    if samples_per_client is not None:
        scenario_options["samples_per_client"] = samples_per_client
    size_option = DATASETS[dataset].size_option if dataset in DATASETS else None
    grow = samples_per_client is not None and size_option is not None and size_option not in dataset_options
    if grow:
        classes = dataset_options.get("num_classes", DATASETS[dataset].defaults.get("num_classes", 1))
        dataset_options[size_option] = int(clients) * (int(samples_per_client) + int(classes))
    for attempt in range(MAX_DOUBLINGS + 1):
        data = load_dataset(dataset, root=root, seed=seed, **dataset_options)
        partition, shares = partition_with_shares(scenario, data, clients, seed=seed, **scenario_options)
        if not grow or not short_shares(samples_per_client, shares) or attempt == MAX_DOUBLINGS:
            break
        dataset_options[size_option] *= 2
    warn_short_shares(samples_per_client, shares)
    return data, partition
