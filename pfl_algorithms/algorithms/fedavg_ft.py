"""FedAvg-FT: FedAvg, and each client is evaluated after fine-tuning the global model on its
own training split (``finetune_epochs`` local epochs from the global model, fresh optimizer
state; the fine-tuned copy is used for evaluation only and never sent)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..engine.federation import Federation
from ..engine.local import evaluate, train_locally
from ..option_types import NonNegativeInt
from .fedavg import FedAvg


@dataclass(frozen=True)
class FedAvgFTSettings:
    finetune_epochs: NonNegativeInt = 1


class FedAvgFT(FedAvg):
    """FedAvg, then local fine-tuning before each evaluation."""

    name = "fedavg-ft"
    description = "FedAvg, evaluated after each client fine-tunes the global model locally"
    Settings = FedAvgFTSettings

    def evaluate_client(self, fed: Federation, client: int, split: str = "test"):
        fed.load_client(client)
        fed.work.params.copy_(self.global_model_of(fed, client))
        fed.work.buffers.copy_(self.global_buffers)
        state = {name: torch.zeros_like(fed.work.params) for name in fed.optimizer.state_names()}
        state["steps"] = torch.zeros((), dtype=torch.int64)
        data = fed.clients[client]
        schedule = replace(fed.settings.schedule, epochs=self.settings.finetune_epochs, steps=None)
        train_locally(fed.work, fed.optimizer, state, fed.inputs, fed.labels, data.train, schedule,
                      generator=fed.generator("algorithm", fed.round, client), label_map=data.label_map)
        return evaluate(fed.work.module, fed.inputs, fed.labels, getattr(data, split), label_map=data.label_map)
