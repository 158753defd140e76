"""Post-training statistics, computed for each sender alone.

An upload may ask for a statistic of its client's model after training with a
:class:`~pfl_algorithms.engine.messages.Statistic` request in its extras (Fed-CMA's class-mean
embeddings e_i^k).  The executor that ran the round's training tasks answers them where the
clients' rows are authoritative (:func:`answer_statistics`: the sequential, threaded and
batched executors after the round's tasks, each rank of the distributed one for its own
clients, a Flower node for its client), before any upload is counted, aggregated or sent.

Each request is answered by one ``compute(senders, requests)`` call over a :class:`Senders` of
its client alone, on one intra-op thread (as the client trained): the answer is then bitwise the
same whichever executor, rank or node answers it and whichever other clients it answers in the
same round.  Answering a cohort's requests together (one vmapped forward over the senders'
batches padded to the longest) is not: the padded length and the number of senders change the
kernels' blocking and so the last bits, which made a distributed or Flower Fed-CMA run differ
from a sequential one.  Per sender costs little: on a CPU, for a 20-client cohort of the digits
CNN, 1.1 to 1.3 times the grouped answer (medians of 21 to 23 ms against 17 to 22 ms a round),
next to about 80 ms of training those clients on 40 samples each.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.func import functional_call

from .intra_op import one_intra_op_thread
from .messages import Statistic

BODY = "body."


class Senders:
    """The clients whose requests of one kind a ``compute`` call answers (``clients``, in
    request order; :func:`answer_statistics` gives one), their models as they stored them after
    training."""

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
        ``inputs`` [K, N, ...] (K = len(clients)), one forward per sender with its stored
        parameters and buffers, in eval mode and without gradient; the model's train mode is
        left as it was.

        Raises:
            TypeError: the model has no ``body`` module.
        """
        cohort = self._cohort
        module = cohort.module
        body = getattr(module, "body", None)
        if not isinstance(body, torch.nn.Module):
            raise TypeError(f"a statistic of the extractor needs a model with a 'body', got {type(module).__name__}")

        def embed(client: int, x: torch.Tensor) -> torch.Tensor:
            row = cohort.row(client)
            state = {**cohort.layout.views(cohort.params.data[row]),
                     **cohort.buffer_layout.views(cohort.buffers.data[row])}
            return functional_call(body, {name[len(BODY):]: t for name, t in state.items() if name.startswith(BODY)},
                                   (x,))

        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return torch.stack([embed(client, x) for client, x in zip(self.clients, inputs, strict=True)])
        finally:
            module.train(training)


def answer_statistics(fed, results) -> None:
    """Replace every :class:`Statistic` request in the uploads of ``results`` (TrainResults whose
    clients' rows hold their state after training) by its answer: one ``compute`` per request,
    over a :class:`Senders` of its client alone, on one intra-op thread (module docstring).

    Raises:
        ValueError: a ``compute`` gave a number of answers other than one.
    """
    asked = [(result, key, request) for result in results if result.upload is not None
             for key, request in result.upload.extras.items() if isinstance(request, Statistic)]
    if not asked:
        return
    with one_intra_op_thread():
        for result, key, request in asked:
            answer = list(type(request).compute(Senders(fed.cohort_of(result.client), [result.client]), [request]))
            if len(answer) != 1:
                raise ValueError(f"{type(request).__name__}.compute gave {len(answer)} answers to 1 request")
            result.upload = replace(result.upload, extras={**result.upload.extras, key: answer[0]})
