"""FedAvg-FT: FedAvg, and each client is evaluated after fine-tuning the global model on its
own training split (``finetune_epochs`` local epochs from the global model, fresh optimizer
state; the fine-tuned copy is used for evaluation only and never sent)."""
from __future__ import annotations

from dataclasses import dataclass

from ..api import Evaluation, Message, Phase
from .fedavg import FedAvg


@dataclass(frozen=True)
class FedAvgFTSettings:
    finetune_epochs: int = 1

    def __post_init__(self):
        if self.finetune_epochs < 0:
            raise ValueError(f"finetune_epochs must be >= 0, got {self.finetune_epochs}")


class FedAvgFT(FedAvg):
    """FedAvg, then local fine-tuning before each evaluation."""

    name = "fedavg-ft"
    description = "FedAvg, evaluated after each client fine-tunes the global model locally"
    Settings = FedAvgFTSettings

    def evaluation(self, client):
        return Evaluation(Message(self.global_model), plan=(Phase(epochs=self.settings.finetune_epochs),))
