"""FedPer (Arivazhagan et al., 2019): FedAvg over the body; every client keeps its own head."""
from __future__ import annotations

from torch import nn

from .fedavg import FedAvg


class FedPer(FedAvg):
    """Share the body, keep the head local, whatever the scenario."""

    name = "fedper"
    description = "FedAvg over the body; each client keeps its own classifier head"

    def local_parameter_names(self, model: nn.Module, *, keep_head_local: bool) -> tuple[str, ...]:
        return super().local_parameter_names(model, keep_head_local=True)
