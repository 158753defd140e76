"""Client statistics computed for every sender of a cohort at once.

An upload may ask for its client's class-mean embeddings with a :class:`ClassMeans` request in
its extras (Fed-CMA's e_i^k).  After the round's training tasks, the engine answers all of a
cohort's requests together: one vmapped forward of the senders' extractors (each with its own
stored parameters and buffers, in eval mode, without gradient) over their batches, padded to
one length, and one ``pfl.class_means`` op over [K, N, d].  The result is what each client would
compute alone (its extractor at the end of its training, applied to its own batch); doing it
per cohort is how a simulation of many clients runs it fast, and is where the batched executor
will do every client's work.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.func import functional_call, vmap

from pfl_kernels.ops import class_means

from .messages import ClassMeans

BODY = "body."


def resolve_class_means(fed, results) -> None:
    """Replace every :class:`ClassMeans` request in the uploads of ``results`` (the round's
    TrainResults) by (means [C, d], counts [C]), one batched computation per cohort."""
    pending: dict[str, list] = {}
    for result in results:
        if result.upload is None:
            continue
        for key, value in result.upload.extras.items():
            if isinstance(value, ClassMeans):
                pending.setdefault(fed.cohort_of(result.client).name, []).append((result, key, value))
    for cohort in fed.cohorts:
        items = pending.get(cohort.name)
        if not items:
            continue
        means, counts = cohort_class_means(cohort, [result.client for result, _, _ in items],
                                           [request for _, _, request in items])
        for i, (result, key, _) in enumerate(items):
            result.upload = replace(result.upload, extras={**result.upload.extras, key: (means[i], counts[i])})


def cohort_class_means(cohort, clients: list[int], requests: list[ClassMeans]) -> tuple[torch.Tensor, torch.Tensor]:
    """(means [K, C, d], counts [K, C]) of ``requests`` for ``clients`` of ``cohort``, from their
    stored rows: the batches are padded to the longest with a label C that the op counts apart
    and that is then dropped."""
    classes = {r.num_classes for r in requests}
    if len(classes) != 1:
        raise ValueError(f"the ClassMeans requests of one round must share num_classes, got {sorted(classes)}")
    num_classes = classes.pop()
    module = cohort.module
    body = getattr(module, "body", None)
    if not isinstance(body, torch.nn.Module):
        raise TypeError(f"ClassMeans needs a model with a 'body' (the extractor), got {type(module).__name__}")
    length = max(r.labels.numel() for r in requests)
    first = requests[0].inputs
    inputs = first.new_zeros((len(requests), length, *first.shape[1:]))
    labels = torch.full((len(requests), length), num_classes, dtype=torch.int64, device=first.device)
    for k, request in enumerate(requests):
        inputs[k, :request.labels.numel()] = request.inputs
        labels[k, :request.labels.numel()] = request.labels
    rows = torch.tensor([cohort.row(c) for c in clients], device=cohort.params.data.device)
    params, buffers = cohort.params.data[rows], cohort.buffers.data[rows]

    def embed(flat_params, flat_buffers, x):
        state = {**cohort.layout.views(flat_params), **cohort.buffer_layout.views(flat_buffers)}
        return functional_call(body, {name[len(BODY):]: t for name, t in state.items() if name.startswith(BODY)}, (x,))

    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            features = vmap(embed)(params, buffers, inputs)
    finally:
        module.train(training)
    means, counts = class_means(features, labels, num_classes + 1)
    return means[:, :num_classes], counts[:, :num_classes]
