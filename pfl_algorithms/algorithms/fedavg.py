"""FedAvg (McMahan et al., 2017): clients start each round from the global model; the server
averages their shared parameters weighted by training-set size, w ← Σ_i (n_i / n) w_i.

BatchNorm statistics travel and are averaged with the parameters (as averaging whole
state_dicts does); what stays local (the head in permuted scenarios) is never sent.
"""
from __future__ import annotations

import torch

from ..engine.aggregate import average_rows, sender_weights
from ..engine.federation import Federation
from .base import Algorithm


class FedAvg(Algorithm):
    """Federated averaging of the shared parameters."""

    name = "fedavg"
    description = "clients train from the global model; the server averages them weighted by data size"

    def setup(self, fed: Federation) -> None:
        self.global_params = fed.params.row(0)[fed.shared].clone()
        self.global_buffers = fed.buffers.row(0).clone()

    def record_transfer(self, fed: Federation, direction: str, client: int) -> None:
        """One client's transfer, by group: the shared parameters and the BatchNorm statistics."""
        fed.comm.send(direction, client, "parameters", self.global_params.numel())
        if self.global_buffers.numel():
            fed.comm.send(direction, client, "batchnorm_statistics", self.global_buffers.numel())

    def begin_round(self, fed: Federation, clients: torch.Tensor, round_: int) -> None:
        fed.params.data[clients, fed.shared] = self.global_params
        fed.buffers.data[clients] = self.global_buffers
        for client in clients.tolist():
            self.record_transfer(fed, "down", client)

    def end_round(self, fed: Federation, clients: torch.Tensor, finite: torch.Tensor, round_: int) -> None:
        senders = clients[finite]
        if senders.numel() == 0:
            return
        for client in senders.tolist():
            self.record_transfer(fed, "up", client)
        weights = sender_weights(fed.num_clients, senders, fed.train_sizes())
        self.global_params = average_rows(fed.params.data[:, fed.shared], weights)
        if self.global_buffers.numel():
            self.global_buffers = average_rows(fed.buffers.data, weights)

    def global_model_of(self, fed: Federation, client: int) -> torch.Tensor:
        """The client's view of the global model: the global shared parameters, its own local ones."""
        params = fed.params.row(client).clone()
        params[fed.shared] = self.global_params
        return params

    def evaluate_client(self, fed: Federation, client: int, split: str = "test"):
        """The global model (with the client's local parameters) and the global BatchNorm
        statistics, on the client's split."""
        return fed.evaluate_client(client, split, params=self.global_model_of(fed, client),
                                   buffers=self.global_buffers)

    def state_dict(self) -> dict:
        return {"global_params": self.global_params, "global_buffers": self.global_buffers}

    def load_state_dict(self, state: dict) -> None:
        self.global_params = state["global_params"].clone()
        self.global_buffers = state["global_buffers"].clone()
