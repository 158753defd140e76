"""Post-training statistics, computed for every sender of a cohort at once.

An upload may ask for a statistic of its client's model after training with a
:class:`~pfl_algorithms.engine.messages.Statistic` request in its extras (Fed-CMA's class-mean
embeddings e_i^k).  The executor that ran the round's training tasks answers them where the
clients' rows are authoritative (:func:`answer_statistics`: the sequential, threaded and
batched executors after the round's tasks, each rank of the distributed one for its own
clients, a Flower node for its client), before any upload is counted, aggregated or sent.  Per
cohort and kind of request, one ``compute(senders, requests)`` call answers them all from a
:class:`Senders`, whose :meth:`Senders.features` runs the senders' extractors as one vmapped
forward (each with its own stored parameters and buffers, in eval mode, without gradient).  The
answers are what each client would compute alone; computing them per cohort is how a
simulation of many clients runs them fast.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.func import functional_call, vmap

from .messages import Statistic

BODY = "body."


class Senders:
    """The clients of one cohort whose requests of one kind are answered together (``clients``,
    in request order), their models as they stored them after training."""

    def __init__(self, cohort, clients: list[int]):
        self.clients = list(clients)
        self._cohort = cohort

    def pad(self, tensors: list, fill=0) -> torch.Tensor:
        """[K, N, ...]: the senders' tensors [N_k, ...] (one each, in order) stacked, each padded
        with ``fill`` to the longest N (a request's per-sample inputs or labels, batched)."""
        first = tensors[0]
        out = torch.full((len(tensors), max(t.shape[0] for t in tensors), *first.shape[1:]), fill, dtype=first.dtype,
                         device=first.device)
        for k, t in enumerate(tensors):
            out[k, :t.shape[0]] = t
        return out

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """[K, N, d]: each sender's extractor (its model's ``body``) applied to its own inputs
        ``inputs`` [K, N, ...] (K = len(clients)), in one vmapped forward in eval mode and
        without gradient; the model's train mode is left as it was.

        Raises:
            TypeError: the model has no ``body`` module.
        """
        cohort = self._cohort
        module = cohort.module
        body = getattr(module, "body", None)
        if not isinstance(body, torch.nn.Module):
            raise TypeError(f"a statistic of the extractor needs a model with a 'body', got {type(module).__name__}")
        rows = torch.tensor([cohort.row(c) for c in self.clients], device=cohort.params.data.device)
        params, buffers = cohort.params.data[rows], cohort.buffers.data[rows]

        def embed(flat_params, flat_buffers, x):
            state = {**cohort.layout.views(flat_params), **cohort.buffer_layout.views(flat_buffers)}
            return functional_call(body, {name[len(BODY):]: t for name, t in state.items() if name.startswith(BODY)},
                                   (x,))

        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return vmap(embed)(params, buffers, inputs)
        finally:
            module.train(training)


def answer_statistics(fed, results) -> None:
    """Replace every :class:`Statistic` request in the uploads of ``results`` (TrainResults whose
    clients' rows hold their state after training) by its answer: one ``compute`` per cohort and
    kind of request, over that cohort's senders in result order.

    Raises:
        ValueError: a ``compute`` gave a number of answers other than its requests'.
    """
    pending: dict[tuple, list] = {}
    for result in results:
        if result.upload is None:
            continue
        for key, value in result.upload.extras.items():
            if isinstance(value, Statistic):
                pending.setdefault((fed.cohort_of(result.client).name, type(value)), []).append((result, key, value))
    cohorts = {cohort.name: cohort for cohort in fed.cohorts}
    for (name, kind), items in pending.items():
        answers = list(kind.compute(Senders(cohorts[name], [result.client for result, _, _ in items]),
                                    [request for _, _, request in items]))
        if len(answers) != len(items):
            raise ValueError(f"{kind.__name__}.compute gave {len(answers)} answers to {len(items)} requests")
        for (result, key, _), answer in zip(items, answers):
            result.upload = replace(result.upload, extras={**result.upload.extras, key: answer})
