"""The uploads of one round, as the server's ``aggregate`` sees them."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .aggregate import average_rows
from .messages import Message


class Uploads:
    """The accepted uploads of a round: one message per client that stayed finite and sent
    something, in ascending client order.

    Attributes:
        clients: [M] int64, the senders.  messages: their messages, in that order.
        failed: [F] int64, clients whose update was not finite (they sent nothing).
    """

    def __init__(self, clients: Sequence[int], messages: Sequence[Message], failed: Sequence[int] = ()):
        self.clients = torch.tensor(list(clients), dtype=torch.int64)
        self.messages = list(messages)
        self.failed = torch.tensor(list(failed), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        return bool(self.messages)

    @property
    def num_examples(self) -> Tensor:
        """[M] float64: each sender's ``num_examples``."""
        return torch.tensor([float(m.num_examples) for m in self.messages], dtype=torch.float64)

    def names(self) -> list[str]:
        """The tensors every sender sent (in the first sender's order)."""
        if not self.messages:
            return []
        common = set.intersection(*(set(m.tensors) for m in self.messages))
        return [n for n in self.messages[0].tensors if n in common]

    def stack(self, name: str) -> Tensor:
        """Tensor ``name`` of every sender, stacked: [M, ...] (Sparse payloads as received)."""
        missing = [int(c) for c, m in zip(self.clients, self.messages) if name not in m.tensors]
        if missing:
            raise KeyError(f"clients {missing} sent no {name!r}")
        return torch.stack([m.dense(name) for m in self.messages])

    def concat(self, names: Sequence[str]) -> Tensor:
        """[M, P]: each sender's tensors ``names``, flattened and side by side in that order (one
        flat model per row: FedAMP's, FedDWA's and FedDAF's banks)."""
        return torch.cat([self.stack(name).reshape(len(self.messages), -1) for name in names], dim=1)

    def extras(self, name: str) -> list:
        """Extra ``name`` of every sender, in order."""
        return [m.extras[name] for m in self.messages]

    def weights(self) -> Tensor:
        """[M] float64: n_i / Σ n over the senders (FedAvg's weights)."""
        n = self.num_examples
        return n / n.sum()

    def weighted_mean(self, names: Optional[Sequence[str]] = None,
                      weights: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Σ_i weights[i] · tensor_i for each tensor in ``names`` (None: every tensor all sent),
        one ``weighted_average`` op per tensor; ``weights`` [M] default :meth:`weights`.

        Raises:
            ValueError: no uploads, or weights of the wrong shape.
        """
        if not self.messages:
            raise ValueError("no client sent anything this round: nothing to average")
        weights = self.weights() if weights is None else weights
        if weights.shape != (len(self.messages),):
            raise ValueError(f"weights must be [{len(self.messages)}] (one per sender), got {list(weights.shape)}")
        means = {}
        for name in (names or self.names()):
            rows = self.stack(name)
            means[name] = average_rows(rows.reshape(len(rows), -1), weights).reshape(rows.shape[1:])
        return means
