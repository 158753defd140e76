"""Local (Stand-Alone): every client trains only on its own data; nothing is sent."""
from __future__ import annotations

from ..api import Algorithm, Capabilities


class Local(Algorithm):
    """Each client trains alone (the papers' Stand-Alone / Local baseline): the contract's defaults."""

    name = "local"
    description = "each client trains alone on its own data; no communication"
    capabilities = Capabilities(mixed_architectures=True)  # it shares nothing, so any architectures do

    def local_groups(self, *, keep_head_local: bool) -> set[str]:
        """Every group: nothing ever leaves a client."""
        return {"body", "head"}
