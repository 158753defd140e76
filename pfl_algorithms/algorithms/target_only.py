"""Target-only (the "Target only" row of FedDAF's Tables 1 and 2: centralized training on the
target's data): in the ``fda`` scenario the target client trains alone on its own scarce
data, and the sources do nothing at all: no training, no download, no upload.  The target is
evaluated with its own model; the run's summary reports its accuracy (``target_*``).

Its local training is the run's optimizer and schedule unless ``target_lr``,
``target_batch_size`` or ``target_epochs`` say otherwise.  FedDAF's paper trains the target
with one learning rate and a batch size of 16 for every method of its tables; ``feddaf``
defaults to lr 1e-3, batch 16, one epoch (the README facts), so a comparison passes those
here too.  The same three settings, with the same meaning, are offered by ``fedgp`` and
``feddwa`` (:class:`TargetTraining`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..api import Algorithm, Capabilities, Phase, PositiveFloat, PositiveInt


@dataclass(frozen=True)
class TargetTraining:
    """How the target client trains (None: as every client, with the run's settings)."""

    target_lr: Optional[PositiveFloat] = None
    target_batch_size: Optional[PositiveInt] = None
    target_epochs: Optional[PositiveInt] = None

    def given(self) -> list[str]:
        """The names of the settings that are not None."""
        return [name for name in ("target_lr", "target_batch_size", "target_epochs")
                if getattr(self, name) is not None]


def target_phase(settings: TargetTraining, **options) -> Phase:
    """The target's phase of local training: the run's, with the target's lr, batch size and
    epochs where ``settings`` gives them; ``options`` are further :class:`Phase` fields."""
    return Phase(epochs=settings.target_epochs, lr=settings.target_lr, batch_size=settings.target_batch_size,
                 **options)


def the_target(server, name: str, *, required: bool = True) -> Optional[int]:
    """The scenario's one ``target`` client (ValueError, naming the algorithm, if there are
    several; if there is none, too when ``required``, else None)."""
    try:
        targets = server.clients_with_role("target")
    except ValueError:
        if required:
            raise
        return None
    if len(targets) != 1:
        raise ValueError(f"{name} needs exactly one target client, the scenario has {len(targets)}")
    return int(targets[0])


class TargetOnly(Algorithm):
    """The target trains alone; the sources neither train nor communicate."""

    name = "target-only"
    description = "fda: the target client trains alone on its own data; the sources do nothing"
    Settings = TargetTraining
    capabilities = Capabilities(roles=("source", "target"))

    def setup(self, server) -> None:
        self.target = the_target(server, self.name)

    def plan(self, client):
        # A source's plan is one phase of zero steps rather than none: it trains nothing, and
        # the engine's evaluation fine-tuning (which trains what the plan trains) still
        # sees a phase over every group.
        return (target_phase(self.settings) if client == self.target else Phase(steps=0),)
