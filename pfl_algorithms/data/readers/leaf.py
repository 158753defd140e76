"""FEMNIST from LEAF: the JSON files LEAF's preprocessing writes.

    <root>/femnist/data/train/*.json, <root>/femnist/data/test/*.json

Each file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]],
"y": [labels]}}}``: 28x28 grey images flattened row-major with values in [0, 1] (kept as LEAF
gives them, upright, as float32), labels 0..61 (digits, then A..Z, then a..z).  LEAF's
"sample" split puts part of every writer's samples in train and the rest in test.

Order, the same whatever order the directory lists the files in: writers are sorted by their
LEAF id (``writer_names``; ``writers`` holds each sample's index into it); the train samples
come first, then the test ones; within a split, samples are grouped by writer in that order,
each writer's samples in the order of the files sorted by name, then as listed in the file.
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .common import RawData, check_download, check_labels, missing_file

FEMNIST_HOW = ("run LEAF's preprocessing (git clone https://github.com/TalwalkarLab/leaf; cd leaf/data/femnist; "
               "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample) and copy its data/train and data/test folders there")
FEMNIST_CLASSES = tuple(sorted(string.digits + string.ascii_letters))  # LEAF's ids: 0-9, A-Z, a-z
_PIXELS = 28 * 28


def read_leaf_file(path: Path, keep=lambda user: True) -> dict[str, tuple[Tensor, Tensor]]:
    """user -> (x [n, 1, 28, 28] float32, y [n] int64) for the users of one LEAF JSON file
    for which ``keep(user)`` is true (the others are not converted).

    Raises:
        ValueError: naming the file, for invalid JSON, missing keys, values of the wrong JSON
            type (``users`` not a list of strings, ``num_samples`` not a list, ``user_data``
            not an object, a user's entry not an object with the lists ``x`` and ``y``), a user
            without data, rows that are not 784 values in [0, 1] (NaN and infinities are refused),
            labels that are not integers in 0..61 (a float or a boolean is refused, not
            converted), or counts that disagree.
    """
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
        users, user_data = content["users"], content["user_data"]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a LEAF JSON file ({error})") from error
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a LEAF JSON file (it needs the keys 'users' and 'user_data')") from error
    if not isinstance(users, list):
        raise ValueError(f"{path}: 'users' must be a list of user names, got {_json_type(users)}")
    for i, user in enumerate(users):
        if not isinstance(user, str):
            raise ValueError(f"{path}: 'users'[{i}] must be a string, got {_json_type(user)}")
    counts = content.get("num_samples", [None] * len(users))
    if not isinstance(counts, list):
        raise ValueError(f"{path}: 'num_samples' must be a list of counts, got {_json_type(counts)}")
    if len(counts) != len(users):
        raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples")
    if not isinstance(user_data, dict):
        raise ValueError(f"{path}: 'user_data' must be an object mapping users to their data, "
                         f"got {_json_type(user_data)}")
    out = {}
    for user, count in zip(users, counts):
        if not keep(user):
            continue
        entry = user_data.get(user)
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(f"{path}: user {user!r}: its user_data must be an object with the lists x and y, "
                             f"got {_json_type(entry)}")
        if entry is None or "x" not in entry or "y" not in entry:
            raise ValueError(f"{path}: user {user!r} has no x and y in user_data")
        x, y = entry["x"], entry["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise ValueError(f"{path}: user {user!r}: x and y must be lists, got {_json_type(x)} and {_json_type(y)}")
        for i, label in enumerate(y):
            if type(label) is not int:  # not isinstance: bool is an int; a float like 3.7 would be truncated
                raise ValueError(f"{path}: user {user!r}: y[{i}] must be an integer label, got {label!r}")
        try:
            images = torch.tensor(x, dtype=torch.float32) if len(x) else torch.empty(0, _PIXELS)
            labels = torch.tensor(y, dtype=torch.int64).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{path}: user {user!r}: x must be rows of {_PIXELS} numbers and y integers "
                             f"({error})") from error
        if images.dim() != 2 or images.shape[1] != _PIXELS:
            raise ValueError(f"{path}: user {user!r}: x must be rows of {_PIXELS} values, "
                             f"got shape {list(images.shape)}")
        if len(labels) != len(images) or (count is not None and count != len(labels)):
            raise ValueError(f"{path}: user {user!r}: {len(images)} rows of x, {len(labels)} labels, "
                             f"num_samples {count}")
        if images.numel() and not bool(((images >= 0) & (images <= 1)).all()):  # NaN fails both comparisons
            raise ValueError(f"{path}: user {user!r}: x values must lie in [0, 1]")
        out[user] = (images.reshape(-1, 1, 28, 28), check_labels(labels, 62, f"{path}: user {user!r}"))
    return out


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_femnist(root: Path, *, max_writers: Optional[int] = None, download: bool = False) -> RawData:
    """FEMNIST as LEAF splits it: [N, 1, 28, 28] float32 images in [0, 1], labels 0..61,
    ``writers``/``writer_names`` (see the module docstring for the order), train then test.

    ``max_writers``: keep only the first n writers by sorted id (a CPU-sized subset; a writer
    already known to fall outside them is skipped before its samples are converted).  ``download=True`` raises: LEAF's data come from
    its own preprocessing scripts.
    """
    directory = Path(root) / "femnist" / "data"
    check_download(download, "femnist", directory, FEMNIST_HOW, supported=False)
    if max_writers is not None and (isinstance(max_writers, bool) or not isinstance(max_writers, int)
                                    or max_writers < 1):
        raise ValueError(f"femnist: max_writers must be None or an integer >= 1, got {max_writers!r}")
    kept: dict[str, dict[str, list]] = {}
    for split in ("train", "test"):
        folder = directory / split
        files = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if not files:
            raise missing_file(folder / "*.json", "femnist", FEMNIST_HOW)
        for path in files:
            cutoff = sorted(kept)[max_writers - 1] if max_writers is not None and len(kept) >= max_writers else None
            for user, arrays in read_leaf_file(path, lambda u: cutoff is None or u <= cutoff).items():
                kept.setdefault(user, {"train": [], "test": []})[split].append(arrays)
            if max_writers is not None:
                for user in sorted(kept)[max_writers:]:
                    del kept[user]
    writer_names = tuple(sorted(kept))
    if not writer_names:
        raise ValueError(f"femnist: the JSON files in {directory} list no users")
    pixels, labels, writers, mask = [], [], [], []
    for is_test, split in enumerate(("train", "test")):
        for writer, name in enumerate(writer_names):
            for images, ys in kept[name][split]:
                pixels.append(images)
                labels.append(ys)
                writers.append(torch.full((len(ys),), writer, dtype=torch.int64))
                mask.append(torch.full((len(ys),), bool(is_test)))
    return RawData(torch.cat(pixels), torch.cat(labels), 62, test_mask=torch.cat(mask), class_names=FEMNIST_CLASSES,
                   writers=torch.cat(writers), writer_names=writer_names)
