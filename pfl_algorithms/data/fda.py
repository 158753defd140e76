"""The ``fda`` scenario (FedDAF): K source clients and one data-poor target client, the last.

Two settings:

- Synthetic shift (``target_domain=None``): the target's pool is the dataset's official
  test set when it has one (FedDAF on CIFAR-10: sources share the 50,000 training images,
  the target gets the 10,000 test images), else a seeded random ``target_share`` of the
  samples (default 1/6, CIFAR-10's proportion).  The sources' pool is dealt over the K
  sources with Dirichlet(``alpha``) class shares.  The target's images carry Gaussian noise
  of standard deviation ``noise`` on the pixel scale (``noise-<sigma>`` in ``shifts.py``).
- Real shift (``target_domain`` = a domain name or id of PACS/VLCS/Office-Caltech): the
  target holds that domain; the other domains are spread over the sources in contiguous
  blocks (one source per domain when num_clients = domains), evenly by class within a domain.

The target's pool is split by ``target_split`` (train, val, test; default 20/0/80 as the
paper), then only ``target_fraction`` of its train split is kept: the first
max(1, round-half-up(fraction · n_train)) samples of it in the seeded order; the rest of
the train split is left out.  ``Partition.info["target_client"]`` names the target.
"""
from __future__ import annotations

import math
from typing import Annotated, Optional, Union

import torch

from .datasets import ArrayDataset
from .deal import ClientDeal, Deal, deal_by_domain, subset_deal
from ..option_types import NonNegativeFloat, NonNegativeInt, PositiveFloat, Range, SplitFractions
from .label_skew import dirichlet, shuffle

CIFAR10_TARGET_SHARE = 10_000 / 60_000


def _resolve_domain(dataset: ArrayDataset, target_domain) -> int:
    if dataset.domains is None:
        raise ValueError(f"target_domain={target_domain!r} needs a dataset with domains (pacs, vlcs, "
                         f"office-caltech, mixed); {dataset.name!r} has none")
    names = list(dataset.domain_names or [])
    count = int(dataset.domains.max()) + 1
    if isinstance(target_domain, str) and target_domain in names:
        return names.index(target_domain)
    if isinstance(target_domain, int) and not isinstance(target_domain, bool) and 0 <= target_domain < count:
        return target_domain
    raise ValueError(f"target_domain must be one of {names or list(range(count))} (a name or an id), "
                     f"got {target_domain!r}")


def fda(dataset: ArrayDataset, num_clients: int, gen: torch.Generator, *,
        alpha: PositiveFloat = 1.0,
        min_samples: NonNegativeInt = 10,
        target_domain: Union[None, str, NonNegativeInt] = None,
        noise: NonNegativeFloat = 0.0,
        target_fraction: Annotated[float, Range(gt=0, le=1)] = 1.0,
        target_split: SplitFractions = (0.2, 0.0, 0.8),
        target_share: Optional[Annotated[float, Range(gt=0, lt=1)]] = None) -> Deal:
    """Deal ``dataset`` to ``num_clients - 1`` sources and one target (module docstring)."""
    sources = num_clients - 1
    if sources < 1:
        raise ValueError(f"fda needs at least 2 clients (sources and the target), got num_clients={num_clients}")
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite sigma >= 0, got {noise!r}")
    if not (isinstance(target_fraction, (int, float)) and 0 < target_fraction <= 1):
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction!r}")
    labels = dataset.labels.cpu()
    everything = torch.arange(labels.numel())
    clients: list[ClientDeal] = []
    if target_domain is not None:
        target = _resolve_domain(dataset, target_domain)
        domains = dataset.domains.cpu()
        source_domains = [d for d in domains.unique().tolist() if d != target]
        if sources < len(source_domains):
            raise ValueError(f"fda with target_domain={target_domain!r} has {len(source_domains)} source domains and "
                             f"needs at least one source client each: num_clients >= {len(source_domains) + 1}")
        members = [everything[domains == domain] for domain in source_domains]
        blocks, shares = deal_by_domain(labels, dataset.num_classes, members, sources, gen,
                                        names=[dataset.domain_names[d] if dataset.domain_names else d
                                               for d in source_domains])
        clients += [ClientDeal(shares[c], domain=domain) for domain, block in zip(source_domains, blocks) for c in block]
        target_pool, target_id = everything[domains == target], target
    else:
        if target_share is None and dataset.test_mask is not None:
            in_target = dataset.test_mask.cpu().bool()
        else:
            share = CIFAR10_TARGET_SHARE if target_share is None else target_share
            if not (isinstance(share, (int, float)) and 0 < share < 1):
                raise ValueError(f"target_share must be None or in (0, 1), got {target_share!r}")
            chosen = torch.randperm(labels.numel(), generator=gen)[:max(1, round(share * labels.numel()))]
            in_target = torch.zeros(labels.numel(), dtype=torch.bool)
            in_target[chosen] = True
        source_pool = everything[~in_target]
        positions = dirichlet(labels[source_pool], dataset.num_classes, sources, gen, alpha=alpha,
                              min_samples=min_samples)
        clients += [ClientDeal(share) for share in subset_deal(source_pool, positions)]
        target_pool, target_id = everything[in_target], None
    if target_pool.numel() == 0:
        raise ValueError("fda left the target client with no samples")
    clients.append(ClientDeal(shuffle(target_pool, gen), domain=target_id, split=tuple(target_split),
                              keep_train=float(target_fraction)))
    transforms = [{"shift": f"noise-{float(noise)!r}", "clients": [sources]}] if noise > 0 else []
    names = list(dataset.domain_names) if target_domain is not None and dataset.domain_names else None
    return Deal(clients, None, names, transforms, {"target_client": sources, "source_clients": list(range(sources))})
