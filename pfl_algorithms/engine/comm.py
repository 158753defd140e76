"""Communication accounting: bits sent up (client → server) and down, per client and group.

Only what an algorithm actually sends is counted: it calls :meth:`CommLedger.send` with the
number of values (e.g. the nonzeros of a sparse μ above its threshold, plus their indices
where it sends them) and their width in bits.  Totals are reported in gigabits as in
Factorized-FL's Table 1.
"""
from __future__ import annotations

from collections import defaultdict

DIRECTIONS = ("up", "down")


class CommLedger:
    """Running totals of bits, by (direction, group) and by (direction, client)."""

    def __init__(self):
        self.by_group: dict[tuple[str, str], float] = defaultdict(float)
        self.by_client: dict[tuple[str, int], float] = defaultdict(float)

    def send(self, direction: str, client: int, group: str, values: float, bits_per_value: int = 32) -> None:
        """Record ``values`` values of ``bits_per_value`` bits sent by/to ``client``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if values < 0:
            raise ValueError(f"values must be >= 0, got {values}")
        bits = float(values) * bits_per_value
        self.by_group[(direction, group)] += bits
        self.by_client[(direction, int(client))] += bits

    def total(self, direction: str) -> float:
        return sum(bits for (d, _), bits in self.by_group.items() if d == direction)

    def gigabits(self) -> dict:
        """Totals in Gb (10⁹ bits): up, down, and by group."""
        return {"up": self.total("up") / 1e9, "down": self.total("down") / 1e9,
                "by_group": {f"{d}:{g}": bits / 1e9 for (d, g), bits in sorted(self.by_group.items())}}

    def state_dict(self) -> dict:
        return {"by_group": [[d, g, b] for (d, g), b in self.by_group.items()],
                "by_client": [[d, c, b] for (d, c), b in self.by_client.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.by_group = defaultdict(float, {(d, g): b for d, g, b in state["by_group"]})
        self.by_client = defaultdict(float, {(d, int(c)): b for d, c, b in state["by_client"]})
