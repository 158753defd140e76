"""Files written so that a kill never leaves half of one: a temporary file in the same folder,
flushed and synced, then moved over the old one with ``os.replace`` (atomic on POSIX)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path, value: Any, *, compact: bool = False) -> None:
    """``value`` as JSON (indented and key-sorted, or ``compact``), written atomically."""
    text = json.dumps(value, separators=(",", ":")) if compact else json.dumps(value, indent=2, sort_keys=True)
    atomic_write_bytes(path, (text + "\n").encode())
