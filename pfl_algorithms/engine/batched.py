"""The batched executor: a chunk of clients of one cohort trains in one vmapped
forward/backward.

For each step, the chunk's parameter rows are stacked into one [C, P] tensor; the cohort's
template module runs on them through ``torch.func.functional_call`` under ``vmap`` (its
convolutions become grouped convolutions, its linears batched matmuls, the factorized and
multi-branch layers one op launch over the client dimension), with every client's BatchNorm
statistics its own.  Ordinary autograd on the stacked rows then gives each client's gradient
(``torch.func.grad`` cannot differentiate ops whose autograd comes from ``register_autograd``,
pytorch/pytorch#168393; a vmapped forward followed by ``backward`` can).  The optimizer steps
the whole [C, P] slice in one call when the clients share their step count, row by row
otherwise; clients whose phases differ only in their learning rate share a chunk, each row
stepped with its own rate, and so do the per-parameter rates of a phase's ``lr_scales`` (one
[C, P] multiplier, each row from its client's view).

Each client sees exactly the batches it would alone, drawn from its own generator in the same
order (augmentation included); at each step the clients whose batches have the same size run
together, so a short last batch or a client with fewer steps is simply not in that step's
group: no padding enters a loss or a BatchNorm statistic.  A client whose state turns
non-finite sends nothing and keeps its previous rows, as on the other executors.

Hooks run per client, each seeing what it would see alone:

* ``begin``: on a normal :class:`ClientView`, with the client's rows loaded into the working
  model (so the hook may evaluate, train or overwrite it: IFCA's cluster choice, FedFomo's and
  FedDAF's model updates), then written back to the stacked rows;
* loss terms: on a :class:`Batch` of the client's rows of the stacked forward's inputs,
  labels, logits and embeddings, whose ``module`` is a :class:`ClientModule` running the
  template on the client's rows, so any forward a term makes (Fed-CMA's fixed batch, FedGen's
  head on generated embeddings) has its gradient reach them, and whose ``view`` is the
  client's (every view of a task shares its ``cached`` and reported values);
* ``grad_terms`` and ``after_step``: on a :class:`ClientView` whose parameters and gradients
  are the client's rows of the stacked tensors.

A task whose algorithm is not ``batchable`` or whose plan has a custom gradient (pFedMe,
Per-FedAvg: steps computed client by client) runs on the threaded executor instead, with a
one-line notice.  On CUDA, evaluations are scored in chunks too (``batched_eval``); those that
fine-tune first, and every evaluation on a CPU, run there too.  With ``threaded_hooks``
(``--executor auto`` on a CPU), so do tasks whose plans have ``begin`` hooks or loss terms:
those run client by client here, and on 2 CPU cores threads ran them faster (Fed-CMA 0.96 s
threaded against 1.32 s batched, FedGen 0.86 against 1.06, IFCA 0.61 against 0.65: the
training time of 5 rounds of 20 digits clients).

A whole chunk's step in a plain phase (no hook inside a step) runs as a static step
(``captured_steps``): replayed as a CUDA graph on CUDA, the same code uncaptured elsewhere.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Optional

import torch
from torch import nn
from torch.func import functional_call

from .batched_eval import batchable_evaluation, evaluate_chunk
from .captured_steps import (batched_step, chunk_rows, chunk_state, copy_gradients, stacked_forward,
                             write_back)
from .client import (ClientView, TaskValues, TrainResult, apply_downloads, begin_on_rows, finish_train_task_later,
                     initial_optimizer_state, local_results, phase_lr_scale, phase_optimizer, phase_parameters,
                     phase_schedule, resolve_train_results, training_batch)
from .cohort_stats import answer_statistics
from .executors import Executor, ThreadedExecutor
from .local import ChunkGather, client_batches
from .plan import Batch, Phase, state_names
from .step_graphs import capturable


def unbatchable_reason(algorithm, plan) -> Optional[str]:
    """Why a task of ``algorithm`` with ``plan`` cannot run batched (None: it can)."""
    if not algorithm.capabilities.batchable:
        return f"{algorithm.name or type(algorithm).__name__} declares itself not batchable"
    if any(phase.gradient is not None for phase in plan):
        return f"{algorithm.name or type(algorithm).__name__}'s local plan has a custom gradient"
    return None


def client_by_client_reason(algorithm, plan) -> Optional[str]:
    """Why a task of ``algorithm`` with ``plan`` would run partly client by client batched: its
    ``begin`` hooks or loss terms (None: neither)."""
    hooks = [what for what, present in (("begin hooks", any(p.begin is not None for p in plan)),
                                        ("loss terms", any(p.loss_terms for p in plan))) if present]
    if not hooks:
        return None
    return (f"{algorithm.name or type(algorithm).__name__}'s local plan has {' and '.join(hooks)}, which run client "
            f"by client (auto on a CPU)")


class ClientModule:
    """One client's model as a loss term sees it on the batched executor: the cohort's template
    module run by ``functional_call`` on the client's rows of the stacked parameters and buffers
    (gradients reach the rows; BatchNorm updates the client's statistics).  Call it (or its
    ``forward``), one of its submodules (``.head``, ``.body``) or one of its methods
    (``.embed``); its other attributes are the template's, except ``nn.Module``'s own methods
    (``parameters()``, ``state_dict()``, ...), which would show the template, not the client."""

    def __init__(self, module: nn.Module, tensors: dict):
        self._module, self._tensors = module, tensors

    def __call__(self, *args, **kwargs):
        return functional_call(self._module, self._tensors, args, kwargs)

    def __getattr__(self, name: str):
        attr = getattr(self._module, name)
        if isinstance(attr, nn.Module):
            prefix = name + "."
            return ClientModule(attr, {k[len(prefix):]: v for k, v in self._tensors.items() if k.startswith(prefix)})
        if name == "forward":
            return self.__call__
        if hasattr(nn.Module, name):  # parameters(), state_dict(), ...: the template's, not the client's
            raise AttributeError(f"{name!r} of a client's model is not available to a loss term on the batched "
                                 f"executor; read parameters with ClientView.parameter in a begin or grad term")
        if inspect.ismethod(attr):
            return functools.partial(_call_method, self._module, name, self._tensors)
        return attr


class _Method(nn.Module):
    """``model.<name>(...)`` as a module's forward, for ``functional_call``."""

    def __init__(self, model: nn.Module, name: str):
        super().__init__()
        self.model, self.name = model, name

    def forward(self, *args, **kwargs):
        return getattr(self.model, self.name)(*args, **kwargs)


def _call_method(module: nn.Module, name: str, tensors: dict, *args, **kwargs):
    return functional_call(_Method(module, name), {"model." + k: v for k, v in tensors.items()}, args, kwargs)


def _signature(phase: Phase) -> tuple:
    """What must agree between the clients of a chunk for one phase (their own hooks and
    learning rates may differ: the optimizer steps rows with their own)."""
    return (phase.groups, phase.epochs, phase.steps, phase.batch_size, phase.optimizer,
            tuple(sorted(phase.optimizer_settings.items())), phase.state, phase.batches_per_step,
            bool(phase.grad_terms), phase.after_step is not None)


def chunk_size(fed, cohort, override: Optional[int]) -> int:
    """Clients per chunk, at most the cohort's size: ``override``, else what the device's free
    memory holds, by a deliberately rough per-client estimate (its rows, gradients, two optimizer
    vectors and a copy each: 8 × P values; activations: 64 values per input value of a batch)."""
    if override is not None:
        # A chunk's buffers are allocated for its capacity: 5000 for 2 clients took 1.1 GB.
        return min(override, len(cohort.clients))
    device = fed.device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 4 << 30
    value_bytes = cohort.layout.dtype.itemsize
    batch = fed.settings.schedule.batch_size * max(1, fed.inputs[0].numel())
    per_client = (8 * cohort.layout.numel + 64 * batch) * value_bytes
    return max(1, min(len(cohort.clients), int(0.5 * free // max(per_client, 1))))


class BatchedExecutor(Executor):
    """Chunks of clients of one cohort in one vmapped forward/backward (module docstring)."""

    name = "batched"

    def __init__(self, workers: Optional[int] = None, chunk: Optional[int] = None, *, threaded_hooks: bool = False):
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be None or an integer >= 1, got {chunk!r}")
        self.chunk = chunk
        self.threaded_hooks = threaded_hooks  # plans with begin hooks or loss terms run threaded
        self.fallback = ThreadedExecutor(workers)
        self._noticed: set[str] = set()
        self._sizes: dict[tuple, int] = {}  # clients per chunk, by (cohort, chunk asked for)
        # Evaluation in chunks too; None: on CUDA only.  On 2 CPU cores, 20 clients of 100 test
        # samples each: the MLP scored in 4.0 ms against 8.5 ms threaded, but the digits CNN in
        # 50.5 against 33.7 ms and LeNet-5 in 140 against 48 ms (grouped convolutions).
        self.batched_eval: Optional[bool] = None

    def run(self, tasks, run_one):
        """Tasks that are not batched (unbatchable plans, evaluations that fine-tune): threaded."""
        return self.fallback.run(tasks, run_one)

    def run_eval(self, fed, tasks, run_one) -> list:
        """The evaluation tasks: on CUDA (or with ``batched_eval``), those that score a model as
        it is in chunks of a cohort's clients (``batched_eval``); the others (fine-tuning first,
        or on a CPU) through ``run_one`` on the threaded executor; results in task order."""
        batched = fed.device.type == "cuda" if self.batched_eval is None else self.batched_eval
        results, others, groups = {}, [], {}
        for position, task in enumerate(tasks):
            if batched and batchable_evaluation(task):
                cohort = fed.cohort_of(task.client)
                groups.setdefault((cohort.name, task.evaluation.params), []).append((position, task))
            else:
                others.append((position, task))
        for members in groups.values():
            cohort = fed.cohort_of(members[0][1].client)
            size = self._chunk_size(fed, cohort)
            for start in range(0, len(members), size):
                part = members[start:start + size]
                for (position, _), result in zip(part, evaluate_chunk(fed, cohort, [t for _, t in part])):
                    results[position] = result
        if others:
            for (position, _), result in zip(others, self.fallback.run([t for _, t in others], run_one)):
                results[position] = result
        return [results[i] for i in range(len(tasks))]

    def _chunk_size(self, fed, cohort) -> int:
        """Clients per chunk of ``cohort``: decided once (per ``chunk`` asked for), before any
        step is captured; the memory captured steps hold would otherwise shrink the next round's
        chunks, and new sizes capture anew."""
        key = (cohort.name, self.chunk)
        if key not in self._sizes:
            self._sizes[key] = chunk_size(fed, cohort, self.chunk)
        return self._sizes[key]

    def close(self) -> None:
        self.fallback.close()

    def run_train(self, fed, algorithm, tasks, run_one) -> list:
        """The round's training tasks: batched where they can be, the others through ``run_one``
        on the threaded executor; results in task order, their statistics answered."""
        results: dict[int, TrainResult] = {}
        others = []
        groups: dict[tuple, list] = {}
        for position, task in enumerate(tasks):
            reason = unbatchable_reason(algorithm, task.plan)
            if reason is None and self.threaded_hooks:
                reason = client_by_client_reason(algorithm, task.plan)
            if reason is not None:
                if reason not in self._noticed:
                    self._noticed.add(reason)
                    print(f"pfl: executor batched: {reason}; its clients run on the threaded executor",
                          file=sys.stderr, flush=True)
                others.append((position, task))
                continue
            cohort = fed.cohort_of(task.client)
            key = (cohort.name, tuple(_signature(p) for p in task.plan))
            groups.setdefault(key, []).append((position, task))
        for members in groups.values():
            cohort = fed.cohort_of(members[0][1].client)
            size = self._chunk_size(fed, cohort)
            for start in range(0, len(members), size):
                part = members[start:start + size]
                for (position, _), result in zip(part, train_chunk(fed, algorithm, cohort, [t for _, t in part],
                                                                   capacity=size)):
                    results[position] = result
        if others:
            for (position, _), result in zip(others, self.fallback.run([t for _, t in others], run_one)):
                results[position] = result
        ordered = [results[i] for i in range(len(tasks))]
        answer_statistics(fed, ordered)
        return ordered


def _row_view(fed, cohort, task, extra, params, grads, buffers) -> ClientView:
    """A ClientView of ``task``'s client whose flat vectors are its rows of the stacked tensors
    (its task's values, which every other view of the task shares)."""
    view = ClientView(fed, cohort, task.client, task.round, task.download, extra, TaskValues())
    view.params, view.grads, view.buffers = params, grads, buffers
    return view


def train_chunk(fed, algorithm, cohort, tasks, capacity: Optional[int] = None) -> list[TrainResult]:
    """Train ``tasks`` (clients of ``cohort`` with plans of the same shape) together, in the
    persistent rows of chunks of up to ``capacity`` clients (None: as many as ``tasks``); their
    rows change only where they stay finite, and each upload is asked of a normal ClientView."""
    rows = [cohort.row(t.client) for t in tasks]
    count = len(tasks)
    # The chunk's rows in persistent tensors (captured steps stay valid on them round after round).
    chunk = chunk_rows(fed.step_graphs, cohort, max(capacity or count, count), count)
    params = chunk.params.copy_(cohort.params.data[rows])
    buffers = chunk.buffers.copy_(cohort.buffers.data[rows])
    int_buffers = chunk.int_buffers.copy_(cohort.int_buffers.data[rows])
    grads = chunk.grads.zero_()
    apply_downloads(cohort, params, buffers, [t.download for t in tasks], [t.client for t in tasks])
    extras = [{name: bank.row(r).clone() for name, bank in cohort.extra.items()} for r in rows]
    views = [_row_view(fed, cohort, t, extras[i], params[i], grads[i], buffers[i]) for i, t in enumerate(tasks)]
    generators = [fed.generator("train", t.round, t.client) for t in tasks]
    keep = fed.settings.optimizer_state == "keep"
    loss_sum = chunk.loss_sum.zero_()
    samples, steps_taken = [0] * count, [0] * count
    states: dict[str, dict] = {}
    plan = tasks[0].plan
    for index, (phase, state_name) in enumerate(zip(plan, state_names(plan))):
        optimizer = phase_optimizer(phase, fed.settings)
        if state_name not in states:
            states[state_name] = chunk_state(chunk, state_name,
                                             initial_optimizer_state(fed, cohort, phase, state_name, rows, keep=keep))
        _run_phase(fed, cohort, tasks, index, optimizer, states[state_name], views, params, grads, buffers,
                   int_buffers, generators, loss_sum, samples, steps_taken, chunk=chunk, state_name=state_name)
    results = []
    locals_ = local_results(loss_sum, samples, steps_taken, params)
    for i, task in enumerate(tasks):
        # Each client ends as on the other executors: its new rows in the working model, the
        # upload asked of a normal ClientView, then stored (``finish_train_task``).
        cohort.work.load(params[i], buffers[i], int_buffers[i])
        view = ClientView(fed, cohort, task.client, task.round, task.download, extras[i], views[i]._values)
        view.step = views[i].step  # the last phase's steps, as the upload sees them alone
        local = locals_[i]
        own_states = {name: {vector: value[i] for vector, value in state.items()} for name, state in states.items()}
        results.append(finish_train_task_later(fed, algorithm, view, local, own_states))
    return resolve_train_results(results)  # every upload's check in one device sync


def _run_phase(fed, cohort, tasks, index, optimizer, state, views, params, grads, buffers, int_buffers, generators,
               loss_sum, samples, steps_taken, *, chunk, state_name) -> None:
    """One phase for the whole chunk: step by step, the clients with a batch of the same size
    together; a step of the whole chunk of a plain phase as a static step (``captured_steps``),
    any other through ``_step``."""
    phase = tasks[0].plan[index]
    names, ranges = phase_parameters(cohort, phase, tasks[0].client)
    trained = None if ranges is None else set(names)
    schedule = phase_schedule(phase, fed.settings.schedule)
    rates = [t.plan[index].settings_for(fed.settings.optimizer).lr for t in tasks]
    lrs = None if len(set(rates)) == 1 else torch.tensor(rates, dtype=params.dtype, device=params.device)
    iterators = [iter(client_batches(fed.clients[t.client].train, schedule, generators[i]))
                 for i, t in enumerate(tasks)]
    for view in views:
        view.step = 0
    active = list(range(len(tasks)))
    module = cohort.work.module
    module.train()
    for i, task in enumerate(tasks):
        if task.plan[index].begin is not None:
            _begin(fed, cohort, task, task.plan[index], views[i], params[i], buffers[i], int_buffers[i])
    scales = [phase_lr_scale(cohort, task.plan[index], views[i]) for i, task in enumerate(tasks)]
    lr_scale = None if all(s is None for s in scales) else torch.stack(
        [torch.ones_like(params[i]) if s is None else s for i, s in enumerate(scales)])
    static = all(capturable(t.plan[index]) for t in tasks)
    if static:
        if lrs is not None:
            chunk.lrs.copy_(lrs[:, None])
        if lr_scale is not None:  # in persistent rows, for the static step to read
            lr_scale = chunk.chunk.rows("lr_scale", lr_scale, chunk.count).copy_(lr_scale)
    steps_on_device = False  # whether chunk.steps holds state["steps"] (a general step moves only the latter)
    everyone = list(range(len(tasks)))
    datas = [fed.clients[t.client] for t in tasks]
    # Without augmentation (which draws from each client's generator in turn) a batch is only its
    # indices until it is trained: a whole chunk's step then gathers every client's batch at once.
    gathered = ChunkGather(fed.inputs, fed.labels, [d.label_map for d in datas]) if fed.augment is None else None
    while active:
        batches, finished = {}, []
        for i in active:
            index_batch = next(iterators[i], None)
            if index_batch is None:
                finished.append(i)
                continue
            batches[i] = index_batch if gathered else training_batch(fed, datas[i], index_batch, generators[i],
                                                                     fed.augment)
        active = [i for i in active if i not in finished]
        by_size: dict[int, list[int]] = {}
        for i in active:
            by_size.setdefault(int((batches[i] if gathered else batches[i][1]).numel()), []).append(i)
        for members in by_size.values():
            if not (static and members == everyone):
                if gathered:
                    for i in members:
                        batches[i] = training_batch(fed, datas[i], batches[i], generators[i], None)
                _step(cohort, module, tasks, index, optimizer, lrs, state, views, params, grads, buffers, int_buffers,
                      members, batches, ranges, trained, loss_sum, samples, steps_taken, fed.settings.autocast,
                      lr_scale=lr_scale, conv=fed.settings.batched_conv)
                steps_on_device = False
                continue
            if not steps_on_device:
                chunk.steps.copy_(state["steps"])
                steps_on_device = True
            if gathered:
                x, y = gathered([batches[i] for i in members])
            else:
                x = torch.stack([batches[i][0] for i in members])
                y = torch.stack([batches[i][1] for i in members])
            _static_step(fed, cohort, chunk, optimizer, ranges, trained, state_name, state, lrs, lr_scale, x, y,
                         [t.plan[index] for t in tasks], views, samples, steps_taken)


def _static_step(fed, cohort, chunk, optimizer, ranges, trained, state_name, state, lrs, lr_scale, x, y, phases,
                 views, samples, steps_taken) -> None:
    """One step of the whole chunk as its static step (``captured_steps.batched_step``) on its
    batches ``x`` [C, B, ...] and ``y`` [C, B], and the host's bookkeeping of it: the step
    counts, samples and steps of every client."""
    step = batched_step(fed.step_graphs, cohort, chunk, x, y, optimizer=optimizer, ranges=ranges, trained=trained,
                        state_name=state_name, state=state, lrs=lrs is not None, lr_scale=lr_scale,
                        autocast_mode=fed.settings.autocast, phases=phases, views=views, conv=fed.settings.batched_conv)
    step.inputs["x"].copy_(x)
    step.inputs["y"].copy_(y)
    fed.step_graphs.run(step)
    state["steps"] += 1
    n = int(y.shape[1])
    for i in range(chunk.count):
        samples[i] += n
        steps_taken[i] += 1
        views[i].step += 1


def _begin(fed, cohort, task, phase: Phase, row_view: ClientView, params, buffers, int_buffers) -> None:
    """``phase``'s begin hook on a normal ClientView of ``task``'s client: its rows loaded into the
    working model (the hook may run or change it, as on the other executors), written back after."""
    begin_on_rows(ClientView(fed, cohort, task.client, task.round, task.download, row_view._extra, row_view._values),
                  (phase,), params, buffers, int_buffers)


def _step(cohort, module, tasks, index, optimizer, lrs, state, views, params, grads, buffers, int_buffers, members,
          batches, ranges, trained, loss_sum, samples, steps_taken, fed_autocast=None, lr_scale=None,
          conv: str = "grouped") -> None:
    """One optimizer step of the clients ``members`` (their batches have one size); ``lrs``:
    [C] each client's learning rate where they differ (None: the optimizer's for all);
    ``lr_scale``: [C, P] each client's per-parameter multipliers of it (None: none); ``conv``:
    how the per-client convolutions run (``stacked_forward``)."""
    idx = torch.tensor(members, device=params.device)
    whole = members == list(range(len(tasks)))
    layout = cohort.layout
    # One leaf per parameter tensor, [G, *shape]: slicing one stacked [G, P] leaf instead would
    # make every slice's backward write a whole [G, P] gradient (quadratic in the tensor count).
    # Only the tensors the phase trains get a gradient, as alone.
    leaves = {name: (view.detach() if whole else view).requires_grad_(trained is None or name in trained)
              for name, view in layout.views(params if whole else params[idx]).items()}
    chunk_buffers = buffers if whole else buffers[idx]
    chunk_int_buffers = int_buffers if whole else int_buffers[idx]
    x = torch.stack([batches[i][0] for i in members])
    y = torch.stack([batches[i][1] for i in members])

    per_client, logits, embeddings, statistics = stacked_forward(module, cohort, leaves, chunk_buffers,
                                                                 chunk_int_buffers, x, y, fed_autocast, conv=conv)
    parts = statistics[1]
    terms = [tasks[i].plan[index].loss_terms for i in members]
    if any(terms):
        per_client = torch.stack([_with_loss_terms(per_client[k], terms[k], module, leaves, parts, k, x, y, logits,
                                                   embeddings, views[i]) for k, i in enumerate(members)])
    write_back(statistics)  # after the loss terms, whose forwards may move BatchNorm statistics too
    per_client.sum().backward()
    with torch.no_grad():
        if not whole:  # BatchNorm statistics moved in the gathered copies
            buffers[idx] = chunk_buffers
            int_buffers[idx] = chunk_int_buffers
        target = grads if whole else torch.zeros((len(members), grads.shape[1]), dtype=grads.dtype,
                                                 device=grads.device)
        copy_gradients(layout, leaves, target)
        if not whole:
            grads[idx] = target
        # The terms' losses stay on the device (a float() each was a sync per client and step).
        extra = torch.zeros(len(members), dtype=torch.float64, device=params.device)
        for k, i in enumerate(members):
            phase = tasks[i].plan[index]
            for term in phase.grad_terms:
                value = term(views[i])
                if value is not None:
                    extra[k] += value.detach().double() if isinstance(value, torch.Tensor) else float(value)
        steps = state["steps"]
        if whole and bool((steps == steps[0]).all()):
            shared = {name: value for name, value in state.items() if name != "steps"}
            shared["steps"] = steps[0].clone()
            optimizer.step(params, grads, shared, ranges=ranges, lr=None if lrs is None else lrs[:, None],
                           lr_scale=lr_scale)
            steps += 1
        else:
            for i in members:
                row_state = {name: value[i] for name, value in state.items()}
                optimizer.step(params[i], grads[i], row_state, ranges=ranges, lr=None if lrs is None else lrs[i:i + 1],
                               lr_scale=None if lr_scale is None else lr_scale[i])
        for k, i in enumerate(members):
            phase = tasks[i].plan[index]
            if phase.after_step is not None:
                phase.after_step(views[i])
            n = int(batches[i][1].numel())
            loss_sum[i] += (per_client[k].detach().double() + extra[k]) * n
            samples[i] += n
            steps_taken[i] += 1
            views[i].step += 1


def _with_loss_terms(loss, terms, module, leaves, parts, k, x, y, logits, embeddings, view):
    """Row ``k``'s loss plus its loss terms, each given the row's :class:`Batch` (its model a
    :class:`ClientModule` on its rows, its client's ``view``), added in order as the other
    executors add them."""
    if not terms:
        return loss
    tensors = {**{name: leaf[k] for name, leaf in leaves.items()}, **{name: part[k] for name, part in parts.items()}}
    batch = Batch(x[k], y[k], logits[k], None if embeddings is None else embeddings[k], ClientModule(module, tensors),
                  view)
    for term in terms:
        loss = loss + term(batch)
    return loss
