"""FedRep (Collins et al., ICML 2021, Algorithm 1): each round a client first trains its own head
for ``head_epochs`` with the received body fixed, then the body for the run's local epochs with
the head fixed; only the body is sent, and the server averages it weighted by data size.

The two phases keep separate optimizer states (momentum, Adam's moments and step counts).
Clients are evaluated, as in the authors' code, with the global body and their own head.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..api import NonNegativeInt, Phase
from .fedper import FedPer


@dataclass(frozen=True)
class FedRepSettings:
    head_epochs: NonNegativeInt = 10  # the released code's local_ep - local_rep_ep (11 - 1)


class FedRep(FedPer):
    """FedPer's sharing (the body; every head stays with its client), trained head first."""

    name = "fedrep"
    description = "each round: train the local head (body fixed), then the body (head fixed); average the body"
    Settings = FedRepSettings

    def plan(self, client):
        return (Phase(groups=("head",), epochs=self.settings.head_epochs, state="head"),
                Phase(groups=("body",), state="body"))
