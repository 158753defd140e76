"""FedAvg-FT: FedAvg, and each client is evaluated after fine-tuning the global model on its
own training split: FedAvg with the run's ``--finetune-epochs`` defaulting to 1 (fresh
optimizer state; the fine-tuned copy is used for evaluation only and never sent).  Any
algorithm fine-tunes the same way with ``--finetune-epochs E``."""
from __future__ import annotations

from .fedavg import FedAvg


class FedAvgFT(FedAvg):
    """FedAvg, then local fine-tuning before each evaluation."""

    name = "fedavg-ft"
    description = "FedAvg, evaluated after each client fine-tunes the global model locally (--finetune-epochs, 1)"
    finetune_epochs = 1
