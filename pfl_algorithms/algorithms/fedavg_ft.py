"""FedAvg-FT: FedAvg, and each client is evaluated after fine-tuning the global model on its
own training split (``finetune_epochs`` local epochs from the global model, fresh optimizer
state; the fine-tuned copy is used for evaluation only and never sent)."""
from __future__ import annotations

from dataclasses import dataclass

from ..api import Evaluation, Message, NonNegativeInt, Phase
from .fedavg import FedAvg


@dataclass(frozen=True)
class FedAvgFTSettings:
    finetune_epochs: NonNegativeInt = 1


class FedAvgFT(FedAvg):
    """FedAvg, then local fine-tuning before each evaluation."""

    name = "fedavg-ft"
    description = "FedAvg, evaluated after each client fine-tunes the global model locally"
    Settings = FedAvgFTSettings

    def evaluation(self, client):
        return Evaluation(Message(self.global_model), plan=(Phase(epochs=self.settings.finetune_epochs),))
