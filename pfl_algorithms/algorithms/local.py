"""Local (Stand-Alone): every client trains only on its own data; nothing is sent."""
from __future__ import annotations

from ..api import Algorithm


class Local(Algorithm):
    """Each client trains alone (the papers' Stand-Alone / Local baseline): the contract's defaults."""

    name = "local"
    description = "each client trains alone on its own data; no communication"
