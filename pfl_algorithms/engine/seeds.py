"""Seeds of a run's random streams, mixed by an explicit function (never Python's ``hash``).

Every random draw of a run comes from a ``torch.Generator`` seeded by :func:`mix_seed` of
(run seed, stream, round, client): a round depends only on the banks at its start, so a
resumed run draws what an uninterrupted one draws, on any platform and Python version.

The mixing function is SplitMix64 (Steele, Lea and Flood, 2014) chained over the parts:

    h₀ = 0;  hᵢ = splitmix64(hᵢ₋₁ XOR (partᵢ mod 2⁶⁴));  seed = h_n mod 2⁶³

where ``splitmix64(x)`` adds the golden-ratio increment 0x9E3779B97F4A7C15 to x and applies
the finalizer z ← (z XOR z≫30)·0xBF58476D1CE4E5B9, z ← (z XOR z≫27)·0x94D049BB133111EB,
z ← z XOR z≫31 (all mod 2⁶⁴).  Negative parts (client −1 for "no client") enter as their
two's complement.  Python's ``hash`` of a tuple, used before, is an implementation detail
of CPython (its algorithm changed in 3.8) and differs between 32- and 64-bit builds.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

# The streams of a run: one per purpose, so that drawing more for one never shifts another.
# "server": the algorithm's own draws on the server (``Server.generator``, SimFed's criteria input, FedFomo's picks).
# "client": the algorithm's own draws on a client (``ClientView.generator``, Fed-CMA's fixed per-class batch).
STREAMS = {"sample": 1, "train": 2, "eval": 3, "finetune": 4, "server": 5, "client": 6}


def splitmix64(x: int) -> int:
    """One SplitMix64 step of ``x`` (an int in [0, 2⁶⁴)): the next state's output."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2⁶³) from integer ``parts``, by chained SplitMix64 (module docstring).

    Raises:
        TypeError: a part that is not an int (bools are refused too).
    """
    h = 0
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int):
            raise TypeError(f"seed parts must be ints, got {part!r}")
        h = splitmix64(h ^ (part & _MASK64))
    return h & 0x7FFF_FFFF_FFFF_FFFF


def stream_generator(seed: int, stream: str, round_: int, client: int = -1) -> torch.Generator:
    """The CPU generator of ``stream`` (a key of :data:`STREAMS`) for one round and client."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {sorted(STREAMS)}, got {stream!r}")
    return torch.Generator().manual_seed(mix_seed(seed, STREAMS[stream], round_, client))
