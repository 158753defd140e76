"""Messages between the server and a client, and how many bits each one costs.

A :class:`Message` carries named tensors, one per parameter group (plus ``buffers`` for the
BatchNorm statistics), and extras (class means, mixing weights, losses, ...).  The server's
downloads and the clients' uploads are messages; the engine applies downloads to client
state, gathers uploads, and counts every message it moves in the run's ledger.  No
algorithm counts anything itself.

The counting rule (:func:`payload_bits`), per message:

* a dense tensor: its element count × the bits of its dtype as stored (float32 32, bfloat16
  16, float64 64, int64 64, bool 8);
* a :class:`Sparse` tensor: the entries it keeps (|x| ≥ threshold; x ≠ 0 when the threshold
  is 0) × the bits of its dtype, plus ``index_bits`` per kept entry (0 by default: the papers
  count the values sent, e.g. Factorized-FL's cost of u, v and the nonzeros of μ);
* an extra: tensors as above; each Python number as one 32-bit value; lists, tuples and
  dicts of those, summed;
* ``num_examples`` is metadata of the message and costs nothing.

A download sent to M clients is counted M times (once per receiver); an upload is counted
when the server accepts it (a client whose update is not finite sends nothing).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch
from torch import Tensor

SCALAR_BITS = 32


@dataclass(frozen=True)
class Sparse:
    """A tensor sent sparsely: only the entries with |x| ≥ ``threshold`` (x ≠ 0 for 0) travel.

    ``index_bits``: bits counted per kept entry for its position (0: values only).
    """

    tensor: Tensor
    threshold: float = 0.0
    index_bits: int = 0

    def __post_init__(self):
        if not isinstance(self.tensor, Tensor):
            raise TypeError(f"Sparse needs a tensor, got {type(self.tensor).__name__}")
        if not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if isinstance(self.index_bits, bool) or not isinstance(self.index_bits, int) or self.index_bits < 0:
            raise ValueError(f"index_bits must be an int >= 0, got {self.index_bits!r}")
        # Counted where the payload is made: a client's upload on its worker thread, in
        # parallel with the other clients, not on the server's thread when it is recorded.
        kept = torch.count_nonzero(self.tensor.detach()) if self.threshold == 0 else self.kept().sum()
        object.__setattr__(self, "_kept_count", int(kept))

    def kept(self) -> Tensor:
        """Bool mask of the entries that travel."""
        t = self.tensor.detach()
        return t.abs() >= self.threshold if self.threshold > 0 else t != 0  # |x| != 0 iff x != 0

    def dense(self) -> Tensor:
        """What the receiver gets: the tensor with the entries that did not travel set to +0.0
        (threshold 0: the tensor's zeros are the entries that did not travel, and a −0.0 among
        them arrives as +0.0, its sign not sent, as on every transport)."""
        if self.threshold == 0:
            # -0.0 + 0 = +0.0; every other value, NaN included, is itself
            return self.tensor + 0 if self.tensor.is_floating_point() else self.tensor
        return torch.where(self.kept(), self.tensor, torch.zeros((), dtype=self.tensor.dtype,
                                                                 device=self.tensor.device))

    def bits(self) -> float:
        """The cost of this payload (module docstring)."""
        return float(self._kept_count) * (dtype_bits(self.tensor.dtype) + self.index_bits)


Payload = Union[Tensor, Sparse]


class Statistic:
    """A statistic an upload asks for in its extras, computed after training for each sender
    alone (``engine.cohort_stats``): Fed-CMA's class-mean embeddings.  A subclass holds
    what the client asks about (its inputs) and defines ``compute(senders, requests)``, a
    classmethod giving the answers of a cohort's requests of its kind, in order, from a
    :class:`~pfl_algorithms.engine.cohort_stats.Senders` (the senders' models after training,
    stacked).  The executor puts each answer in its request's place before the upload is
    counted, aggregated or sent; a request itself travels nowhere and costs nothing."""

    @classmethod
    def compute(cls, senders, requests: list) -> list:
        raise NotImplementedError(f"{cls.__name__} must define compute(senders, requests)")


def dtype_bits(dtype: torch.dtype) -> int:
    """Bits of one element of ``dtype`` as stored."""
    return dtype.itemsize * 8


def payload_bits(value: Any) -> float:
    """The bits of one payload or extra, by the counting rule of the module docstring.

    Raises:
        TypeError: a value that is not a tensor, a Sparse, a number or a container of them.
    """
    if isinstance(value, Sparse):
        return value.bits()
    if isinstance(value, Tensor):
        return float(value.numel() * dtype_bits(value.dtype))
    if isinstance(value, (bool, int, float)):
        return float(SCALAR_BITS)
    if isinstance(value, Mapping):
        return sum(payload_bits(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bits(v) for v in value)
    raise TypeError(f"a message can carry tensors, Sparse tensors, numbers and lists/dicts of them, "
                    f"got {type(value).__name__}")


@dataclass(frozen=True)
class Message:
    """What one side sends the other.

    Attributes:
        tensors: group name -> payload ([P_g] flat, as the group's slice of a bank row), or
            ``buffers`` -> the floating buffers.  A download's tensors are written into the
            receiving client's state (unless ``apply`` is False); an upload's are what the
            server aggregates.
        extras: anything else the algorithm sends (tensors, numbers, lists/dicts of them).
        num_examples: the sender's training samples (uploads), for weighting.
        apply: a download's tensors are written into the client's model before its plan runs
            (True), or only received: the plan reads them from ``view.download`` and the
            client's model stays its own (False: FedDAF's target weighs the global source
            model against its own before mixing them, Eq. 2).
    """

    tensors: Mapping[str, Payload] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    num_examples: int = 0
    apply: bool = True

    def __post_init__(self):
        if not isinstance(self.apply, bool):
            raise TypeError(f"message apply must be True or False, got {self.apply!r}")
        for name, value in self.tensors.items():
            if not isinstance(value, (Tensor, Sparse)):
                raise TypeError(f"message tensor {name!r} must be a tensor or Sparse, got {type(value).__name__}")
        # Refuses what cannot be counted, when the message is made (a Statistic request is
        # counted once the engine has replaced it by its answer).
        payload_bits({k: v for k, v in self.extras.items() if not isinstance(v, Statistic)})

    def dense(self, name: str) -> Tensor:
        """Tensor ``name`` as the receiver sees it (a Sparse payload with its dropped entries 0)."""
        value = self.tensors[name]
        return value.dense() if isinstance(value, Sparse) else value

    def bits(self) -> float:
        """The cost of this message (module docstring)."""
        return payload_bits(dict(self.tensors)) + payload_bits(dict(self.extras))
