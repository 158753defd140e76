"""FedPer (Arivazhagan et al., 2019): FedAvg over the body; every client keeps its own head."""
from __future__ import annotations

from ..api import Capabilities
from .fedavg import FedAvg


class FedPer(FedAvg):
    """Share the body, keep the head local, whatever the scenario."""

    name = "fedper"
    description = "FedAvg over the body; each client keeps its own classifier head"
    capabilities = Capabilities(head="local")

    def local_groups(self, *, keep_head_local):
        return {"head"}
