"""The run directory: what a run writes, each file written so that a kill never corrupts it.

    config.json      the resolved configuration
    partition.json   the scenario's manifest (which indices and label map each client got)
    metrics.jsonl    one JSON line per round
    summary.json     final and best mean accuracy, communication in Gb, wall time
    checkpoint.pt    banks, optimizer state and server state after the last checkpointed round
    plots/           accuracy vs round, accuracy vs communicated bits, per-client accuracy

JSON and checkpoints are written to a temporary file in the same folder and moved over the
old one with ``os.replace`` (atomic on POSIX), so a killed run leaves the previous version.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..atomic_io import atomic_write_bytes


class RunDirectory:
    """Paths and writers of one run's directory."""

    def __init__(self, root):
        self.root = Path(root)
        self.config = self.root / "config.json"
        self.partition = self.root / "partition.json"
        self.metrics = self.root / "metrics.jsonl"
        self.summary = self.root / "summary.json"
        self.checkpoint = self.root / "checkpoint.pt"
        self.plots = self.root / "plots"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def append_metrics(self, record: dict) -> None:
        """Append one round's line (flushed and synced, so a kill loses at most that line)."""
        with self.metrics.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        lines = []
        for line in self.metrics.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: the rounds after it are redone on resume
        return lines

    def truncate_metrics(self, rounds: int) -> list[dict]:
        """Keep the lines of rounds < ``rounds`` (those the checkpoint covers); returns them."""
        kept = [m for m in self.read_metrics() if m["round"] < rounds]
        atomic_write_bytes(self.metrics, "".join(json.dumps(m, sort_keys=True) + "\n" for m in kept).encode())
        return kept

    def save_checkpoint(self, state: dict) -> None:
        import io

        buffer = io.BytesIO()
        torch.save(state, buffer)
        atomic_write_bytes(self.checkpoint, buffer.getvalue())

    def load_checkpoint(self) -> dict:
        if not self.checkpoint.exists():
            raise ValueError(f"--resume: no checkpoint at {self.checkpoint}")
        return torch.load(self.checkpoint, map_location="cpu", weights_only=False)
