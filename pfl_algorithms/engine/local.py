"""The pieces of local training the client tasks share: a client's batches and evaluation.

Batches are index tensors into the dataset held on the device (``inputs[idx]``), shuffled
with a generator derived from (seed, round, client), so a round is reproducible on its own
and a resumed run draws the same batches as an uninterrupted one.  The training loop itself
is in ``client.py`` (phases of a plan).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class LocalSchedule:
    """How much a client trains per round: ``epochs`` passes, or exactly ``steps`` batches."""

    batch_size: int = 64
    epochs: int = 1
    steps: Optional[int] = None
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.steps is None and self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.steps is not None and self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


def client_batches(indices: torch.Tensor, schedule: LocalSchedule,
                   generator: Optional[torch.Generator] = None) -> Iterator[torch.Tensor]:
    """The index batches of one client's local training, in order.

    Each epoch is a fresh permutation (``schedule.shuffle``) cut into batches; with ``steps``
    the epochs repeat until that many batches were given.  A client with no samples gets none.
    """
    n = indices.numel()
    if n == 0:
        return
    given = 0
    epoch = 0
    while True:
        if schedule.steps is None and epoch >= schedule.epochs:
            return
        # One gather per epoch; each batch is a slice of it (a view, no work of its own).
        shuffled = (indices[torch.randperm(n, generator=generator, device="cpu").to(indices.device)]
                    if schedule.shuffle else indices)
        stop = n - n % schedule.batch_size if schedule.drop_last and n >= schedule.batch_size else n
        for start in range(0, stop, schedule.batch_size):
            if schedule.steps is not None and given >= schedule.steps:
                return
            yield shuffled[start:start + schedule.batch_size]
            given += 1
        epoch += 1


@dataclass
class LocalResult:
    """What one client's local training did: mean loss over its batches, samples seen, steps."""

    loss: float
    samples: int
    steps: int
    finite: bool


def conv_layout(batch: torch.Tensor) -> torch.Tensor:
    """A batch of images in the memory layout CPU convolutions run fastest on: channels-last
    (oneDNN's native layout; the values are the same).  One LeNet-5 step on 64 CIFAR-shaped
    images on one thread: 5.7 ms against 7.6 ms NCHW; ResNet-9: 756 against 826 ms; the digits
    CNN: no change.  Other batches, and batches on a GPU, are returned as they are."""
    if batch.dim() == 4 and batch.device.type == "cpu" and batch.is_floating_point():
        return batch.contiguous(memory_format=torch.channels_last)
    return batch


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` for a 1-D integer ``index``; channels-last images stay channels-last,
    gathered as rows of their NHWC view (64 CIFAR images: 0.03 ms against 0.06 ms for
    ``t[index]``, one thread).  Training and evaluation batches are gathered so."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return t.permute(0, 2, 3, 1).index_select(0, index).permute(0, 3, 1, 2)
    return t[index]


class ChunkGather:
    """The batches of several clients at once, as each gathers its own (``client.training_batch``
    without augmentation, ``evaluate``): one gather of the inputs and one of the labels for all,
    the clients' label maps (``label_maps``, one per client, None: none) applied as one gather of
    their stacked rows."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, label_maps: list):
        self.inputs, self.labels = inputs, labels
        self.maps = None
        if any(m is not None for m in label_maps):
            identity = torch.arange(next(m for m in label_maps if m is not None).numel(), device=labels.device)
            self.maps = torch.stack([identity if m is None else m for m in label_maps])

    def __call__(self, batches: list, clients: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [G, B, ...], y [G, B]) of ``batches`` (G index tensors of one size B), of the clients
        at positions ``clients`` of the label maps (None: all, in order)."""
        index = torch.cat(batches)
        count = len(batches)
        x = conv_layout(gather_rows(self.inputs, index))
        y = self.labels[index].view(count, -1)
        if self.maps is not None:
            y = (self.maps if clients is None or len(clients) == len(self.maps) else self.maps[clients]).gather(1, y)
        return x.view(count, -1, *x.shape[1:]), y


# Samples per forward of an evaluation (per client, where clients are scored in chunks).
EVAL_BATCH = 512


@torch.no_grad()
def evaluate(module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, *,
             label_map: Optional[torch.Tensor] = None, batch_size: int = EVAL_BATCH) -> tuple[float, float, int]:
    """(accuracy, mean loss, samples) of ``module`` on ``indices``, in eval mode, without autograd.

    A non-finite loss (a diverged model: NaN or infinite logits) gives NaN accuracy, not the
    accuracy of the argmax of NaN logits: a diverged model is never scored."""
    was_training = module.training
    module.eval()
    correct = torch.zeros((), dtype=torch.int64, device=inputs.device)
    loss = torch.zeros((), dtype=torch.float64, device=inputs.device)
    for start in range(0, indices.numel(), batch_size):
        batch = indices[start:start + batch_size]
        y = labels[batch]
        if label_map is not None:
            y = label_map[y]
        logits = module(conv_layout(gather_rows(inputs, batch)))
        loss += F.cross_entropy(logits, y, reduction="sum").double()
        correct += (logits.argmax(1) == y).sum()
    module.train(was_training)
    # Both totals in one read (one device sync on a GPU, not one each); the count is exact in
    # float64 (below 2^53 samples).
    correct_total, loss_total = torch.stack((correct.double(), loss)).tolist()
    return scores(correct_total, loss_total, indices.numel())


def scores(correct, loss_sum, n: int) -> tuple[float, float, int]:
    """(accuracy, mean loss, samples) from the count of correct predictions and the summed
    loss over ``n`` samples (numbers, or 0-dim tensors, each then read on its own): NaN for
    none, and NaN accuracy where the loss is not finite (a diverged model is never scored)."""
    if n == 0:
        return float("nan"), float("nan"), 0
    mean_loss = float(loss_sum) / n
    if not math.isfinite(mean_loss):
        return float("nan"), mean_loss, n
    return float(correct) / n, mean_loss, n
