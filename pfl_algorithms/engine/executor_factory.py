"""``make_executor``: the executor a run names.  Apart from ``executors`` (the base class and
the thread executors), which ``batched`` and ``distributed`` build on, so that no module
imports one that imports it back."""
from __future__ import annotations

from typing import Optional

import torch

from .batched import BatchedExecutor
from .distributed import DistributedExecutor
from .executors import EXECUTORS, Executor, SequentialExecutor, ThreadedExecutor


def make_executor(name: str, *, workers: Optional[int] = None, device: str = "cpu",
                  chunk: Optional[int] = None, threaded_hooks: bool = False) -> Executor:
    """The executor ``name`` ('sequential', 'threaded', 'batched', whose chunks hold ``chunk``
    clients, None: as many as free memory holds, and which sends plans with begin hooks or
    loss terms to threads when ``threaded_hooks``; or 'distributed', ``workers`` tasks at once
    per rank, None: 1); on a GPU, threads would only queue kernels on
    one device, so ``threaded`` (and batched's fallback) runs one task at a time there."""
    if name not in EXECUTORS:
        raise ValueError(f"executor must be one of {sorted(EXECUTORS)}, got {name!r}")
    workers = 1 if torch.device(device).type != "cpu" else workers
    if name == "threaded":
        return ThreadedExecutor(workers)
    if name == "batched":
        return BatchedExecutor(workers, chunk=chunk, threaded_hooks=threaded_hooks)
    if name == "distributed":
        return DistributedExecutor(workers, device=device)
    return SequentialExecutor()
