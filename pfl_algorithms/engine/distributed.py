"""The ``distributed`` executor: a round's clients sharded over the processes of a
torch.distributed job (``torchrun --nproc-per-node N -m pfl_algorithms run ... --executor
distributed``; gloo on a CPU, NCCL on CUDA).

Every rank builds the same federation (the data, the partition and the initial banks are
deterministic) and runs the algorithm's server side replicated: ``configure`` and ``aggregate``
run on every rank over the same gathered uploads, so aggregation is computed where the
algorithm's server runs, on every rank identically, and every rank gets the same server state.
Only the uploads, the evaluation metrics and (for a checkpoint) the owners' bank rows travel.

Ownership is fixed: client ``c`` belongs to rank ``c % N``.  A rank trains and evaluates only
its own clients' tasks of a round, so its bank rows of those clients are authoritative and the
other rows are stale on it (a client's rows change only when it trains, and it trains only on
its owner).  Before a checkpoint, :meth:`DistributedExecutor.sync_state` brings every client's
rows from its owner to every rank; a checkpoint therefore holds the whole federation and a
resumed run may use another N.

Each task runs as on the threaded executor (one intra-op thread, ``workers`` at once per rank,
default 1: the ranks are the parallelism), and the server sees the uploads in task order, so a
distributed run gives bitwise the metrics and checkpoint of a sequential one on a CPU.

What ranks send each other (results, bank rows, rank 0's config and checkpoint) travels as
``torch.save`` bytes in uint8 tensors and is read like a checkpoint, ``weights_only=True`` with
only the engine's result classes allowed besides plain values (:func:`decode`): a peer cannot
make another rank run code.  The job still trusts its network, as torch.distributed does (its
rendezvous and collectives are unauthenticated): a peer can send wrong numbers.

Run without a process group (plain ``python -m pfl_algorithms run --executor distributed``,
no torchrun environment), the executor is a world of one process and runs every task itself.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Optional

import torch

from .checkpoint import refusal_reason
from .executors import Executor, ThreadedExecutor

# torchrun's environment; a process group is joined when WORLD_SIZE is set.
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _dist():
    import torch.distributed as dist

    return dist


def world() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) without a process group."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_world_size() -> int:
    """The world size torchrun gave this process (``WORLD_SIZE``; 1 when not launched by it)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} in the environment is not an integer") from None
    if size < 1:
        raise ValueError(f"WORLD_SIZE={size} in the environment must be >= 1")
    return size


@contextmanager
def process_group(executor: Optional[str], device: str):
    """For the body of a run: join the job torchrun started when the run's ``executor`` is
    'distributed' and the environment names one (gloo on a CPU, NCCL on CUDA, each rank on the
    GPU ``LOCAL_RANK``), and leave it after.  Without that environment: no group, a world of one.

    Raises:
        ValueError: torchrun's environment is incomplete, torch has no distributed support, or
            several processes were launched for a run whose executor is not 'distributed' (each
            would run the whole federation into the same run directory).
    """
    size = launched_world_size()
    if executor != "distributed":
        if size > 1:
            raise ValueError(f"launched with {size} processes (WORLD_SIZE={size}) but the executor is "
                             f"{executor or 'the default'}: pass --executor distributed, or run one process")
        yield
        return
    dist = _dist()
    if "WORLD_SIZE" not in os.environ or (dist.is_available() and dist.is_initialized()):
        yield  # one process (world 1), or a group the caller made
        return
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise ValueError(f"--executor distributed: WORLD_SIZE is set but {', '.join(missing)} is not; launch with "
                         f"torchrun --nproc-per-node N -m pfl_algorithms run ...")
    if not dist.is_available():
        raise ValueError("--executor distributed: this torch build has no torch.distributed")
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif not dist.is_gloo_available():
        raise ValueError("--executor distributed on a CPU needs the gloo backend, which this torch build lacks")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _payload_types() -> list:
    """The classes a payload between ranks may hold besides tensors, numbers, strings and plain
    containers: the tasks' results (and the run's config, which rank 0 sends).  Dataclasses
    without a custom ``__setstate__``/``__reduce__``: building one only sets its fields."""
    from ..config import RunConfig
    from .client import EvalResult, TrainResult
    from .local import LocalResult
    from .messages import Message, Sparse

    return [RunConfig, TrainResult, EvalResult, LocalResult, Message, Sparse]


def encode(value) -> bytes:
    """``value`` as the bytes one rank sends another (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(payload: bytes, device, source: str = "a peer"):
    """The value :func:`encode` made of ``payload``, its tensors on ``device``.

    Read like a checkpoint (``engine/checkpoint.py``): ``torch.load(weights_only=True)``, which
    builds only tensors, numbers, strings and plain containers, and here also the classes of
    :func:`_payload_types`; whatever else a payload names (a function, another class: what a
    crafted pickle calls to run code) is refused before anything runs.

    Raises:
        ValueError: one line naming ``source``, for a payload holding anything else or not
            made by ``encode``.
    """
    try:
        with torch.serialization.safe_globals(_payload_types()):
            return torch.load(io.BytesIO(payload), map_location=device, weights_only=True)
    except Exception as error:  # weights_only refuses with UnpicklingError; a crafted zip may fail otherwise
        raise ValueError(f"refusing the payload from {source}: it holds something other than tensors, numbers, "
                         f"strings, containers and the engine's results ({refusal_reason(error)}); nothing in it "
                         f"was run") from None


def _wire_device():
    """Where collectives take their tensors: the current GPU under NCCL, else the CPU."""
    if _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_tensor(payload: bytes, length: int, device) -> torch.Tensor:
    tensor = torch.zeros(length, dtype=torch.uint8, device=device)
    if payload:
        tensor[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    return tensor


def broadcast_from_leader(value=None):
    """Rank 0's ``value`` on every rank (``value`` itself in a world of one), sent as bytes
    (:func:`encode`/:func:`decode`): nothing is unpickled on the way."""
    rank, size = world()
    if size == 1:
        return value
    dist, device = _dist(), _wire_device()
    payload = encode(value) if rank == 0 else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    data = _as_tensor(payload, int(length), device)
    dist.broadcast(data, src=0)
    return decode(data.cpu().numpy().tobytes(), "cpu", "rank 0")


def all_gather(value, device) -> list:
    """Every rank's ``value``, in rank order, with its tensors on ``device``.

    Sent as :func:`encode` bytes in uint8 tensors (``all_gather_object`` would unpickle what a
    peer sent, which can run code) and read back with :func:`decode`: only tensors, plain
    values and the engine's result classes are built, on ``device`` (a CUDA tensor pickled
    plainly would come back on the sender's GPU)."""
    rank, size = world()
    if size == 1:
        return [value]
    dist, wire = _dist(), _wire_device()
    payload = encode(value)
    lengths = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=wire))
    lengths = [int(n) for n in lengths]
    longest = max(lengths)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=wire) for _ in range(size)]
    dist.all_gather(gathered, _as_tensor(payload, longest, wire))
    return [decode(data[:n].cpu().numpy().tobytes(), device, f"rank {r}")
            for r, (data, n) in enumerate(zip(gathered, lengths))]


class DistributedExecutor(Executor):
    """A round's tasks sharded over the ranks by client (``client % N``), gathered in task order
    (module docstring); ``workers`` tasks at once within a rank (None: 1)."""

    name = "distributed"

    def __init__(self, workers: Optional[int] = None, device="cpu"):
        self.local = ThreadedExecutor(workers or 1)
        self.device = torch.device(device)

    @staticmethod
    def owner(client: int, size: int) -> int:
        """The rank that owns ``client`` in a world of ``size``."""
        return client % size

    def _sharded(self, tasks, run_own):
        rank, size = world()
        mine = [i for i, task in enumerate(tasks) if self.owner(task.client, size) == rank]
        results = run_own([tasks[i] for i in mine])
        placed: list = [None] * len(tasks)
        # Every rank computes the same ownership, so rank r's k-th result is task positions(r)[k].
        for r, part in enumerate(all_gather(results, self.device)):
            positions = [i for i, task in enumerate(tasks) if self.owner(task.client, size) == r]
            for i, result in zip(positions, part, strict=True):
                placed[i] = result
        return placed

    def run(self, tasks, run_one):
        """Each rank runs its own clients' tasks (evaluation); every rank gets all results."""
        return self._sharded(tasks, lambda own: self.local.run(own, run_one))

    def run_train(self, fed, algorithm, tasks, run_one) -> list:
        """The round's training tasks: each rank trains its own clients and answers their
        statistics requests from their rows (authoritative only there), then every rank gets
        every TrainResult, in task order."""
        return self._sharded(tasks, lambda own: self.local.run_train(fed, algorithm, own, run_one))

    def sync_state(self, fed) -> None:
        """Copy every client's rows (parameters, buffers, integer buffers, extra state, kept
        optimizer state and step counts) from its owner into every rank's banks: a collective,
        called by every rank before a checkpoint."""
        rank, size = world()
        if size == 1:
            return
        mine = {}
        for cohort in fed.cohorts:
            rows = torch.tensor([row for row, client in enumerate(cohort.clients) if self.owner(client, size) == rank],
                                dtype=torch.int64)
            mine[cohort.name] = {"rows": rows, **{name: tensor[rows.to(tensor.device)]
                                                  for name, tensor in cohort.client_tensors().items()}}
        for r, part in enumerate(all_gather(mine, self.device)):
            if r == rank:
                continue
            for cohort in fed.cohorts:
                sent = dict(part[cohort.name])
                rows = sent.pop("rows")
                cohort.ensure_client_tensors(sent)
                tensors = cohort.client_tensors()
                for name, values in sent.items():
                    tensors[name][rows.to(tensors[name].device)] = values.to(tensors[name].device)

    def close(self) -> None:
        self.local.close()
