"""Files written so that a kill never leaves half of one: a temporary file in the same folder,
flushed and synced, then moved over the old one with ``os.replace`` (atomic on POSIX).  JSON is
written strict (``json_text``): no bare NaN or Infinity."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Iterator

# Mode asked for when a file is created; the kernel removes the user's umask from it (0644
# under umask 022), as for a file any other tool writes.  tempfile.mkstemp would give 0600.
_NEW_FILE_MODE = 0o666


def _create_temporary(folder: Path, name: str) -> tuple[int, str]:
    """(fd, path) of a new, empty, hidden file ``.<name>.<random>.tmp`` in ``folder``."""
    while True:
        tmp = str(folder / f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _NEW_FILE_MODE), tmp
        except FileExistsError:  # another writer drew the same name: draw again
            continue


_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file's of :func:`atomic_file` (``.<name>.<12 hex>.tmp``)."""
    return _TEMPORARY.fullmatch(name) is not None


@contextlib.contextmanager
def atomic_file(path) -> Iterator[BinaryIO]:
    """A new binary file (writable and seekable) that replaces ``path`` atomically when the
    block ends without an error: written in a temporary file in the same folder, flushed and
    synced, then moved over ``path`` (the file's mode follows the umask).  On an error the
    temporary file is removed and ``path`` keeps its previous content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename (:func:`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Infinity, -Infinity) inside it replaced by
    None, which JSON writes as null: "no number" (a diverged loss, a client without test
    samples).  Python's json would write bare ``NaN``, which is not JSON: jq, JavaScript and
    strict parsers reject the whole file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def json_text(value: Any, **options) -> str:
    """``json.dumps(finite_json(value), **options)``, strict: ``allow_nan=False`` turns a
    non-finite number that got past the conversion into an error instead of a bare NaN."""
    return json.dumps(finite_json(value), allow_nan=False, **options)


def atomic_write_json(path, value: Any, *, compact: bool = False) -> None:
    """``value`` as strict JSON (``json_text``: non-finite numbers as null), indented and
    key-sorted or ``compact``, written atomically."""
    text = json_text(value, separators=(",", ":")) if compact else json_text(value, indent=2, sort_keys=True)
    atomic_write_bytes(path, (text + "\n").encode())
