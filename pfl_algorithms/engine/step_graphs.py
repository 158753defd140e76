"""Training steps replayed as CUDA graphs.

A client step launches dozens of kernels (forward, backward, the optimizer's handful); at the
sizes federated learning trains, the GPU finishes them faster than Python launches them.  A
CUDA graph records the launches once and replays them as one.  The executors write a step
that qualifies (``capturable``) as a function of tensors whose addresses never change: the
batch is copied into static input tensors, the model's parameters, gradients, buffers and
optimizer state are persistent flat tensors, and nothing is read back to the host inside (the
optimizer steps with ``capturable=True``: its step count a device tensor).

``StepGraphs.run`` calls such a step.  On CUDA with ``cuda_graphs`` on, each key (what the
step's kernels depend on: shapes, the optimizer's settings, the trained ranges, ...) runs
``WARMUP`` eager steps on a side stream (what torch's CUDA-graph notes ask for: lazy
initializations happen outside the capture), then captures the next step and replays it from
then on (a step whose capture fails, an op that cannot be captured, says so in one line and
runs uncaptured).  Elsewhere it calls the function: the same code, uncaptured, which is what
the CPU tests check against the executors' general step.  The graphs of one ``StepGraphs`` share one
memory pool: they replay one at a time on one stream, and each writes its results into the
persistent tensors, never into the pool, so no graph reads what another left there.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Callable, Hashable, Optional

import torch

from .plan import CapturableHook

# Eager steps per key before its capture (torch's notes warm up on a side stream first): one
# initializes what is lazy (cuBLAS and cuDNN handles and workspaces, autograd's device threads);
# a key seen once a round (a short last batch) is then captured in its second round.
WARMUP = 1
# Graphs kept at once: each key's graph holds its own kernels' parameters; the oldest goes first.
LIMIT = 32


def capturable(phase) -> bool:
    """Whether ``phase``'s steps are plain enough to capture: one batch per step, no custom
    gradient, no loss terms, and gradient terms and an after-step hook only where each is a
    ``plan.capturable_hook`` (any other is Python that runs between the kernels, reads values
    back or reads tensors a replay would not)."""
    hooks = (*phase.grad_terms, *(() if phase.after_step is None else (phase.after_step,)))
    return (phase.gradient is None and not phase.loss_terms and phase.batches_per_step == 1
            and all(isinstance(hook, CapturableHook) for hook in hooks))


def hook_keys(phase) -> tuple:
    """What a captured step of ``phase`` depends on of its hooks: their keys, in order."""
    return (tuple(term.key for term in phase.grad_terms), None if phase.after_step is None else phase.after_step.key)


class StaticStep:
    """One key's step: ``fn`` reads ``inputs`` (static tensors the caller fills before each call)
    and the persistent tensors it closes over; ``graph`` once captured."""

    def __init__(self, fn: Callable[[], None], inputs: dict[str, torch.Tensor]):
        self.fn, self.inputs = fn, inputs
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.warm = 0
        self.refused = False  # its capture failed: it runs uncaptured


class StepGraphs:
    """The captured steps of one federation (module docstring).

    ``capture``: replay CUDA graphs (needs a CUDA ``device``); else every step calls its
    function.  ``counts`` tells how the steps ran: 'eager' (warm-up or uncaptured), 'captured',
    'replayed'; tests and benchmarks read it."""

    def __init__(self, device: torch.device, *, capture: bool):
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        # Whether the sequential executor writes its plain steps as static ones: always when
        # capturing (elsewhere its host step runs; tests set this to run the static code on a CPU).
        self.static = self.capture
        self._steps: OrderedDict[Hashable, StaticStep] = OrderedDict()
        self._tensors: dict[Hashable, object] = {}
        self._pool = None
        self._stream = None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def step(self, key: Hashable, build: Callable[[], StaticStep]) -> StaticStep:
        """The step of ``key``, built by ``build()`` the first time (the least recently used
        step is dropped beyond ``LIMIT``)."""
        found = self._steps.get(key)
        if found is not None:
            self._steps.move_to_end(key)
            return found
        made = self._steps[key] = build()
        while len(self._steps) > LIMIT:
            self._steps.popitem(last=False)
        return made

    def tensors(self, key: Hashable, make: Callable[[], object]):
        """The persistent tensors of ``key`` (a chunk's stacked rows, a working model's optimizer
        state), made by ``make()`` the first time: steps captured on them stay valid while they live."""
        found = self._tensors.get(key)
        if found is None:
            found = self._tensors[key] = make()
        return found

    def run(self, step: StaticStep) -> None:
        """One step: its function (uncaptured, or a warm-up) or its graph's replay."""
        if not self.capture:
            step.fn()
            self.counts["eager"] += 1
            return
        if step.graph is None and (step.warm < WARMUP or step.refused):
            self._warm_up(step)
            return
        if step.graph is None:
            try:
                step.graph = self._capture(step)
            except RuntimeError as error:  # an op that cannot be captured: this key runs uncaptured
                step.refused = True
                reason = (str(error).strip().splitlines() or ["unknown"])[0]
                print(f"pfl: a training step could not be captured as a CUDA graph ({reason}); it runs uncaptured",
                      file=sys.stderr, flush=True)
                self._warm_up(step)  # a capture records without running: the step is still to do
                return
        step.graph.replay()
        self.counts["replayed"] += 1

    def _side_stream(self) -> "torch.cuda.Stream":
        """The one stream warm-ups and captures run on: libraries cache handles and workspaces
        per stream (cuBLASLt's, pytorch/pytorch#187745), so a capture on another stream than its
        warm-up's would create them mid-capture."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _warm_up(self, step: StaticStep) -> None:
        side, current = self._side_stream(), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step.fn()
        current.wait_stream(side)
        step.warm += 1
        self.counts["eager"] += 1

    def _capture(self, step: StaticStep) -> "torch.cuda.CUDAGraph":
        """``step``'s graph: capturing records its kernels without running them (``run`` then
        replays it for this step)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self._pool, stream=self._side_stream()):
            step.fn()
        self.counts["captured"] += 1
        return graph


def static_like(tensor: torch.Tensor) -> torch.Tensor:
    """A persistent tensor shaped and strided as ``tensor`` (a step's static input: the same
    memory format, so the kernels are those of an uncaptured step), on its device."""
    return torch.empty_like(tensor)
