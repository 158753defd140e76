"""What a scenario function returns before ``make_partition`` splits, caps and records it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .label_skew import dirichlet, iid


@dataclass
class ClientDeal:
    """One client's share as a scenario deals it.

    Attributes:
        indices: its samples in a seeded random order, before the train/val/test split.
        label_map: see ``ClientSplit.label_map``.  domain: its domain id, if any.
        split: its own (train, val, test) fractions instead of the run's ``split``.
        test: a fixed test set (e.g. a FEMNIST writer's official test samples); ``indices``
            then hold the rest, split into train/val in the proportion of the split's
            train and val fractions.
        keep_train: the fraction of its train split it keeps (FedDAF's target scarcity).
    """

    indices: Tensor
    label_map: Optional[Tensor] = None
    domain: Optional[int] = None
    split: Optional[tuple] = None
    test: Optional[Tensor] = None
    keep_train: float = 1.0


@dataclass
class Deal:
    """A scenario's result: the clients' shares and what the partition records beside them.

    Attributes:
        clients: one ``ClientDeal`` per client.
        output_classes / domain_names / info: see ``Partition``.
        transforms: ``{"shift": name, "clients": [ids]}`` dicts; ``make_partition`` adds
            each one's noise seed.
    """

    clients: list[ClientDeal]
    output_classes: Optional[int] = None
    domain_names: Optional[list] = None
    transforms: list = field(default_factory=list)
    info: dict = field(default_factory=dict)


def contiguous_blocks(num_clients: int, num_groups: int) -> list[range]:
    """Clients of each group when ``num_clients`` are spread over ``num_groups`` in
    contiguous blocks, the first ``num_clients % num_groups`` groups one client larger
    (Factorized-FL: clients 0-3 on domain 0, 4-7 on domain 1, ...)."""
    base, extra = divmod(num_clients, num_groups)
    blocks, start = [], 0
    for group in range(num_groups):
        size = base + (group < extra)
        blocks.append(range(start, start + size))
        start += size
    return blocks


def subset_deal(indices: Tensor, positions: list[Tensor]) -> list[Tensor]:
    """Map per-client positions into ``indices`` (a partitioner's output on a subset) back
    to dataset indices."""
    return [indices[p] for p in positions]


def deal_by_domain(labels: Tensor, num_classes: int, members: list[Tensor], num_clients: int,
                   gen: torch.Generator, *, alpha=None, min_samples: int = 1,
                   names=None) -> tuple[list[range], list[Tensor]]:
    """Spread ``num_clients`` over the domains in contiguous blocks and deal each domain's
    samples (``members[d]``, dataset indices) over its block's clients by class: evenly
    (``alpha`` None, ``label_skew.iid``) or with Dirichlet(alpha) shares.

    Returns:
        (the blocks of client ids, one per domain; each client's share, in client order).

    Raises:
        ValueError: a domain with fewer samples than clients (named by ``names`` if given).
    """
    blocks = contiguous_blocks(num_clients, len(members))
    shares: list[Tensor] = []
    for domain, (idx, block) in enumerate(zip(members, blocks)):
        if idx.numel() < len(block):
            name = names[domain] if names else domain
            raise ValueError(f"domain {name!r} has {idx.numel()} samples for {len(block)} clients")
        sub = labels[idx]
        positions = (iid(sub, num_classes, len(block), gen) if alpha is None else
                     dirichlet(sub, num_classes, len(block), gen, alpha=float(alpha), min_samples=min_samples))
        shares += subset_deal(idx, positions)
    return blocks, shares
