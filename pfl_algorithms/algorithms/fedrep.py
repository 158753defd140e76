"""FedRep (Collins et al., ICML 2021, Algorithm 1): each round a client first trains its own head
for ``head_epochs`` with the received body fixed, then the body for the run's local schedule with
the head fixed; only the body is sent, and the server averages it weighted by data size.

``head_steps`` gives the head phase in optimizer steps instead of epochs, so that FedRep can
share a budget of local steps with other methods (``split_step_budget``: the head takes 10 of
every 11 steps, as the released code's 10 head epochs to 1 body epoch).

The two phases keep separate optimizer states (momentum, Adam's moments and step counts).
Clients are evaluated, as in the authors' code, with the global body and their own head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..api import NonNegativeInt, Phase, PositiveInt
from .fedper import FedPer


@dataclass(frozen=True)
class FedRepSettings:
    head_epochs: NonNegativeInt = 10  # the released code's local_ep - local_rep_ep (11 - 1)
    head_steps: Optional[PositiveInt] = None  # the head phase in optimizer steps (replaces head_epochs)


class FedRep(FedPer):
    """FedPer's sharing (the body; every head stays with its client), trained head first."""

    name = "fedrep"
    description = "each round: train the local head (body fixed), then the body (head fixed); average the body"
    Settings = FedRepSettings

    @classmethod
    def split_step_budget(cls, budget: int) -> tuple[int, dict]:
        """The head ``round(10 budget / 11)`` steps, the body (the run's schedule) the rest, at
        least one each: the released code's 10 head epochs to 1 body epoch (``local_ep`` 11,
        ``local_rep_ep`` 1); a budget of 10 is 9 head steps and 1 body step."""
        if budget < 2:
            raise ValueError(f"a budget of {budget} local steps does not split over fedrep's 2 phases (head, body)")
        head = min(max(round(10 * budget / 11), 1), budget - 1)
        return budget - head, {"head_steps": head}

    @classmethod
    def optimizer_steps(cls, local_steps: int, settings):
        head = settings.get("head_steps")
        return None if head is None else head + local_steps  # None: the head counts epochs

    def plan(self, client):
        s = self.settings
        head = {"steps": s.head_steps} if s.head_steps is not None else {"epochs": s.head_epochs}
        return (Phase(groups=("head",), state="head", **head),
                Phase(groups=("body",), state="body"))
