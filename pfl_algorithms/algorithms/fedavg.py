"""FedAvg (McMahan et al., 2017): clients start each round from the global model; the server
averages their shared groups weighted by training-set size, w ← Σ_i (n_i / n) w_i.

BatchNorm statistics travel and are averaged with the parameters (as averaging whole
state_dicts does); what stays local (the head in permuted scenarios) is never sent.
"""
from __future__ import annotations

from ..api import Algorithm, Evaluation, Message


class FedAvg(Algorithm):
    """Federated averaging of the shared groups."""

    name = "fedavg"
    description = "clients train from the global model; the server averages them weighted by data size"

    def setup(self, server) -> None:
        self.global_model = server.initial_model()

    def configure(self, round_, clients):
        return Message(self.global_model)

    def upload(self, view):
        return view.message(view.received())

    def aggregate(self, round_, uploads):
        if uploads:
            self.global_model = uploads.weighted_mean()

    def evaluation(self, client):
        """The global model, with the client's local groups."""
        return Evaluation(Message(self.global_model))

    def state_dict(self) -> dict:
        return {"global_model": self.global_model}

    def load_state_dict(self, state: dict) -> None:
        self.global_model = {name: t.clone() for name, t in state["global_model"].items()}
