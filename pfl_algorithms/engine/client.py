"""Client tasks: what runs for one client, on whichever worker an executor picks.

A training task is a function of (download, client state, client data, plan, generator)
that returns (upload, new state, metrics): it loads the client's bank rows into the worker's
working model, applies the download, runs the plan's phases, asks the algorithm what to
upload, and writes the new state back to the rows only if it stayed finite (its parameters,
its loss and every floating value of its upload; else the client is skipped).  An evaluation
task applies the algorithm's evaluation download to a scratch copy of the client's state,
fine-tunes it if the evaluation has a plan, and evaluates; it never writes state.

A :class:`ClientView` is how the algorithm's client-side hooks (its upload, loss terms,
gradient terms and custom gradients) see the client: its parameters and gradients by group,
its state, what it received, and forward/backward helpers.  A client's state has two lifetimes,
and no hook reads what another hook left anywhere else:

* across rounds: the ``client_state`` an algorithm declares, ``view.state(name)`` (bank rows,
  checkpointed with the run, kept only when the task stays finite);
* within a round's task: ``view.cached(name, compute)``, computed once by whichever hook asks
  first (Fed-CMA's fixed batch), and ``view.report(name, value)``, a value a hook sends with the
  task's upload (FedDAF's α and θ, found when its phase begins).  Every view of one task (the
  batched executor makes several) shares them.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .groups import BUFFERS
from .captured_steps import run_sequential_phase
from .local import LocalResult, LocalSchedule, client_batches, conv_layout, evaluate, gather_rows
from .messages import Message, Sparse
from .model_call import autocast, forward
from .plan import Batch, Phase, check_lr_scales, run_grad_terms, state_names
from .step_graphs import capturable
from .working import store_into


@dataclass(frozen=True)
class Evaluation:
    """Which model a client is evaluated with (an algorithm's ``evaluation`` hook returns it).

    Attributes:
        download: applied to a scratch copy of the client's state first (e.g. the global
            model), None for none.
        plan: fine-tuning phases run on that copy before evaluation (fresh optimizer state;
            the result is never stored or sent): FedAvg-FT, Per-FedAvg's one-step adaptation.
        params: 'params' (the client's parameters), or the name of an extra state holding a
            whole parameter row to evaluate instead (pFedMe's personal model).
        final: phases run last, after the run's fine-tuning (``finetune_epochs``) if any, on
            the model about to be scored (Factorized-FL zeroes the μ entries below its
            threshold); ``rounds.evaluation_task`` moves them to the end of ``plan``.
    """

    download: Optional[Message] = None
    plan: tuple[Phase, ...] = ()
    params: str = "params"
    final: tuple[Phase, ...] = ()


@dataclass
class TaskValues:
    """What the hooks of one client task share (module docstring): values computed once
    (``ClientView.cached``) and values reported with its upload (``ClientView.report``)."""

    cached: dict = field(default_factory=dict)
    reported: dict = field(default_factory=dict)


@dataclass
class TrainTask:
    """One client's training in a round."""

    client: int
    round: int
    download: Optional[Message]
    plan: tuple[Phase, ...]


@dataclass
class EvalTask:
    """One client's evaluation on a split."""

    client: int
    round: int
    split: str
    evaluation: Evaluation


@dataclass
class TrainResult:
    """What a training task returns: its upload (None when it sent nothing or diverged)."""

    client: int
    local: LocalResult
    upload: Optional[Message] = None

    @property
    def finite(self) -> bool:
        return self.local.finite


@dataclass
class EvalResult:
    client: int
    accuracy: float
    loss: float
    samples: int


class ClientView:
    """One client during a task, as the algorithm's client-side hooks see it.

    Attributes:
        client, round: who and when.  download: the message it received (None: nothing).
        module: the working model holding the client's state.
        params / grads / buffers: its flat vectors (views, updated in place by training).
        step: optimizer steps taken so far in the current phase.
    """

    def __init__(self, fed, cohort, client: int, round_: int, download: Optional[Message], extra: dict,
                 values: Optional[TaskValues] = None):
        work = cohort.work
        self.client, self.round, self.download = client, round_, download
        self.module, self.params, self.grads, self.buffers = work.module, work.params, work.grads, work.buffers
        self.step = 0
        self._fed, self._cohort, self._work, self._extra = fed, cohort, work, extra
        self._values = TaskValues() if values is None else values
        data = fed.clients[client]
        self._inputs, self._labels, self._label_map = fed.inputs, fed.labels, data.label_map
        self.num_examples = int(data.train.numel())

    def generator(self, round_: Optional[int] = None) -> torch.Generator:
        """The algorithm's own random stream on this client, seeded by (run seed, round, client)
        (``engine.seeds``): ``round_`` None for this round's, -1 for one stream for the whole run
        (Fed-CMA's per-class batch, chosen once); a resumed run draws the same values."""
        return self._fed.generator("client", self.round if round_ is None else round_, self.client)

    def indices(self, split: str = "train") -> Tensor:
        """The client's samples of ``split`` ('train', 'val', 'test'): [n] int64 indices to give
        :meth:`examples`."""
        return self._fed.clients[self.client].part(split)

    def labels_of(self, indices: Tensor) -> Tensor:
        """The labels of samples ``indices`` as the client's classifier sees them (its label map
        applied)."""
        labels = self._labels[indices]
        return labels if self._label_map is None else self._label_map[labels]

    def examples(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, labels) of samples ``indices`` as training batches have them (labels mapped,
        images in the convolutions' fast layout; no augmentation)."""
        return training_batch(self._fed, self._fed.clients[self.client], indices, None, None)

    @property
    def groups(self) -> tuple[str, ...]:
        """The client's parameter groups, in layout order."""
        return self._cohort.groups.order

    @property
    def shared_groups(self) -> tuple[str, ...]:
        """The groups that may leave the client (not among the algorithm's ``local_groups``), in
        layout order."""
        return self._cohort.groups.shared

    def group(self, name: str) -> Tensor:
        """The client's parameters of group ``name`` (a flat view)."""
        return self.params[self._cohort.span(name)]

    def grad(self, name: str) -> Tensor:
        """The gradient of group ``name`` (a flat view; terms add to it in place)."""
        return self.grads[self._cohort.span(name)]

    def segments(self, name: str) -> tuple:
        """The parameter tensors of group ``name`` in its flat view, in order: each an ``Entry``
        (``name``, ``shape``, ``offset``, ``stop``) whose offsets count from the group's start,
        so ``view.group(name)[e.offset:e.stop].view(e.shape)`` is parameter ``e.name``.  The
        names are what a phase's ``lr_scales`` accepts."""
        return self._cohort.segments(name)

    def parameter(self, name: str) -> Tensor:
        """The client's parameter ``name`` (as in ``module.named_parameters()``), a view of its
        flat parameters in the tensor's shape: hooks that work on named tensors read it here,
        not from ``module``, so that they also run on the batched executor's stacked rows."""
        entry = self._cohort.layout.by_name[name]
        return self.params[entry.offset:entry.stop].view(entry.shape)

    def parameter_grad(self, name: str) -> Tensor:
        """The gradient of parameter ``name``, a view of the flat gradient (terms add to it)."""
        entry = self._cohort.layout.by_name[name]
        return self.grads[entry.offset:entry.stop].view(entry.shape)

    def received(self) -> list[str]:
        """The parameter groups the download carried."""
        return [] if self.download is None else [n for n in self.download.tensors if n != BUFFERS]

    def state(self, name: str) -> Tensor:
        """The client's state ``name`` kept across rounds, as the algorithm's ``client_state``
        declares it: a working copy, stored (and checkpointed) if the task stays finite."""
        return self._extra[name]

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, computed once in this task by whichever hook asks for ``name`` first,
        then the same value for every hook of the task; never stored or sent.  For a value of
        the client that does not depend on its model as training moves it (Fed-CMA's fixed
        per-class batch), so that no hook depends on another having run first."""
        if name not in self._values.cached:
            self._values.cached[name] = compute()
        return self._values.cached[name]

    def report(self, name: str, value: Any) -> None:
        """Send ``value`` (what a message's extras carry) with this task's upload, as its extra
        ``name`` and counted with it: a value a hook finds that the server needs (FedDAF's α and
        θ, found when the target's phase begins), which the upload hook then need not read back.
        A task whose upload is None sends a message of its reports alone."""
        self._values.reported[name] = value

    def message(self, groups: Sequence[str], *, extras: Optional[dict] = None,
                sparse: Optional[Mapping[str, float]] = None) -> Message:
        """A message with copies of ``groups`` and, if any, the floating buffers of the shared
        groups (BatchNorm statistics), plus ``extras`` and the client's training-set size.
        ``sparse``: group -> threshold, the groups among ``groups`` that travel as
        ``Sparse(t, threshold)`` (only |t| >= threshold is sent and counted: the factorized
        methods' μ)."""
        sparse = sparse or {}
        tensors = {g: Sparse(self.group(g).clone(), sparse[g]) if g in sparse else self.group(g).clone()
                   for g in groups if g != BUFFERS}
        shared_buffers = self.shared_buffers()
        if shared_buffers.numel():
            tensors[BUFFERS] = shared_buffers.clone()
        return Message(tensors, extras or {}, self.num_examples)

    @torch.no_grad()
    def evaluate(self, split: str = "val", *, received: bool = False) -> tuple[float, float, int]:
        """(accuracy, mean loss, samples) of the client's model on its split ``split`` ('train',
        'val' or 'test'), in eval mode without gradients (NaNs for an empty split); nothing
        changes.  ``received=True``: of the model it started the round with (its stored state
        with the download applied), e.g. the loss F_k(w_t) of the global model that Agnostic-FL
        and q-FFL ascend on; else of its current model (FedFomo scores downloaded models so)."""
        work, cohort = self._work, self._cohort
        saved = (work.params.clone(), work.buffers.clone(), work.int_buffers.clone()) if received else None
        if received:
            row = cohort.row(self.client)
            work.load(cohort.params.row(row), cohort.buffers.row(row), cohort.int_buffers.row(row))
            apply_download(cohort, work, self.download, self.client)
        try:
            return evaluate(self.module, self._inputs, self._labels, self._fed.clients[self.client].part(split),
                            label_map=self._label_map)
        finally:
            if received:
                work.load(*saved)

    def mean_gradient(self, split: str = "train", batch_size: int = 32, *,
                      at: Optional[Mapping[str, Tensor]] = None) -> Tensor:
        """The mean over ``split``'s mini-batches (in order, ``batch_size`` each) of the loss
        gradient at the current parameters, [P] (FedDAF's mean gradient field), or with groups
        ``at`` (name -> flat values) in place of the client's own; in train mode, with the
        model's parameters, buffers (BatchNorm statistics) and ``grads`` left as they were.
        NaNs for an empty split."""
        work = self._work
        indices = self._fed.clients[self.client].part(split)
        saved = (work.buffers.clone(), work.int_buffers.clone(), work.grads.clone())
        own = {g: self.group(g).clone() for g in at or {}}
        total = torch.zeros_like(work.params)
        count = 0
        try:
            with torch.no_grad():
                for g, values in (at or {}).items():
                    self.group(g).copy_(values)
            for start in range(0, indices.numel(), batch_size):
                batch = indices[start:start + batch_size]
                self.forward_backward(*self.examples(batch))
                total += work.grads
                count += 1
        finally:
            with torch.no_grad():
                for g, values in own.items():
                    self.group(g).copy_(values)
            work.buffers.copy_(saved[0])
            work.int_buffers.copy_(saved[1])
            work.grads.copy_(saved[2])
        return total / count if count else torch.full_like(total, float("nan"))

    def embed(self, inputs: Tensor) -> Tensor:
        """The model's embeddings of ``inputs`` (``module.embed``, else its ``body``: the
        encoder without the head), in eval mode and without gradient; the client's state
        (BatchNorm statistics, train mode) is left as it was.  SimFed's criteria embedding."""
        module = self.module
        encoder = getattr(module, "embed", None)
        if encoder is None:
            encoder = getattr(module, "body", None)
            if not isinstance(encoder, nn.Module):
                raise TypeError(f"{type(module).__name__} has neither an 'embed' method nor a 'body' module: "
                                "no embedding to compute")
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                return encoder(inputs)
        finally:
            module.train(training)

    def shared_buffers(self) -> Tensor:
        """The floating buffers of the shared groups (BatchNorm statistics; a flat view, in the
        order of a message's ``buffers``)."""
        return self.buffers[self._cohort.shared_buffer_span()]

    def loss(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """Cross-entropy of the model on a batch (with graph)."""
        return F.cross_entropy(forward(self.module, inputs)[0], labels)

    def forward_backward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        """Zero ``grads``, then leave the batch loss's gradient in them; returns the loss (detached)."""
        self._work.zero_grad()
        loss = self.loss(inputs, labels)
        loss.backward()
        return loss.detach()

    def hvp(self, inputs: Tensor, labels: Tensor, vector: Tensor) -> Tensor:
        """H·vector, H the Hessian of the batch loss at the current parameters: [P] (by double
        backward through the model; the trainable parameters only, others 0)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(self.loss(inputs, labels), params, create_graph=True)
        views = self._cohort.layout.views(vector)
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        dot = sum((g * views[n]).sum() for g, n in zip(grads, names))
        out = torch.zeros_like(self.params)
        out_views = self._cohort.layout.views(out)
        for name, h in zip(names, torch.autograd.grad(dot, params)):
            out_views[name].copy_(h)
        return out


def apply_download(cohort, work, message: Optional[Message], client: int) -> None:
    """Write a download's tensors into the working model: groups into their parameter ranges,
    ``buffers`` into the shared groups' buffers (nothing for a download with ``apply=False``,
    which the plan reads instead).  ``work``'s vectors may also be rows [C, P] of several
    clients that receive the same message (``client`` the first of them): each row gets it."""
    if message is None or not message.apply:
        return
    for name in message.tensors:
        if name == BUFFERS:
            target = work.buffers[..., cohort.shared_buffer_span()]
        elif name in cohort.groups.members:
            target = work.params[..., cohort.span(name)]
        else:
            raise ValueError(f"the download to client {client} carries {name!r}, which is no parameter group of "
                             f"its architecture {cohort.name!r} (groups: {', '.join(cohort.groups.order)})")
        value = message.dense(name)
        if value.shape != target.shape[-1:]:
            raise ValueError(f"the download's {name!r} has shape {list(value.shape)} but client {client}'s "
                             f"{name!r} has {list(target.shape[-1:])}")
        target.copy_(value)


def apply_downloads(cohort, params: Tensor, buffers: Tensor, downloads: Sequence[Optional[Message]],
                    clients: Sequence[int]) -> None:
    """``apply_download`` of each client's download into its row of ``params`` / ``buffers``
    ([C, P] and [C, B], in the order of ``downloads`` and ``clients``), one copy per tensor for
    each run of clients that share one message (FedAvg sends every client the same), instead of
    one per client (each a launch on a GPU)."""
    start = 0
    while start < len(downloads):
        end = start + 1
        while end < len(downloads) and downloads[end] is downloads[start]:
            end += 1
        apply_download(cohort, SimpleNamespace(params=params[start:end], buffers=buffers[start:end]),
                       downloads[start], clients[start])
        start = end


def phase_optimizer(phase: Phase, settings):
    """The phase's optimizer: the run's (``settings``: EngineSettings), with the phase's
    overrides merged by ``Phase.settings_for``."""
    return phase.settings_for(settings.optimizer).build()


def phase_lr_scale(cohort, phase: Phase, view: "ClientView") -> Optional[Tensor]:
    """The phase's ``lr_scales`` for ``view``'s client as one multiplier per parameter value
    ([P], ones where none is given; a parameter's own entry over its group's), None when the
    phase gives none; ValueError for a name that is neither a group nor a parameter."""
    scales = phase.lr_scales
    if scales is None:
        return None
    if callable(scales):
        scales = dict(scales(view))
        check_lr_scales(scales)
    out = torch.ones_like(view.params)
    groups = [name for name in scales if name in cohort.groups.members]
    unknown = [name for name in scales if name not in cohort.groups.members and name not in cohort.layout.by_name]
    if unknown:
        raise ValueError(f"a phase's lr_scales names {unknown}, which are neither parameter groups nor parameters "
                         f"of client {view.client}'s architecture {cohort.name!r}")
    for name in groups:
        out[cohort.span(name)] = scales[name]
    for name, scale in scales.items():
        if name not in cohort.groups.members:
            entry = cohort.layout.by_name[name]
            out[entry.offset:entry.stop] = scale
    return out


def phase_schedule(phase: Phase, schedule: LocalSchedule) -> LocalSchedule:
    """The run's schedule with the phase's length and batch size where it gives them; with a
    custom gradient, ``steps`` counts its steps of ``batches_per_step`` batches."""
    if phase.epochs is not None or phase.steps is not None:
        schedule = replace(schedule, epochs=phase.epochs if phase.epochs is not None else 0, steps=phase.steps)
    if phase.batch_size is not None:
        schedule = replace(schedule, batch_size=phase.batch_size)
    if schedule.steps is not None and phase.batches_per_step > 1:
        schedule = replace(schedule, steps=schedule.steps * phase.batches_per_step)
    return schedule


@dataclass
class _Totals:
    loss: Tensor
    samples: int = 0
    steps: int = 0


def training_batch(fed, data, index: Tensor, generator, augment) -> tuple[Tensor, Tensor]:
    """(inputs, labels) of the training samples ``index`` of a client's split ``data``: labels
    through its label map, inputs augmented (drawing from ``generator``) and in the layout
    convolutions run fastest on."""
    x, y = gather_rows(fed.inputs, index), fed.labels[index]
    if data.label_map is not None:
        y = data.label_map[y]
    if augment is not None:
        x = augment(x, generator)
    return conv_layout(x), y


def phase_parameters(cohort, phase: Phase, client: int) -> tuple[list[str], Optional[list]]:
    """(names, ranges) of the parameters ``phase`` trains in ``cohort``'s layout (ranges None:
    every parameter); ValueError naming ``client`` for a group its architecture lacks."""
    trained = cohort.groups.order if phase.groups is None else phase.groups
    unknown = [g for g in trained if g not in cohort.groups.members]
    if unknown:
        raise ValueError(f"a phase trains {unknown}, which are no parameter groups of client {client}'s "
                         f"architecture {cohort.name!r} (groups: {', '.join(cohort.groups.order)})")
    names = [n for g in trained for n in cohort.groups.members[g]]
    return names, None if phase.groups is None else cohort.layout.ranges(names)


@contextmanager
def trains_only(module: nn.Module, names) -> Iterator[None]:
    """Within the block, only ``module``'s parameters ``names`` require grad: no gradient is
    computed for what a phase does not train (its ``begin`` hook included)."""
    keep = set(names)
    frozen = [p for n, p in module.named_parameters() if n not in keep and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def begin_on_rows(view: ClientView, phases: Sequence[Phase], params: Tensor, buffers: Tensor,
                  int_buffers: Tensor) -> None:
    """The ``begin`` hooks of ``phases`` on ``view`` (a ClientView of its cohort's working
    model), the working model loaded with the client's rows ``params``, ``buffers`` and
    ``int_buffers`` first and written back to them after: the batched executor's training and
    evaluation, whose clients' rows are stacked elsewhere.  Each hook runs with only its
    phase's parameters requiring grad, as in ``_run_phase``."""
    cohort, work = view._cohort, view._work
    work.load(params, buffers, int_buffers)
    for phase in phases:
        with trains_only(work.module, phase_parameters(cohort, phase, view.client)[0]):
            phase.begin(view)
    work.store(params, buffers, int_buffers)


def _run_phase(fed, view: ClientView, phase: Phase, state: dict, generator, augment, totals: _Totals) -> None:
    cohort, work, module = view._cohort, view._work, view.module
    optimizer = phase_optimizer(phase, fed.settings)
    names, ranges = phase_parameters(cohort, phase, view.client)
    data = fed.clients[view.client]
    batches = []
    view.step = 0
    with trains_only(module, names):
        if phase.begin is not None:
            phase.begin(view)
        lr_scale = phase_lr_scale(cohort, phase, view)
        indices = client_batches(data.train, phase_schedule(phase, fed.settings.schedule), generator)
        if fed.step_graphs.static and capturable(phase):  # captured on CUDA (captured_steps)
            run_sequential_phase(fed, view, phase, state, optimizer=optimizer, ranges=ranges, names=names,
                                 lr_scale=lr_scale, totals=totals,
                                 batches=(training_batch(fed, data, index, generator, augment) for index in indices))
            return
        for index in indices:
            x, y = training_batch(fed, data, index, generator, augment)
            batches.append((x, y))
            if len(batches) < phase.batches_per_step:
                continue
            if phase.gradient is None:
                work.zero_grad()
                with autocast(fed.settings.autocast, x.device):
                    logits, embeddings = forward(module, x)
                loss = F.cross_entropy(logits.float() if fed.settings.autocast else logits, y)
                if phase.loss_terms:
                    batch = Batch(x, y, logits, embeddings, module, view)
                    for term in phase.loss_terms:
                        loss = loss + term(batch)
                loss.backward()
            else:
                loss = phase.gradient(view, batches)
            extra = run_grad_terms(phase.grad_terms, view)
            optimizer.step(work.params, work.grads, state, ranges=ranges, lr_scale=lr_scale)
            if phase.after_step is not None:
                phase.after_step(view)
            n = sum(int(b[1].numel()) for b in batches)
            totals.loss += (loss.detach() + extra) * n
            totals.samples += n
            totals.steps += 1
            view.step += 1
            batches = []


def initial_optimizer_state(fed, cohort, phase: Phase, name: str, rows, *, keep: bool) -> dict:
    """The optimizer state phase ``phase`` (state ``name``) starts from, for bank rows ``rows``
    (an int: one client, vectors [P] and a step count []; a list: stacked, [C, P] and [C]): the
    kept state's rows when ``keep``, else zeros and step count 0."""
    if keep:
        state = {v: bank.data[rows].clone() for v, bank in cohort.optimizer_state[name].items()}
        state["steps"] = cohort.optimizer_steps[name][rows].clone()
        return state
    template = cohort.params.data[rows]
    state = {v: torch.zeros_like(template) for v in phase_optimizer(phase, fed.settings).state_names()}
    state["steps"] = torch.zeros(template.shape[:-1], dtype=torch.int64)
    return state


def local_result(loss_total: Tensor, samples: int, steps: int, params: Tensor) -> LocalResult:
    """A task's :class:`LocalResult` from its summed loss (loss × samples per step), samples,
    steps and final parameters: finite when the parameters and the loss are."""
    return local_results(loss_total[None], [samples], [steps], params[None])[0]


def local_results(loss_totals: Tensor, samples: Sequence[int], steps: Sequence[int],
                  params: Tensor) -> list[LocalResult]:
    """``local_result`` of each of C tasks, from their summed losses [C] (float64), samples,
    steps and final parameters [C, P], with one device sync for all of them (three per task,
    read one by one, were a host round trip each on a GPU).  The mean loss is divided on the
    host, in float64 as on the device."""
    finite_rows = finite_sums(params, 1).mul(0) == 0  # x·0: 0 for a finite sum, else NaN
    totals, finite = torch.stack([loss_totals, finite_rows.to(loss_totals.dtype)]).tolist()
    return [LocalResult(loss=total / n if n else float("nan"), samples=n, steps=k,
                        finite=ok == 1 and (n == 0 or math.isfinite(total)))
            for total, ok, n, k in zip(totals, finite, samples, steps)]


def finite_sums(t: Tensor, dim: Optional[int] = None) -> Tensor:
    """Float64 sums of floating ``t`` (over ``dim``; all of it when None) that are finite
    exactly where every summed element is: a float32 (or narrower) value is below 2^128, so
    no float64 sum of them can overflow, and one pass reads ``t`` with no temporary (x·0 and
    its sum read it twice and wrote a copy); a float64 sum can overflow, so float64 elements
    are summed as x·0 (±0 for a finite x, NaN otherwise)."""
    x = t.mul(0) if t.dtype == torch.float64 else t
    return x.sum(dtype=torch.float64) if dim is None else x.sum(dim, dtype=torch.float64)


def message_finite(message: Message) -> bool:
    """Whether every floating value ``message`` carries is finite: its tensors, and the tensors
    and float numbers among its extras (nested in dicts, lists and tuples); one device sync."""
    return bool(message_finite_flag(message))


def message_finite_flag(message: Message) -> bool | Tensor:
    """``message_finite`` without reading the device: False when a float number among the
    extras is not finite, True when no floating tensor is left to check, else a 0-dim bool
    tensor (on the tensors' device) that holds exactly when all of them are finite."""
    floats, numbers = [], []

    def walk(value) -> None:
        if isinstance(value, Tensor):
            if value.is_floating_point():
                floats.append(value)
        elif isinstance(value, float):
            numbers.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk([message.dense(name) for name in message.tensors])
    walk(message.extras)
    if not all(math.isfinite(number) for number in numbers):
        return False
    if not floats:
        return True
    # One finite_sums per tensor, added up (from the first: sum()'s 0 + tensor is one more
    # launch); finite sums add to a finite total (each below 2^128 times its size), and x·0 of
    # the total is 0 exactly when it is finite.
    total, *rest = (finite_sums(t.detach()) for t in floats)
    for term in rest:
        total = total + term
    return total.mul(0) == 0


def run_plan(fed, view: ClientView, plan: Sequence[Phase], generator, *, keep_state: bool,
             augment=None) -> tuple[LocalResult, dict]:
    """Run ``plan``'s phases on the loaded client; returns its result and the optimizer states
    used (by state name), to be stored when ``keep_state`` and the result is finite."""
    cohort = view._cohort
    row = cohort.row(view.client)
    states: dict[str, dict] = {}
    totals = _Totals(torch.zeros((), dtype=torch.float64, device=view.params.device))
    for phase, name in zip(plan, state_names(plan)):
        if name not in states:
            states[name] = initial_optimizer_state(fed, cohort, phase, name, row, keep=keep_state)
        _run_phase(fed, view, phase, states[name], generator, augment, totals)
    return local_result(totals.loss, totals.samples, totals.steps, view.params), states


def run_train_task(fed, algorithm, task: TrainTask) -> TrainResult:
    """Train one client (module docstring); its rows change only if it stays finite."""
    cohort = fed.cohort_of(task.client)
    row = cohort.row(task.client)
    work = cohort.work
    work.load(cohort.params.row(row), cohort.buffers.row(row), cohort.int_buffers.row(row))
    apply_download(cohort, work, task.download, task.client)
    extra = {name: bank.row(row).clone() for name, bank in cohort.extra.items()}
    view = ClientView(fed, cohort, task.client, task.round, task.download, extra)
    keep = fed.settings.optimizer_state == "keep"
    result, states = run_plan(fed, view, task.plan, fed.generator("train", task.round, task.client),
                              keep_state=keep, augment=fed.augment)
    return finish_train_task(fed, algorithm, view, result, states)


def finish_train_task(fed, algorithm, view: ClientView, result: LocalResult, states: dict) -> TrainResult:
    """The end of a training task whose working model holds the client's new state (``view``):
    nothing when it is not finite, or when that upload holds a non-finite value (``message_finite``);
    else the algorithm's upload with the task's reported values,
    then the rows stored (parameters, buffers, extra state and, when kept, the optimizer
    ``states``: name -> vectors and steps)."""
    if not result.finite:
        return TrainResult(view.client, result)
    upload = task_upload(algorithm, view)
    if upload is not None and not message_finite(upload):
        # Finite parameters can still give a non-finite upload (an overflowing delta, an infinite
        # loss in the extras): the client is skipped, as Flower's server refuses such a reply.
        return TrainResult(view.client, replace(result, finite=False))
    store_client_rows(fed, view, states)
    return TrainResult(view.client, result, upload)


@dataclass
class PendingTrainResult:
    """A finished training task whose upload's check may still be on the device: ``finite`` is
    a bool, or a 0-dim bool tensor that ``resolve_train_results`` reads, then makes the stores
    ``later`` (rows on another device than the check: (row, value) pairs) if it holds."""

    result: TrainResult
    finite: bool | Tensor
    later: list = field(default_factory=list)


def finish_train_task_later(fed, algorithm, view: ClientView, result: LocalResult, states: dict
                            ) -> PendingTrainResult:
    """``finish_train_task`` without its device sync, for an executor that finishes many tasks
    in turn (a GPU waited on each check, once per client): the rows are stored only where the
    upload's check holds, selected on the device, and ``resolve_train_results`` then reads
    every task's check at once.  The same rows and results as ``finish_train_task``."""
    if not result.finite:
        return PendingTrainResult(TrainResult(view.client, result), False)
    upload = task_upload(algorithm, view)
    finite = True if upload is None else message_finite_flag(upload)
    later = []
    if finite is not False:
        later = store_client_rows(fed, view, states, where=None if finite is True else finite)
    return PendingTrainResult(TrainResult(view.client, result, upload), finite, later)


def resolve_train_results(pending: Sequence[PendingTrainResult]) -> list[TrainResult]:
    """The results of ``finish_train_task_later``'s tasks, their checks read in one device sync
    (per device): a task whose upload is not finite sent nothing and is marked not finite; the
    others' stores left for the host are made."""
    checks = [p.finite for p in pending if isinstance(p.finite, Tensor)]
    read: dict[int, bool] = {}
    for device in {c.device for c in checks}:
        on_device = [c for c in checks if c.device == device]
        read.update(zip(map(id, on_device), torch.stack(on_device).tolist()))
    results = []
    for p in pending:
        finite = read[id(p.finite)] if isinstance(p.finite, Tensor) else p.finite
        if not finite:
            results.append(TrainResult(p.result.client, replace(p.result.local, finite=False)))
            continue
        for row, value in p.later:
            store_into(row, value)
        results.append(p.result)
    return results


def task_upload(algorithm, view: ClientView) -> Optional[Message]:
    """The algorithm's upload for the loaded client, with the task's reported values in its extras."""
    upload = algorithm.upload(view)
    reported = view._values.reported
    if reported:
        upload = (Message(extras=dict(reported), num_examples=view.num_examples) if upload is None
                  else replace(upload, extras={**upload.extras, **reported}))
    return upload


def store_client_rows(fed, view: ClientView, states: dict, where: Optional[Tensor] = None) -> list:
    """Store the loaded client's new state in its rows: parameters, buffers, extra state and, when
    kept, the optimizer ``states`` (name -> vectors and steps); with ``where`` (a 0-dim bool
    tensor) only if it holds, selected on the device (``working.store_into``).  Returns the
    stores whose row or value is on another device than ``where`` (the host's step counts), as
    (row, value) pairs for the caller to make once it has read ``where``."""
    cohort, row, work = view._cohort, view._cohort.row(view.client), view._work
    stores = [(cohort.params.row(row), work.params), (cohort.buffers.row(row), work.buffers),
              (cohort.int_buffers.row(row), work.int_buffers)]
    stores += [(cohort.extra[name].row(row), value) for name, value in view._extra.items()]
    if fed.settings.optimizer_state == "keep":
        for name, state in states.items():
            stores += [(bank.row(row), state[vector]) for vector, bank in cohort.optimizer_state[name].items()]
            stores.append((cohort.optimizer_steps[name][row], state["steps"]))
    later = []
    for destination, value in stores:
        if where is not None and (destination.device != where.device or value.device != where.device):
            later.append((destination, value))
        else:
            store_into(destination, value, where)
    return later


def run_eval_task(fed, task: EvalTask) -> EvalResult:
    """Evaluate one client with the algorithm's :class:`Evaluation` (nothing is stored)."""
    cohort = fed.cohort_of(task.client)
    row = cohort.row(task.client)
    work = cohort.work
    evaluation = task.evaluation
    params = cohort.params if evaluation.params == "params" else cohort.extra[evaluation.params]
    work.load(params.row(row), cohort.buffers.row(row), cohort.int_buffers.row(row))
    apply_download(cohort, work, evaluation.download, task.client)
    if evaluation.plan:
        extra = {name: bank.row(row).clone() for name, bank in cohort.extra.items()}
        view = ClientView(fed, cohort, task.client, task.round, evaluation.download, extra)
        run_plan(fed, view, evaluation.plan, fed.generator("finetune", task.round, task.client),
                 keep_state=False, augment=fed.augment)
    data = fed.clients[task.client]
    accuracy, loss, samples = evaluate(work.module, fed.inputs, fed.labels, data.part(task.split),
                                       label_map=data.label_map)
    return EvalResult(task.client, accuracy, loss, samples)
