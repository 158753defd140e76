"""The algorithm API: a small class per method, with hooks the round loop calls.

The engine (``engine.federation``) owns sampling, local training, evaluation, accounting
and checkpoints.  An algorithm says only what is particular to it:

* ``Settings``: its hyperparameters (a dataclass; any field can be set from the command line;
  each field's type hint, with ``option_types.Range`` markers, is the type and range every
  value is checked against);
* ``local_parameter_names``: what never leaves a client;
* ``begin_round``: what the sampled clients receive;
* ``local_terms``: extra loss / gradient terms of the local objective;
* ``end_round``: how the server combines what the clients sent;
* ``evaluate_client``: which model a client is evaluated with.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from ..engine.federation import Federation
from ..option_types import check_options, field_hints


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """An algorithm without hyperparameters."""


def make_settings(cls, name: str, values: dict):
    """``cls(**values)``, with unknown names reported together with the valid ones and every
    value checked against its field's declared type and range (ValueError naming it)."""
    hints = field_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"{name} has no setting {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(sorted(hints)) or 'none'}")
    return cls(**check_options(name, values, hints))


class Algorithm:
    """Base class: every hook does nothing, so a subclass states only its own rule."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Settings: ClassVar[type] = NoSettings

    def __init__(self, **settings):
        self.settings = make_settings(self.Settings, self.name, settings)

    def local_parameter_names(self, model: nn.Module, *, keep_head_local: bool) -> tuple[str, ...]:
        """Parameters that never leave a client: the head where the scenario asks for it."""
        return tuple(n for n, _ in model.named_parameters() if n.startswith("head.")) if keep_head_local else ()

    def setup(self, fed: Federation) -> None:
        """Create server state once the federation exists."""

    def begin_round(self, fed: Federation, clients: torch.Tensor, round_: int) -> None:
        """Send the sampled clients what they receive (and record it in ``fed.comm``)."""

    def local_terms(self, fed: Federation, client: int) -> dict:
        """Extra terms of the client's objective: ``{'loss_terms': [...], 'grad_terms': [...]}``."""
        return {}

    def train_client(self, fed: Federation, client: int, round_: int):
        """One client's local training (the engine's, with this algorithm's terms)."""
        return fed.train_client(client, round_, **self.local_terms(fed, client))

    def end_round(self, fed: Federation, clients: torch.Tensor, finite: torch.Tensor, round_: int) -> None:
        """Combine the uploads of ``clients[finite]`` (non-finite updates are never aggregated)."""

    def evaluate_client(self, fed: Federation, client: int, split: str = "test"):
        """(accuracy, loss, samples) of the model ``client`` is evaluated with (default: its own)."""
        return fed.evaluate_client(client, split)

    def state_dict(self) -> dict:
        """Server state for checkpoints."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
