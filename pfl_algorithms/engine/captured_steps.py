"""The executors' plain training steps written for capture (``step_graphs``).

A plain step (``step_graphs.capturable``: no hook runs inside it) is a function of tensors
that keep their addresses:

* the batched executor's: a chunk's stacked rows live in persistent tensors
  (``ChunkTensors``, one set per cohort and chunk capacity, reused every round), and its step is
  the vmapped forward, the backward, the gradient copy, the optimizer's step over [C, P] and
  the loss sums, for the whole chunk (a step where only some clients have a batch of that size
  runs the general step instead);
* the sequential executor's: the working model's flat vectors are persistent already; the
  optimizer state of the phase is copied into persistent vectors for the phase and back after.

The same code runs on every device: captured on CUDA, called as it is elsewhere.  The batched
executor uses it on a CPU too, so the CPU tests of the batched executor test it; the sequential
executor uses it where ``StepGraphs.static`` says (capturing, or a test's choice).  Host-side
bookkeeping (samples, step counts) stays outside the step: the optimizer's step count is a
device copy (``steps``) that the step advances, and the host advances its own beside it.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch.func import functional_call, vmap
from torch.nn import functional as F

from .conv_gemm import batched_convolutions
from .model_call import ModelOutputs, autocast, forward, vmapped_autocast
from .plan import run_grad_terms
from .step_graphs import StaticStep, StepGraphs, hook_keys, static_like


class ChunkTensors:
    """Persistent stacked rows for chunks of up to ``capacity`` clients of ``cohort``: a chunk of
    ``count`` clients works in the first ``count`` rows (``first``), so its steps, captured on
    those views, stay valid round after round whatever the chunk sizes a round's sample makes."""

    def __init__(self, cohort, capacity: int):
        params = cohort.params.data
        self.capacity = capacity
        self.params = params.new_empty((capacity, params.shape[1]))
        self.grads = params.new_zeros((capacity, params.shape[1]))
        self.buffers = cohort.buffers.data.new_empty((capacity, cohort.buffers.data.shape[1]))
        self.int_buffers = cohort.int_buffers.data.new_empty((capacity, cohort.int_buffers.data.shape[1]))
        self.loss_sum = torch.zeros(capacity, dtype=torch.float64, device=params.device)
        self.steps = torch.zeros(capacity, dtype=torch.int64, device=params.device)  # the optimizer's, on the device
        self.lrs = params.new_empty((capacity, 1))
        self._more: dict = {}

    def rows(self, name, like: torch.Tensor, count: int) -> torch.Tensor:
        """The first ``count`` rows of the persistent tensor ``name`` shaped [capacity, *like's
        row shape] (made the first time: the phases' optimizer state vectors, lr_scale)."""
        held = self._more.get(name)
        if held is None:
            held = self._more[name] = like.new_empty((self.capacity, *like.shape[1:]))
        return held[:count]

    def first(self, count: int) -> SimpleNamespace:
        """Views of the first ``count`` rows: params, grads, buffers, int_buffers [count, ...],
        loss_sum [count], steps [count], lrs [count, 1]; ``chunk``: these tensors."""
        return SimpleNamespace(chunk=self, count=count, **{
            name: getattr(self, name)[:count]
            for name in ("params", "grads", "buffers", "int_buffers", "loss_sum", "steps", "lrs")})


def chunk_rows(graphs: StepGraphs, cohort, capacity: int, count: int) -> SimpleNamespace:
    """``ChunkTensors.first(count)`` of the persistent tensors of ``cohort``'s chunks of up to
    ``capacity`` clients (made when first asked for)."""
    return graphs.tensors(("chunk", cohort.name, capacity), lambda: ChunkTensors(cohort, capacity)).first(count)


def chunk_state(rows: SimpleNamespace, name: str, state: dict) -> dict:
    """``state`` (vectors [count, P], steps [count] on the host) with its vectors moved into the
    chunk's persistent rows for state ``name``; the host step count stays the caller's."""
    return {vector: value if vector == "steps" else
            rows.chunk.rows(("state", name, vector), value, rows.count).copy_(value)
            for vector, value in state.items()}


def batched_step(graphs: StepGraphs, cohort, chunk: SimpleNamespace, x, y, *, optimizer, ranges, trained,
                 state_name: str, state: dict, lrs: bool, lr_scale: Optional[torch.Tensor], autocast_mode,
                 phases, views, conv: str = "grouped") -> StaticStep:
    """The static step of ``chunk`` (``chunk_rows``) for batches shaped as ``x`` and ``y``
    ([C, B, ...], [C, B]): it trains ``trained`` (None: every parameter) over ``ranges`` with
    ``optimizer``, each row at its ``chunk.lrs`` rate when ``lrs``, scaled by ``lr_scale`` (the
    chunk's persistent rows, or None), each client's ``phases`` gradient terms and after-step
    hook (capturable ones) run on its row view in ``views``, its convolutions run as ``conv``
    says (``stacked_forward``); the caller fills its inputs 'x' and 'y', and ``chunk.steps``."""
    key = ("batched", cohort.name, chunk.chunk.capacity, chunk.count, tuple(x.shape), x.stride(), x.dtype,
           tuple(y.shape), optimizer, None if ranges is None else tuple(ranges),
           None if trained is None else frozenset(trained), lrs, lr_scale is not None, autocast_mode, conv,
           state_name, tuple(sorted(state)), tuple(hook_keys(phase) for phase in phases))

    def build() -> StaticStep:
        inputs = {"x": static_like(x), "y": static_like(y)}
        vectors = {vector: value for vector, value in state.items() if vector != "steps"}
        module = cohort.work.module
        count, samples = chunk.params.shape[0], y.shape[1]
        terms = [phase.grad_terms for phase in phases]
        afters = [phase.after_step for phase in phases]
        rows = list(views)  # the views of the build: their tensors are the persistent rows

        def fn() -> None:
            leaves = {name: view.detach().requires_grad_(trained is None or name in trained)
                      for name, view in cohort.layout.views(chunk.params).items()}
            per_client, _, _, statistics = stacked_forward(module, cohort, leaves, chunk.buffers, chunk.int_buffers,
                                                           inputs["x"], inputs["y"], autocast_mode, cache=False,
                                                           conv=conv)
            write_back(statistics)
            per_client.sum().backward()
            with torch.no_grad():
                copy_gradients(cohort.layout, leaves, chunk.grads)
                # Each client's terms add to its gradient row and report the loss they stand for,
                # summed in float64 as the general step sums them.
                extra = torch.stack([term_total(terms[k], rows[k]) for k in range(count)]) if any(terms) else None
                optimizer.step(chunk.params, chunk.grads, {**vectors, "steps": chunk.steps}, ranges=ranges,
                               lr=chunk.lrs if lrs else None, lr_scale=lr_scale, capturable=True)
                for after, view in zip(afters, rows):
                    if after is not None:
                        after(view)
                reported = per_client.detach().double()
                chunk.loss_sum.add_((reported if extra is None else reported + extra) * samples)

        return StaticStep(fn, inputs)

    return graphs.step(key, build)


def stacked_forward(module, cohort, leaves: dict, buffers, int_buffers, x, y, autocast_mode, *,
                    cache: bool = True, conv: str = "grouped"):
    """The vmapped forward of G clients of ``cohort`` on their batches ``x`` [G, B, ...] and ``y``
    [G, B]: ``module`` run by ``functional_call`` on each client's ``leaves`` (parameter name ->
    [G, *shape]) and buffer rows.  Returns (each client's mean cross-entropy [G], logits,
    embeddings or None, statistics), ``statistics`` holding BatchNorm's buffers as the copies the
    forward updated, for ``write_back`` to copy into the rows; ``conv``: how the per-client
    convolutions run (``conv_gemm.batched_convolutions``).  The batched executor's general step
    and its static step both run it."""
    outputs = ModelOutputs(module)

    def client_outputs(param_parts, buffer_parts, inputs):
        tensors = {"model." + name: t for parts in (param_parts, buffer_parts) for name, t in parts.items()}
        return functional_call(outputs, tensors, (inputs,))

    # The buffers go in as contiguous tensors [G, ...] of their own, copied back after:
    # BatchNorm's in-place updates of its running statistics under vmap reach such a tensor, but
    # not a strided view of the stacked rows (nor a view taken inside the vmapped function).
    views = {**cohort.buffer_layout.views(buffers), **cohort.int_buffer_layout.views(int_buffers)}
    parts = {name: view.clone() for name, view in views.items()}
    with vmapped_autocast(autocast_mode, x.device, cache=cache), batched_convolutions(conv):
        out = vmap(client_outputs)(leaves, parts, x)
    logits, embeddings = (out, None) if isinstance(out, torch.Tensor) else out
    # The loss in float32, as torch.autocast leaves it.
    loss_logits = logits.float() if autocast_mode else logits
    per_client = F.cross_entropy(loss_logits.flatten(0, 1), y.flatten(), reduction="none")
    return per_client.view(x.shape[0], -1).mean(1), logits, embeddings, (views, parts)


@torch.no_grad()
def write_back(statistics) -> None:
    """Copy the BatchNorm statistics a ``stacked_forward`` updated into the clients' buffer rows."""
    views, parts = statistics
    for name, view in views.items():
        view.copy_(parts[name])


@torch.no_grad()
def copy_gradients(layout, leaves: dict, target: torch.Tensor) -> None:
    """Each leaf's gradient into its span of the stacked flat gradient ``target`` [G, P]
    (zeros for a leaf the phase does not train)."""
    for name, view in layout.views(target).items():
        grad = leaves[name].grad
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)


def term_total(terms, view) -> torch.Tensor:
    """The losses ``terms`` (gradient terms) report for ``view``, summed in float64 on the device
    (the general step sums them as host floats: the same values)."""
    total = torch.zeros((), dtype=torch.float64, device=view.params.device)
    for term in terms:
        value = term(view)
        if value is not None:
            total = total + value.double()
    return total


def run_sequential_phase(fed, view, phase, phase_state: dict, *, optimizer, ranges, names, lr_scale, batches,
                         totals) -> None:
    """One phase of the sequential executor's plain steps on ``view``'s working model, as static
    steps (captured where ``fed.step_graphs`` captures): ``batches`` yields (x, y); the phase's
    optimizer state ``phase_state`` (vectors [P], steps []) and ``totals`` are updated as the
    host steps update them."""
    graphs, work = fed.step_graphs, view._work
    # Keyed by the working model itself (by identity), not its id: a key keeps it alive, so a
    # later model can never be taken for it and be handed steps bound to another's tensors.
    vectors = tuple(sorted(v for v in phase_state if v != "steps"))
    held = graphs.tensors(("sequential", work, vectors), lambda: SimpleNamespace(
        vectors={v: torch.empty_like(work.params) for v in vectors},
        steps=torch.zeros((), dtype=torch.int64, device=work.params.device),
        loss=torch.zeros((), dtype=torch.float64, device=work.params.device), lr_scale=None))
    for v in vectors:
        held.vectors[v].copy_(phase_state[v])
    held.steps.copy_(phase_state["steps"])
    held.loss.copy_(totals.loss)
    if lr_scale is not None:
        if held.lr_scale is None:
            held.lr_scale = torch.empty_like(work.params)
        held.lr_scale.copy_(lr_scale)
    mode = fed.settings.autocast
    for x, y in batches:
        key = ("sequential", work, tuple(x.shape), x.stride(), x.dtype, tuple(y.shape), optimizer,
               None if ranges is None else tuple(ranges), tuple(names), lr_scale is not None, mode, vectors,
               hook_keys(phase))
        step = graphs.step(key, lambda: _sequential_step(work, held, x, y, optimizer, ranges, lr_scale is not None,
                                                         mode, phase, view))
        step.inputs["x"].copy_(x)
        step.inputs["y"].copy_(y)
        graphs.run(step)
        n = int(y.numel())
        phase_state["steps"] += 1
        totals.samples += n
        totals.steps += 1
        view.step += 1
    for v in vectors:
        phase_state[v].copy_(held.vectors[v])
    totals.loss.copy_(held.loss)


def _sequential_step(work, held, x, y, optimizer, ranges, scaled: bool, mode: Optional[str], phase,
                     view) -> StaticStep:
    """The working model's static step (``view``: the build's, whose tensors are the working
    model's; ``phase``'s capturable hooks run on it) as ``client._run_phase`` steps on the host."""
    inputs = {"x": static_like(x), "y": static_like(y)}
    samples = y.numel()

    def fn() -> None:
        work.zero_grad()
        with autocast(mode, inputs["x"].device, cache=False):
            logits, _ = forward(work.module, inputs["x"])
        loss = F.cross_entropy(logits.float() if mode else logits, inputs["y"])
        loss.backward()
        extra = run_grad_terms(phase.grad_terms, view)
        optimizer.step(work.params, work.grads, {**held.vectors, "steps": held.steps}, ranges=ranges,
                       lr_scale=held.lr_scale if scaled else None, capturable=True)
        if phase.after_step is not None:
            phase.after_step(view)
        held.loss.add_((loss.detach() + extra) * samples)

    return StaticStep(fn, inputs)
