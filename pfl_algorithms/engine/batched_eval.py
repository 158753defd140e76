"""Evaluation on the batched executor: a chunk of clients of one cohort scored together, each
batch of their test samples in one vmapped forward (eval mode, no autograd).

A client's evaluation model is its bank row (or the extra state its ``Evaluation`` names) with
the evaluation's download applied, as ``client.run_eval_task`` builds it; its samples go in
batches of ``local.evaluate``'s size, and at each batch position the clients whose batches have
the same size run together (no padding reaches a score).  Accuracy and loss follow
``local.scores``: a client with a non-finite loss gets NaN accuracy.  The numbers equal
``local.evaluate``'s up to float reassociation (a grouped convolution, per-client loss sums),
as the batched executor's training equals the sequential executor's.  An evaluation whose
plan only runs ``begin`` hooks (phases of no steps: IFCA's choice of its cluster model,
Factorized-FL's zeroing of small μ) runs them on each client's model first, as
``client.run_eval_task`` does; one that fine-tunes first runs on the threaded executor.
"""
from __future__ import annotations

import torch
from torch.func import functional_call, vmap
from torch.nn import functional as F

from .client import ClientView, EvalResult, apply_downloads, begin_on_rows
from .conv_gemm import batched_convolutions
from .local import EVAL_BATCH, ChunkGather, scores


def batchable_evaluation(task) -> bool:
    """Whether ``task`` (an EvalTask) scores its model without fine-tuning it first: a plan of
    begin hooks alone, if any (``_begins_only``)."""
    return all(_begins_only(phase) for phase in task.evaluation.plan)


def _begins_only(phase) -> bool:
    """A phase that takes no step and runs its ``begin`` hook: a change of the model, no training."""
    return phase.begin is not None and (phase.epochs == 0 or phase.steps == 0)


def _run_begins(fed, cohort, task, params, buffers, int_buffers) -> None:
    """``task``'s begin hooks on its client's model (the rows ``params``, ``buffers``,
    ``int_buffers``, changed in place), as ``client.run_eval_task`` runs its plan."""
    extra = {name: bank.row(cohort.row(task.client)).clone() for name, bank in cohort.extra.items()}
    view = ClientView(fed, cohort, task.client, task.round, task.evaluation.download, extra)
    begin_on_rows(view, task.evaluation.plan, params, buffers, int_buffers)


@torch.no_grad()
def evaluate_chunk(fed, cohort, tasks, batch_size: int = EVAL_BATCH) -> list[EvalResult]:
    """Score ``tasks`` (evaluations of clients of ``cohort`` that read the same bank and
    fine-tune nothing: ``batchable_evaluation``) together; nothing is stored."""
    rows = [cohort.row(t.client) for t in tasks]
    source = tasks[0].evaluation.params
    bank = cohort.params if source == "params" else cohort.extra[source]
    params, buffers = bank.data[rows].clone(), cohort.buffers.data[rows].clone()
    int_buffers = cohort.int_buffers.data[rows].clone()
    apply_downloads(cohort, params, buffers, [t.evaluation.download for t in tasks], [t.client for t in tasks])
    for i, task in enumerate(tasks):
        if task.evaluation.plan:
            _run_begins(fed, cohort, task, params[i], buffers[i], int_buffers[i])
    tensors = {**cohort.layout.views(params), **cohort.buffer_layout.views(buffers),
               **cohort.int_buffer_layout.views(int_buffers)}
    module = cohort.work.module

    def logits_of(client_tensors, inputs):  # the module's forward, as local.evaluate calls it
        return functional_call(module, client_tensors, (inputs,))

    datas = [fed.clients[t.client] for t in tasks]
    gather = ChunkGather(fed.inputs, fed.labels, [data.label_map for data in datas])
    indices = [data.part(t.split) for data, t in zip(datas, tasks)]
    correct = torch.zeros(len(tasks), dtype=torch.int64, device=params.device)
    loss = torch.zeros(len(tasks), dtype=torch.float64, device=params.device)
    was_training = module.training
    module.eval()
    try:
        for start in range(0, max((i.numel() for i in indices), default=0), batch_size):
            by_size: dict[int, list[int]] = {}
            for k, index in enumerate(indices):
                size = min(batch_size, index.numel() - start)
                if size > 0:
                    by_size.setdefault(size, []).append(k)
            for members in by_size.values():
                x, y = gather([indices[k][start:start + batch_size] for k in members], members)
                whole = len(members) == len(tasks)
                group = tensors if whole else {name: t[members] for name, t in tensors.items()}
                with batched_convolutions(fed.settings.batched_conv):
                    logits = vmap(logits_of)(group, x)
                at = torch.tensor(members, device=params.device)
                per_sample = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(members), -1)
                loss.index_add_(0, at, per_sample.sum(1).double())
                correct.index_add_(0, at, (logits.argmax(2) == y).sum(1))
    finally:
        module.train(was_training)
    return [EvalResult(task.client, *scores(c, l, index.numel()))
            for task, c, l, index in zip(tasks, correct.tolist(), loss.tolist(), indices)]
