"""FedPer (Arivazhagan et al., 2019): FedAvg over the body; every client keeps its own head."""
from __future__ import annotations

from .fedavg import FedAvg


class FedPer(FedAvg):
    """Share the body, keep the head local, whatever the scenario."""

    name = "fedper"
    description = "FedAvg over the body; each client keeps its own classifier head"

    def local_groups(self, *, keep_head_local):
        return {"head"}

    @classmethod
    def check_config(cls, config) -> None:
        if config.keep_head_local is False:
            raise ValueError(f"{cls.name} keeps the head local by definition: keep_head_local=False conflicts with it")
