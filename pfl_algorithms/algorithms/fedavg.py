"""FedAvg (McMahan et al., 2017): clients start each round from the global model; the server
averages their shared groups weighted by training-set size, w ← Σ_i (n_i / n) w_i.

BatchNorm statistics travel and are averaged with the parameters (as averaging whole
state_dicts does); what stays local (the head in permuted scenarios) is never sent.

In the ``fda`` scenario the target client trains by ``target_lr``, ``target_batch_size`` and
``target_epochs`` where given (``target_only.TargetTraining``): FedDAF's paper trains every
method's target with the same learning rate, batch and one epoch (§5.2.4), FedAvg's included.
"""
from __future__ import annotations

from typing import Optional

from ..api import Algorithm, Evaluation, Message
from .target_only import TargetTraining, target_phase, the_target


class FedAvg(Algorithm):
    """Federated averaging of the shared groups."""

    name = "fedavg"
    description = "clients train from the global model; the server averages them weighted by data size"
    Settings = TargetTraining
    target: Optional[int] = None  # the fda scenario's target client, known from setup on

    def setup(self, server) -> None:
        self.target = the_target(server, self.name, required=False)
        given = self.settings.given() if isinstance(self.settings, TargetTraining) else []
        if self.target is None and given:
            raise ValueError(f"{self.name}: {', '.join(given)} need a target client (the fda scenario)")
        self.global_model = server.initial_model()

    def plan(self, client):
        """The run's training; the target's by its target settings (a subclass with other
        settings trains every client alike)."""
        if client == self.target and isinstance(self.settings, TargetTraining):
            return (target_phase(self.settings),)
        return super().plan(client)

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
