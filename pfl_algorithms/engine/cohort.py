"""A cohort: the clients of one architecture, with their template model, layouts and banks.

Every client belongs to exactly one cohort; a federation of one architecture has one cohort.
A cohort's banks hold one row per member client: parameters (ordered by group, so each group
is one contiguous range), floating and integer buffers, the optimizer states of the plans'
phases (kept between rounds only with ``optimizer_state='keep'``) and the extra per-client
state the algorithm declares.  Algorithms never see cohorts: they address clients and groups.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from pfl_kernels.nn import fuse_relu_max_pool

from .bank import ClientBank
from .groups import Groups
from .layout import Entry, FlatLayout
from .working import WorkingModel


@dataclass(frozen=True)
class StateSpec:
    """Extra per-client state an algorithm declares (kept in a bank, checkpointed, resumed).

    Attributes:
        shape: None: one value per parameter (a row in the parameter layout, e.g. pFedMe's
            personal model, control variates); else the shape of the client's tensor.
        dtype: None: the parameters' dtype.
        init: 'zeros', or 'params' (the client's initial parameters; needs ``shape`` None).
    """

    shape: Optional[tuple[int, ...]] = None
    dtype: Optional[torch.dtype] = None
    init: str = "zeros"

    def __post_init__(self):
        if self.init not in ("zeros", "params"):
            raise ValueError(f"StateSpec init must be 'zeros' or 'params', got {self.init!r}")
        if self.init == "params" and self.shape is not None:
            raise ValueError("StateSpec init='params' needs shape None (a row in the parameter layout)")


def _buffer_group(groups: Groups, model: nn.Module, name: str) -> str:
    """The group of a buffer: that of its module's own parameters, else ``head`` under the
    head, else ``body`` (or the first group, when no parameter is left in ``body``)."""
    path = name.rpartition(".")[0]
    owner = model.get_submodule(path) if path else model
    for leaf, _ in owner.named_parameters(recurse=False):
        return groups.group_of(f"{path}.{leaf}" if path else leaf)
    if name.startswith("head.") and "head" in groups.members:
        return "head"
    return "body" if "body" in groups.members else groups.order[0]


class Cohort:
    """The clients of one architecture.

    Attributes:
        name: the architecture's name.  clients: member client ids (ascending).
        groups: the parameter groups of this architecture.
        layout / buffer_layout / int_buffer_layout: where each tensor lives in a row.
        params / buffers / int_buffers: banks, one row per member.
        extra: algorithm-declared state name -> bank.
        optimizer_state: phase state name -> {state vector name -> bank} (kept state only).
        optimizer_steps: phase state name -> [members] int64 step counts (kept state only).
    """

    def __init__(self, name: str, model: nn.Module, clients: Sequence[int], groups: Groups, *,
                 device, extra: Mapping[str, StateSpec] = ()):
        self.name = name
        self.clients = tuple(clients)
        self._row = {client: row for row, client in enumerate(self.clients)}
        self.groups = groups
        model = model.to(device)
        if torch.device(device).type == "cpu":
            # One fused kernel for each ReLU + 2x2 max pool: the same values and gradients,
            # and F.max_pool2d is slowest on few channels channels-last (LeNet-5's first pool,
            # 64 images: 0.42 against 1.16 ms forward and backward, benchmarks/bench_pool.py).
            fuse_relu_max_pool(model)
        self.buffer_group = {n: _buffer_group(groups, model, n) for n, b in model.named_buffers()
                             if b.is_floating_point()}
        # Buffers are ordered by group too, so the buffers of the shared groups are one range.
        buffer_key = lambda name: groups.order.index(self.buffer_group[name]) if name in self.buffer_group else 0
        self._main_work = WorkingModel(model, order=groups.layout_key, buffer_order=buffer_key)
        self._local = threading.local()
        self._lock = threading.Lock()
        work = self._main_work
        self.layout = work.layout
        self.buffer_layout, self.int_buffer_layout = work.buffer_layout, work.int_buffer_layout
        k = len(self.clients)
        self.params = ClientBank(self.layout, k, device=device, fill=work.params)
        self.buffers = ClientBank(self.buffer_layout, k, device=device, fill=work.buffers)
        self.int_buffers = ClientBank(self.int_buffer_layout, k, device=device, fill=work.int_buffers)
        self.extra = {state: self._extra_bank(state, spec, device) for state, spec in dict(extra).items()}
        self.optimizer_state: dict[str, dict[str, ClientBank]] = {}
        self.optimizer_steps: dict[str, torch.Tensor] = {}

    def _extra_bank(self, state: str, spec: StateSpec, device) -> ClientBank:
        dtype = spec.dtype or self.layout.dtype
        if spec.shape is None:
            layout = FlatLayout(self.layout.entries, dtype)
        else:
            layout = FlatLayout.of_tensors([(state, torch.empty(spec.shape))], dtype=dtype)
        return ClientBank(layout, len(self.clients), device=device,
                          fill=self._main_work.params if spec.init == "params" else None)

    @property
    def work(self) -> WorkingModel:
        """The calling thread's working model (worker threads each get their own copy)."""
        work = getattr(self._local, "work", None)
        if work is None:
            if threading.current_thread() is threading.main_thread():
                work = self._main_work
            else:
                with self._lock:
                    work = self._main_work.copy()
            self._local.work = work
        return work

    @property
    def module(self) -> nn.Module:
        """The template module (the main thread's working model)."""
        return self._main_work.module

    def row(self, client: int) -> int:
        """The bank row of member ``client``."""
        return self._row[client]

    def span(self, group: str) -> slice:
        """The range of ``group`` in a parameter row."""
        return self.layout.span(self.groups.members[group])

    def segments(self, group: str) -> tuple[Entry, ...]:
        """The parameter tensors of ``group`` in its flat vector, in layout order: each an
        :class:`~pfl_algorithms.engine.layout.Entry` (name, shape, offset) whose offset counts
        from the group's start, so ``flat_group[e.offset:e.stop].view(e.shape)`` is tensor
        ``e.name``.  KeyError for a group this architecture lacks."""
        if group not in self.groups.members:
            raise KeyError(f"{group!r} is no parameter group of architecture {self.name!r} "
                           f"(groups: {', '.join(self.groups.order)})")
        start = self.span(group).start
        return tuple(Entry(name, self.layout.by_name[name].shape, self.layout.by_name[name].offset - start)
                     for name in sorted(self.groups.members[group], key=lambda n: self.layout.by_name[n].offset))

    def shared_buffer_span(self) -> slice:
        """The range of the floating buffers that belong to shared groups."""
        names = [n for n, g in self.buffer_group.items() if g not in self.groups.local]
        return self.buffer_layout.span(names)

    def group_shapes(self, group: str) -> list[tuple[int, ...]]:
        """The shapes of ``group``'s tensors, in layout order (what another cohort must match)."""
        return [self.layout.by_name[n].shape for n in self.groups.members[group]]

    def ensure_optimizer_state(self, state: str, names: Sequence[str]) -> None:
        """Create the kept optimizer state ``state`` (vectors ``names``) if it does not exist yet."""
        if state not in self.optimizer_state:
            self.optimizer_state[state] = {n: ClientBank(self.layout, len(self.clients), device=self.params.data.device)
                                           for n in names}
            self.optimizer_steps[state] = torch.zeros(len(self.clients), dtype=torch.int64)
        elif set(self.optimizer_state[state]) != set(names):
            raise ValueError(f"optimizer state {state!r} holds {sorted(self.optimizer_state[state])} but a phase's "
                             f"optimizer needs {sorted(names)}: phases with different optimizers need different "
                             "state names")

    def client_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-client tensor of the cohort, by a flat name, each [members, ...] (row r is
        member r's): ``params``, ``buffers``, ``int_buffers``, ``extra/<name>``,
        ``optimizer/<state>/<vector>`` and ``steps/<state>``.  What moves with a client between
        processes (a Flower node's kept state, a distributed rank's rows)."""
        tensors = {"params": self.params.data, "buffers": self.buffers.data, "int_buffers": self.int_buffers.data}
        tensors.update({f"extra/{name}": bank.data for name, bank in self.extra.items()})
        for state, vectors in self.optimizer_state.items():
            tensors.update({f"optimizer/{state}/{vector}": bank.data for vector, bank in vectors.items()})
            tensors[f"steps/{state}"] = self.optimizer_steps[state]
        return tensors

    def ensure_client_tensors(self, names) -> None:
        """Create the kept optimizer states that ``names`` (of :meth:`client_tensors`) hold and
        this cohort lacks, so that every name has its tensor."""
        vectors: dict[str, list[str]] = {}
        for name in names:
            if name.startswith("optimizer/"):
                _, state, vector = name.split("/", 2)
                vectors.setdefault(state, []).append(vector)
        for state, found in vectors.items():
            self.ensure_optimizer_state(state, found)

    def state_dict(self) -> dict:
        """Every bank of the cohort (for checkpoints)."""
        return {"params": self.params.data, "buffers": self.buffers.data, "int_buffers": self.int_buffers.data,
                "extra": {n: b.data for n, b in self.extra.items()},
                "optimizer_state": {s: {n: b.data for n, b in banks.items()} for s, banks in self.optimizer_state.items()},
                "optimizer_steps": dict(self.optimizer_steps)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the kept optimizer states are recreated as saved)."""
        self.params.load_state_dict({"data": state["params"]})
        self.buffers.load_state_dict({"data": state["buffers"]})
        self.int_buffers.load_state_dict({"data": state["int_buffers"]})
        if set(state["extra"]) != set(self.extra):
            raise ValueError(f"the checkpoint's extra client state {sorted(state['extra'])} differs from the "
                             f"algorithm's {sorted(self.extra)}")
        for name, bank in self.extra.items():
            bank.load_state_dict({"data": state["extra"][name]})
        self.optimizer_state, self.optimizer_steps = {}, {}
        for name, vectors in state["optimizer_state"].items():
            self.ensure_optimizer_state(name, list(vectors))
            for vector, bank in self.optimizer_state[name].items():
                bank.load_state_dict({"data": vectors[vector]})
            self.optimizer_steps[name].copy_(state["optimizer_steps"][name])
