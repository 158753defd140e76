"""Post-training statistics an upload may ask for (``api.Statistic``), each answered by the
executor for each sender alone (``engine.cohort_stats``); an algorithm may define its own the
same way.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from pfl_kernels.ops import class_means

from .engine.messages import Statistic


@dataclass(frozen=True)
class ClassMeans(Statistic):
    """A client's class-mean embeddings of ``inputs`` [N, ...] by ``labels`` [N] in
    [0, ``num_classes``), of its extractor (its model's ``body``) after training, in eval mode:
    Fed-CMA's e_i^k.  Answered by (means [C, d], counts [C] int64).

    Raises:
        ValueError: labels not [N] for inputs [N, ...], or num_classes not an int >= 1.
    """

    inputs: Tensor
    labels: Tensor
    num_classes: int

    def __post_init__(self):
        if self.labels.dim() != 1 or self.inputs.shape[:1] != self.labels.shape:
            raise ValueError(f"ClassMeans needs labels [N] for inputs [N, ...], got {list(self.labels.shape)} and "
                             f"{list(self.inputs.shape)}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(f"ClassMeans num_classes must be an int >= 1, got {self.num_classes!r}")

    @classmethod
    def compute(cls, senders, requests):
        """A cohort's requests in one forward and one op, the batches padded with a label C that
        the op counts apart and that is then dropped."""
        num_classes = {r.num_classes for r in requests}
        if len(num_classes) != 1:
            raise ValueError(f"the ClassMeans requests of one round must share num_classes, got {sorted(num_classes)}")
        c = num_classes.pop()
        features = senders.features(senders.pad([r.inputs for r in requests]))
        means, counts = class_means(features, senders.pad([r.labels for r in requests], c), c + 1)
        return list(zip(means[:, :c], counts[:, :c]))
