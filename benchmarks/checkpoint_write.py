"""What a round's checkpoint costs the run: the time the round loop waits for it.

    python benchmarks/checkpoint_write.py [--clients 20 --repeats 5 --dir DIR]

Builds the checkpoint state of the Factorized-FL Table 1 setting of ``gpu_executor.py``
(factorized-fl-beta, ResNet-9, ``--clients`` clients: 455 MB at 20) by one round of a few
samples per client on the CPU, then writes it, interleaved, ``--repeats`` times each way:

* ``in-memory``: as checkpoints were written before streaming: ``torch.save`` into memory,
  SHA-256 of the payload, header and payload joined into one bytes object, written atomically;
* ``streamed``: ``write_checkpoint`` (the payload streamed into the file, hashed on the way);
* ``background``: what ``CheckpointWriter.save`` blocks the round loop for (the copy to host
  memory; the write overlaps the next round), then waited for before the next repeat.

Prints the medians and the ratios; all three files hold the same payload (checked).  Run it
when nothing else loads the machine: the figures are disk and memory bound.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def table1_state(clients: int, scratch: Path) -> dict:
    """The checkpoint state after one round of the Table 1 setting (gpu_executor.table1_job's
    config) with ``clients`` clients of 8 samples each."""
    from pfl_algorithms.config import RunConfig
    from pfl_algorithms.engine.checkpoint import read_checkpoint
    from pfl_algorithms.runner import run

    config = RunConfig(algorithm="factorized-fl-beta", dataset="synthetic-cifar", scenario="iid", model="resnet9",
                       batch_size=256, lr=1e-3, momentum=0.9, weight_decay=1e-6, clients=clients, rounds=1,
                       local_epochs=1, samples_per_client=8)
    run(config, scratch / "run", overwrite=True, progress=False)
    return read_checkpoint(scratch / "run" / "checkpoint.pt")


def write_in_memory(path: Path, state: dict) -> None:
    """The checkpoint as it was written before streaming (same file format, unpadded header)."""
    from pfl_algorithms.atomic_io import atomic_write_bytes
    from pfl_algorithms.engine.checkpoint import MAGIC, VERSION

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), "version": VERSION}
    atomic_write_bytes(path, MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)


def payload(path: Path) -> bytes:
    data = path.read_bytes()
    return data[data.index(b"\n") + 1:]


def measure(state: dict, folder: Path, repeats: int) -> dict:
    """Median seconds the caller waits, per way of writing (module docstring)."""
    from pfl_algorithms.engine.checkpoint import write_checkpoint
    from pfl_algorithms.engine.checkpoint_writer import CheckpointWriter

    writer = CheckpointWriter()
    ways = {"in-memory": lambda path: write_in_memory(path, state),
            "streamed": lambda path: write_checkpoint(path, state),
            "background": lambda path: writer.save(path, state)}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, write in ways.items():
            start = time.perf_counter()
            write(folder / f"{name}.pt")
            seconds[name].append(time.perf_counter() - start)
            writer.wait()
    files = [payload(folder / f"{name}.pt") for name in ways]
    if any(other != files[0] for other in files[1:]):
        raise AssertionError("the three ways wrote different payloads")
    return {"bytes": len(files[0]), **{name: statistics.median(times) for name, times in seconds.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        result = measure(table1_state(args.clients, Path(scratch)), Path(scratch), args.repeats)
    print(f"checkpoint of {args.clients} clients: {result['bytes'] / 1e6:.1f} MB; the round loop waits "
          f"(median of {args.repeats}):")
    for name in ("in-memory", "streamed", "background"):
        print(f"  {name:<10} {result[name]:8.3f} s  (in-memory / this: {result['in-memory'] / result[name]:5.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
