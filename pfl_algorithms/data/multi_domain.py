"""The ``multi-domain`` scenario: clients on different domains (SimFed's and Factorized-FL's
domain-heterogeneous settings, and CPU-sized versions of them on digits).

What a domain is (option ``domains``):

- ``"dataset"``: the dataset's own domains (PACS/VLCS/Office-Caltech's domains, or the parts
  of the ``mixed`` dataset, e.g. MNIST, SVHN and CIFAR-10 side by side).
- ``"superclass"``: CIFAR-100's 20 superclasses, 5 classes each (SimFed).
- ``"superclass-groups"``: Factorized-FL's 5 sub-datasets of 10 related classes, two
  superclasses each (``SUPERCLASS_GROUPS``); the other 50 classes are not used.  With 20
  clients that is 4 per sub-dataset; add ``permute_labels=True`` for the paper's setting.
- ``"feature-shift"``: one dataset's samples dealt evenly (per class) over the ``shifts``
  (see ``shifts.py``), each domain's inputs shifted: rotations, inversion, blur, noise.

Clients are spread over the domains in contiguous blocks (clients 0..c-1 on domain 0, ...;
see ``deal.deal_by_domain``), so ``num_clients`` must be at least the number of domains.
Within a domain its samples are dealt over its clients by class, evenly (``alpha=None``) or
with Dirichlet(alpha) shares.

Labels: with ``relabel`` (default: when no class is shared by two domains, as with
superclasses or a mixture of datasets) each domain's classes, in increasing id order, become
0..n_d-1 and the clients' classifiers have ``max n_d`` outputs (the partition's
``output_classes``); other classes map to -1.  ``permute_labels`` additionally gives every
client a random permutation of the labels it sees.
"""
from __future__ import annotations

from typing import Annotated, Optional, Sequence

import torch
from torch import Tensor

from ..option_types import NonNegativeInt, OneOf, PositiveFloat

from .datasets import ArrayDataset
from .deal import ClientDeal, Deal, deal_by_domain
from .label_skew import iid
from .shifts import parse_shift

DOMAIN_MODES = ("dataset", "superclass", "superclass-groups", "feature-shift")
DEFAULT_SHIFTS = ("identity", "rotate-90", "invert", "blur-0.6", "noise-0.3")
# Factorized-FL's five sub-datasets of CIFAR-100 (paper, Sec. 5): pairs of coarse label ids
# in CIFAR-100's own coarse order.
SUPERCLASS_GROUPS = {
    "household-objects": (5, 6),   # household electrical devices, household furniture
    "fruits-and-foods": (3, 4),    # food containers, fruit and vegetables
    "trees-and-flowers": (2, 17),  # flowers, trees
    "transport": (18, 19),         # vehicles 1, vehicles 2
    "animals": (8, 11),            # large carnivores, large omnivores and herbivores
}


def _sample_domains(dataset: ArrayDataset, mode: str, shifts, gen: torch.Generator) -> tuple[Tensor, list]:
    """([N] domain id per sample, -1 where unused; the domain names)."""
    if mode not in DOMAIN_MODES:
        raise ValueError(f"domains must be one of {DOMAIN_MODES}, got {mode!r}")
    labels = dataset.labels.cpu()
    if mode == "dataset":
        if dataset.domains is None:
            raise ValueError(f"multi-domain with domains='dataset' needs a dataset with domains (pacs, vlcs, "
                             f"office-caltech, mixed); {dataset.name!r} has none: use domains='feature-shift', "
                             "or domains='superclass' on cifar100")
        domains = dataset.domains.cpu().to(torch.int64)
        count = int(domains.max()) + 1
        return domains, list(dataset.domain_names or [f"domain-{d}" for d in range(count)])
    if mode in ("superclass", "superclass-groups"):
        if dataset.coarse_labels is None:
            raise ValueError(f"multi-domain with domains={mode!r} needs superclass labels (cifar100); "
                             f"{dataset.name!r} has none")
        coarse = dataset.coarse_labels.cpu().to(torch.int64)
        names = dataset.coarse_names or [f"superclass-{c}" for c in range(int(coarse.max()) + 1)]
        if mode == "superclass":
            return coarse, list(names)
        if int(coarse.max()) != 19:
            raise ValueError(f"domains='superclass-groups' is defined on CIFAR-100's 20 superclasses; "
                             f"{dataset.name!r} has {int(coarse.max()) + 1}")
        group_of = torch.full((20,), -1, dtype=torch.int64)
        for group, members in enumerate(SUPERCLASS_GROUPS.values()):
            group_of[list(members)] = group
        return group_of[coarse], list(SUPERCLASS_GROUPS)
    shifts = tuple(shifts)
    if not shifts:
        raise ValueError("shifts must name at least one shift for domains='feature-shift'")
    for name in shifts:
        parse_shift(name)
    domains = torch.empty(labels.numel(), dtype=torch.int64)
    for domain, positions in enumerate(iid(labels, dataset.num_classes, len(shifts), gen)):
        domains[positions] = domain
    return domains, list(shifts)


def multi_domain(dataset: ArrayDataset, num_clients: int, gen: torch.Generator, *,
                 domains: Annotated[str, OneOf(DOMAIN_MODES)] = "dataset",
                 shifts: Sequence[str] = DEFAULT_SHIFTS,
                 alpha: Optional[PositiveFloat] = None,
                 min_samples: NonNegativeInt = 1,
                 relabel: Optional[bool] = None,
                 permute_labels: bool = False) -> Deal:
    """Deal ``dataset`` over clients on different domains (see the module docstring)."""
    sample_domain, names = _sample_domains(dataset, domains, shifts, gen)
    count = len(names)
    if num_clients < count:
        raise ValueError(f"multi-domain with domains={domains!r} has {count} domains and needs at least as many "
                         f"clients; got num_clients={num_clients}")
    if alpha is not None and not float(alpha) > 0:
        raise ValueError(f"alpha must be None (even split within a domain) or > 0, got {alpha!r}")
    if relabel not in (None, True, False) or permute_labels not in (True, False):
        raise ValueError(f"relabel must be None, true or false and permute_labels true or false; "
                         f"got relabel={relabel!r}, permute_labels={permute_labels!r}")
    labels = dataset.labels.cpu()
    members = [torch.nonzero(sample_domain == d).flatten() for d in range(count)]
    classes = [labels[m].unique() for m in members]
    if relabel is None:
        relabel = int(sum(c.numel() for c in classes)) == int(torch.cat(classes).unique().numel())
    blocks, shares = deal_by_domain(labels, dataset.num_classes, members, num_clients, gen, alpha=alpha,
                                    min_samples=min_samples, names=names)
    clients = []
    for domain, block in enumerate(blocks):
        for client in block:
            clients.append(ClientDeal(shares[client], _label_map(dataset.num_classes, classes[domain], relabel,
                                                                 permute_labels, gen), domain))
    transforms = []
    if domains == "feature-shift":
        transforms = [{"shift": name, "clients": list(block)} for name, block in zip(names, blocks)
                      if parse_shift(name)[0] != "identity"]
    output_classes = max(int(c.numel()) for c in classes) if relabel else None
    info = {"domain_mode": domains, "clients_per_domain": [len(b) for b in blocks], "relabel": bool(relabel)}
    return Deal(clients, output_classes, names, transforms, info)


def _label_map(num_classes: int, classes: Tensor, relabel: bool, permute: bool, gen: torch.Generator):
    if not relabel:
        return torch.randperm(num_classes, generator=gen) if permute else None
    local = torch.randperm(classes.numel(), generator=gen) if permute else torch.arange(classes.numel())
    label_map = torch.full((num_classes,), -1, dtype=torch.int64)
    label_map[classes] = local
    return label_map
