"""Communication accounting: bits sent up (client → server) and down, per client and payload.

The engine records every message it moves (``engine.messages`` has the counting rule);
algorithms never call the ledger.  Totals are reported in gigabits as in Factorized-FL's
Table 1, by payload name (a parameter group, ``buffers``, or ``extras``) and, in a federation of
several architectures, by cohort (each cohort's payloads: Fed-CMA's clients send classifiers of
one shape but bodies of none).
"""
from __future__ import annotations

from collections import defaultdict

from .messages import Message, payload_bits

DIRECTIONS = ("up", "down")


class CommLedger:
    """Running totals of bits, by (direction, payload name), by (direction, client) and by
    (direction, cohort)."""

    def __init__(self):
        self.by_group: dict[tuple[str, str], float] = defaultdict(float)
        self.by_client: dict[tuple[str, int], float] = defaultdict(float)
        self.by_cohort: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, direction: str, client: int, message: Message, cohort: str = "") -> None:
        """Count ``message`` sent to (``down``) or by (``up``) ``client`` of ``cohort`` (its
        architecture's name)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        parts = {name: payload_bits(value) for name, value in message.tensors.items()}
        if message.extras:
            parts["extras"] = payload_bits(dict(message.extras))
        for name, bits in parts.items():
            self.by_group[(direction, name)] += bits
            self.by_client[(direction, int(client))] += bits
            self.by_cohort[(direction, cohort)] += bits

    def total(self, direction: str) -> float:
        return sum(bits for (d, _), bits in self.by_group.items() if d == direction)

    def gigabits(self) -> dict:
        """Totals in Gb (10⁹ bits): up, down, by payload, and by cohort when there are several."""
        totals = {"up": self.total("up") / 1e9, "down": self.total("down") / 1e9,
                  "by_group": {f"{d}:{g}": bits / 1e9 for (d, g), bits in sorted(self.by_group.items())}}
        if len({cohort for _, cohort in self.by_cohort}) > 1:
            totals["by_cohort"] = {f"{d}:{c}": bits / 1e9 for (d, c), bits in sorted(self.by_cohort.items())}
        return totals

    def state_dict(self) -> dict:
        return {"by_group": [[d, g, b] for (d, g), b in self.by_group.items()],
                "by_client": [[d, c, b] for (d, c), b in self.by_client.items()],
                "by_cohort": [[d, c, b] for (d, c), b in self.by_cohort.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.by_group = defaultdict(float, {(d, g): b for d, g, b in state["by_group"]})
        self.by_client = defaultdict(float, {(d, int(c)): b for d, c, b in state["by_client"]})
        self.by_cohort = defaultdict(float, {(d, c): b for d, c, b in state.get("by_cohort", [])})
