"""Label-skew partitioners: how one dataset's samples are dealt to clients by class.

Each takes the labels on the CPU and a ``torch.Generator`` (never the global RNG) and
returns each client's indices in a seeded random order (so a cap or a split takes a random
subset).  The multi-domain and fda scenarios reuse them within a domain or over sources.
"""
from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from ..option_types import NonNegativeInt, OneOf, PositiveFloat, PositiveInt

MAX_DIRICHLET_DRAWS = 1000


def shuffle(idx: Tensor, gen: torch.Generator) -> Tensor:
    """``idx`` in a seeded random order."""
    return idx[torch.randperm(idx.numel(), generator=gen)]


def class_indices(labels: Tensor, num_classes: int, gen: torch.Generator) -> list[Tensor]:
    """Each class's sample indices in a seeded random order."""
    return [shuffle(torch.nonzero(labels == c).flatten(), gen) for c in range(num_classes)]


def gather(pieces: list[list[Tensor]], gen: torch.Generator) -> list[Tensor]:
    """Concatenate each client's pieces and shuffle them, so a cap or split takes a random subset."""
    return [shuffle(torch.cat(p) if p else torch.empty(0, dtype=torch.int64), gen) for p in pieces]


def iid(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator) -> list[Tensor]:
    """Each class dealt evenly over all clients (the released code's IID); where a class does
    not divide evenly, which clients get the one extra sample is drawn at random per class."""
    pieces: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for idx in class_indices(labels, num_classes, gen):
        order = torch.randperm(num_clients, generator=gen).tolist()
        for client, chunk in zip(order, torch.tensor_split(idx, num_clients)):
            pieces[client].append(chunk)
    return gather(pieces, gen)


def dirichlet(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator, *,
              alpha: PositiveFloat = 0.5, min_samples: NonNegativeInt = 10) -> list[Tensor]:
    """Label skew: for each class, the clients' shares are drawn from Dirichlet(α·1) and the
    class's (shuffled) samples cut at floor(cumulative share · count), the last client taking
    the rounding remainder.  The whole draw is repeated, from the same generator, until every
    client has at least ``min_samples`` samples (at most 1000 draws), as NIID-Bench does.
    (Factorized-FL's released code floors each share alone, drops the remainders and never
    redraws: its clients hold slightly fewer samples.)"""
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
    for idx, row in zip(class_indices(labels, num_classes, gen), sizes):
        for client, chunk in enumerate(torch.split(idx, row.tolist())):
            pieces[client].append(chunk)
    return gather(pieces, gen)


def pfedhn_classes(num_classes: int, num_clients: int, classes_per_client: int, gen: torch.Generator,
                   low: float = 0.4, high: float = 0.6) -> tuple[list[list[int]], list[list[float]]]:
    """pFedHN's class assignment (``gen_classes_per_node`` in ``experiments/dataset.py`` of
    github.com/AvivSham/pFedHN): each class is held by m = k·K/C clients (K·k must be a
    multiple of C), with proportions α_{c,1..m} ~ U(0.4, 0.6) normalized to sum to 1, drawn
    class by class first; then client by client, each of its k classes is drawn uniformly among
    the classes with the most free slots left (one slot taken per draw), and the client takes
    the last remaining proportion of each of its classes (the code's ``prob.pop()``, after its
    k draws).  Returns (each client's classes, each client's proportions, in the same order).

    Raises:
        ValueError: K·k not a multiple of C (the code's "equal classes appearance is needed").
    """
    k = classes_per_client
    if (k * num_clients) % num_classes:
        raise ValueError(f"layout 'pfedhn' needs num_clients x classes_per_client ({num_clients} x {k}) to be a "
                         f"multiple of the {num_classes} classes, so that every class has the same number of holders")
    holders = k * num_clients // num_classes
    proportions = []
    for _ in range(num_classes):
        alpha = low + (high - low) * torch.rand(holders, generator=gen, dtype=torch.float64)
        proportions.append((alpha / alpha.sum()).tolist())
    free = [holders] * num_classes
    classes, shares = [], []
    for _ in range(num_clients):
        chosen = []
        for _ in range(k):
            most = [c for c in range(num_classes) if free[c] == max(free)]
            chosen.append(most[int(torch.randint(len(most), (1,), generator=gen))])
            free[chosen[-1]] -= 1
        classes.append(chosen)
        shares.append([proportions[c].pop() for c in chosen])
    return classes, shares


def pathological(labels: Tensor, num_classes: int, num_clients: int, gen: torch.Generator, *,
                 classes_per_client: PositiveInt = 2,
                 layout: Annotated[str, OneOf(("cyclic", "random", "pfedhn"))] = "cyclic") -> list[Tensor]:
    """Every client holds exactly ``classes_per_client`` classes, and a class's samples are
    dealt evenly over its holders.  ``layout='cyclic'``: classes are laid out in a seeded random
    order and client i takes the next k of them, cyclically, so each class is held by about
    num_clients·k/num_classes clients (with 10 classes, k = 2 and 10 clients: five pairs of
    clients holding the same two classes, pFedMB's Section 5.2).  ``layout='random'``: each
    client draws its k classes uniformly at random (pFedMB's "each client is randomly assigned
    2 classes").  Classes nobody holds go unused.  ``layout='pfedhn'``: pFedHN's split
    (``pfedhn_classes``; used by Fed-CMA's CIFAR-10 Table 3): every class has k·K/C holders with
    random proportions α ~ U(0.4, 0.6), normalized, and a client gets floor(n_c·α) of class c's
    (shuffled) samples, the code's ``gen_data_split``; the floor's remainders go unused.  The
    code applies the same proportions to its train, validation and test sets; here they apply
    to the pooled data, which the scenario then splits per client."""
    k = classes_per_client
    if int(k) != k or not 1 <= k <= num_classes:
        raise ValueError(f"classes_per_client must be an int in [1, {num_classes}], got {k!r}")
    if layout not in ("cyclic", "random", "pfedhn"):
        raise ValueError(f"layout must be 'cyclic', 'random' or 'pfedhn', got {layout!r}")
    if layout == "pfedhn":
        return _proportional(labels, num_classes, *pfedhn_classes(num_classes, num_clients, k, gen), gen)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    if layout == "cyclic":
        order = torch.randperm(num_classes, generator=gen).tolist()
        for client in range(num_clients):
            for j in range(k):
                holders[order[(client * k + j) % num_classes]].append(client)
    else:
        for client in range(num_clients):
            for c in torch.randperm(num_classes, generator=gen)[:k].tolist():
                holders[c].append(client)
    pieces: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for idx, held_by in zip(class_indices(labels, num_classes, gen), holders):
        if not held_by:
            continue
        shuffled = [held_by[i] for i in torch.randperm(len(held_by), generator=gen).tolist()]
        for client, chunk in zip(shuffled, torch.tensor_split(idx, len(held_by))):
            pieces[client].append(chunk)
    return gather(pieces, gen)


def _proportional(labels: Tensor, num_classes: int, classes: list[list[int]], shares: list[list[float]],
                  gen: torch.Generator) -> list[Tensor]:
    """Client by client, each of its classes c with proportion α: the next floor(n_c·α) of
    class c's shuffled samples (pFedHN's ``gen_data_split``)."""
    counts = torch.bincount(labels, minlength=num_classes).tolist()
    remaining = class_indices(labels, num_classes, gen)
    pieces: list[list[Tensor]] = [[] for _ in classes]
    for client, (held, alphas) in enumerate(zip(classes, shares)):
        for c, alpha in zip(held, alphas):
            take = int(counts[c] * alpha)
            pieces[client].append(remaining[c][:take])
            remaining[c] = remaining[c][take:]
    return gather(pieces, gen)
