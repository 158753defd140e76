"""Local training: a client's epochs of SGD on the working model, batches gathered on the device.

Batches are index tensors into the dataset held on the device (``inputs[idx]``), shuffled
with a generator derived from (seed, round, client), so a round is reproducible on its own
and a resumed run draws the same batches as an uninterrupted one.  Algorithms add loss
terms (functions of the batch and the model's output, differentiated by autograd) and
gradient terms (closed-form additions to the flat gradient, e.g. FedProx's μ(w − w_global),
which cost one fused op instead of a graph over every tensor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .working import WorkingModel

# loss_term(module, inputs, labels, logits) -> scalar added to the loss
LossTerm = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# grad_term(params, grads) -> None, adds to grads in place (and returns the loss it stands for)
GradTerm = Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]]


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
        order = (torch.randperm(n, generator=generator, device="cpu").to(indices.device)
                 if schedule.shuffle else torch.arange(n, device=indices.device))
        stop = n - n % schedule.batch_size if schedule.drop_last and n >= schedule.batch_size else n
        for start in range(0, stop, schedule.batch_size):
            if schedule.steps is not None and given >= schedule.steps:
                return
            yield indices[order[start:start + schedule.batch_size]]
            given += 1
        epoch += 1


@dataclass
class LocalResult:
    """What one client's local training did: mean loss over its batches, samples seen, steps."""

    loss: float
    samples: int
    steps: int
    finite: bool


def train_locally(work: WorkingModel, optimizer, optimizer_state: dict, inputs: torch.Tensor,
                  labels: torch.Tensor, indices: torch.Tensor, schedule: LocalSchedule, *,
                  generator: Optional[torch.Generator] = None, label_map: Optional[torch.Tensor] = None,
                  loss_terms: Sequence[LossTerm] = (), grad_terms: Sequence[GradTerm] = (),
                  ranges=None, augment: Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = None,
                  lr_scale: float = 1.0) -> LocalResult:
    """Train the working model (already loaded with the client's state) on ``indices``.

    Args:
        work: the template module bound to flat vectors (see :class:`WorkingModel`).
        optimizer / optimizer_state: a flat rule (``engine.optim``) and the client's state views.
        inputs / labels: the whole dataset on the device; ``indices`` the client's training split.
        label_map: the client's class permutation (label seen = ``label_map[label]``).
        loss_terms / grad_terms: the algorithm's extra objective (see the module docstring).
        ranges: the flat parameter ranges this phase trains (None: all).

    Returns:
        a :class:`LocalResult`; ``finite`` is False when a loss or the parameters became NaN/Inf
        (the engine then keeps the client's previous state).
    """
    module = work.module
    module.train()
    total = torch.zeros((), dtype=torch.float64, device=work.params.device)
    samples = steps = 0
    for batch in client_batches(indices, schedule, generator):
        x = inputs[batch]
        y = labels[batch]
        if label_map is not None:
            y = label_map[y]
        if augment is not None:
            x = augment(x, generator)
        work.zero_grad()
        logits = module(x)
        loss = F.cross_entropy(logits, y)
        for term in loss_terms:
            loss = loss + term(module, x, y, logits)
        loss.backward()
        extra = 0.0
        for term in grad_terms:
            value = term(work.params, work.grads)
            if value is not None:
                extra = extra + value
        optimizer.step(work.params, work.grads, optimizer_state, ranges=ranges, lr_scale=lr_scale)
        total += (loss.detach() + extra) * y.numel()
        samples += y.numel()
        steps += 1
    mean = float(total / samples) if samples else float("nan")
    finite = bool(torch.isfinite(work.params).all()) and (samples == 0 or bool(torch.isfinite(total)))
    return LocalResult(loss=mean, samples=samples, steps=steps, finite=finite)


@torch.no_grad()
def evaluate(module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor, *,
             label_map: Optional[torch.Tensor] = None, batch_size: int = 512) -> tuple[float, float, int]:
    """(accuracy, mean loss, samples) of ``module`` on ``indices``, in eval mode."""
    was_training = module.training
    module.eval()
    correct = torch.zeros((), dtype=torch.int64, device=inputs.device)
    loss = torch.zeros((), dtype=torch.float64, device=inputs.device)
    for start in range(0, indices.numel(), batch_size):
        batch = indices[start:start + batch_size]
        y = labels[batch]
        if label_map is not None:
            y = label_map[y]
        logits = module(inputs[batch])
        loss += F.cross_entropy(logits, y, reduction="sum").double()
        correct += (logits.argmax(1) == y).sum()
    module.train(was_training)
    n = indices.numel()
    if n == 0:
        return float("nan"), float("nan"), 0
    return float(correct) / n, float(loss) / n, n
