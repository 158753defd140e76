"""The checkpoint file: a one-line header with the SHA-256 of what follows, then the state as
``torch.save`` writes it.

    pfl-checkpoint {"sha256": "<hex digest of the payload>", "size": <payload bytes>, "version": 1}<spaces>\\n
    <payload: torch.save of a dict of dicts, lists, tensors, numbers and strings>

The header line is padded with spaces to ``HEADER_BYTES``; files written before the padding
have none, and both are read.

Reading checks the header, then the digest (so a flipped byte anywhere in the payload is
refused, instead of resuming with different numbers), then unpickles with
``torch.load(weights_only=True)``, which builds only tensors and plain containers: a file
crafted to run code when unpickled is refused, whatever its header says.  Everything a
checkpoint holds is saved as such plain values for that reason.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import torch

from ..atomic_io import atomic_file

MAGIC = b"pfl-checkpoint "
VERSION = 1
_HEADER_LIMIT = 4096  # bytes searched for the header's end: a longer first line is not ours


# The header line's length in bytes (newline included), padded with spaces after the JSON: a
# fixed length lets the header, which holds the payload's digest and size, be written over
# its placeholder once the payload is in the file.  Readers take any length below _HEADER_LIMIT.
HEADER_BYTES = 256


class _HashingWriter:
    """A writable stream that passes what it is given on to ``file`` and hashes it on the way."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()


def header_line(sha256: str, size: int) -> bytes:
    """The checkpoint's first line for a payload of ``size`` bytes with digest ``sha256``,
    ``HEADER_BYTES`` long."""
    header = MAGIC + json.dumps({"sha256": sha256, "size": size, "version": VERSION}, sort_keys=True).encode()
    return header + b" " * (HEADER_BYTES - 1 - len(header)) + b"\n"


def write_checkpoint(path, state: dict) -> None:
    """Save ``state`` (plain containers, numbers, strings and tensors) to ``path`` atomically,
    under a header holding its SHA-256.  ``torch.save`` streams the payload into the file, hashed
    on the way; the header goes over its placeholder at the end, so the payload is never held
    in memory whole (a federation's checkpoint is hundreds of MB)."""
    with atomic_file(path) as f:
        f.write(b" " * HEADER_BYTES)
        payload = _HashingWriter(f)
        torch.save(state, payload)
        f.seek(0)
        f.write(header_line(payload.sha256.hexdigest(), payload.size))


def _header(path: Path, data: bytes) -> dict:
    end = data.find(b"\n", 0, _HEADER_LIMIT)
    if not data.startswith(MAGIC) or end < 0:
        raise ValueError(f"{path}: not a pfl checkpoint (it lacks the 'pfl-checkpoint' header line: a file from "
                         f"an older pfl, or not a checkpoint at all); refusing to load it")
    try:
        header = json.loads(data[len(MAGIC):end])
        if header["version"] != VERSION:
            raise ValueError(f"format version {header['version']!r}, this pfl reads {VERSION}")
        digest, size = str(header["sha256"]), int(header["size"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: unreadable checkpoint header ({error}); refusing to load it") from None
    return {"sha256": digest, "size": size, "start": end + 1}


def refusal_reason(error: Exception) -> str:
    """The line of torch's (multi-paragraph) weights_only message that says what was refused:
    the one after "WeightsUnpickler error:" where there is one, which torch puts after two
    paragraphs of advice (to load with weights_only=False, which we never do)."""
    lines = [line.strip() for line in str(error).splitlines()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            # torch's advice to allow-list the global follows; the refused global is the news
            return re.sub(r"^.*WeightsUnpickler error:\s*", "", line).split(" Please use ")[0]
    for line in lines:
        if line and not line.startswith(("Weights only load failed", "Check the documentation", "(1)", "(2)")):
            return line
    return type(error).__name__


def read_checkpoint(path) -> dict:
    """The state saved by :func:`write_checkpoint` at ``path``.

    Raises:
        ValueError: naming the file, when it has no valid header, when its content does not
            match the header's SHA-256 (corrupted), or when it holds anything but tensors,
            plain containers, numbers and strings (nothing in it is executed).
    """
    path = Path(path)
    data = path.read_bytes()
    header = _header(path, data)
    payload = memoryview(data)[header["start"]:]
    if len(payload) != header["size"]:
        raise ValueError(f"{path}: corrupt checkpoint: {len(payload)} bytes of content, the header says "
                         f"{header['size']} (truncated or extended); refusing to load it")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header["sha256"]:
        raise ValueError(f"{path}: corrupt checkpoint: the SHA-256 of its content is {digest[:16]}..., the header "
                         f"says {header['sha256'][:16]}... (changed since it was written); refusing to load it")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as error:  # weights_only refuses with UnpicklingError; a crafted zip may fail otherwise
        raise ValueError(f"{path}: refusing to load the checkpoint: it holds something other than tensors, "
                         f"numbers, strings and containers ({refusal_reason(error)}); nothing in it was "
                         f"run") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a pfl checkpoint (it holds a {type(state).__name__}, not a dict)")
    return state
