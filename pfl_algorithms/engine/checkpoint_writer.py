"""Checkpoints written on a background thread, so that the next round trains while the
previous round's file is serialized, hashed and synced (a factorized ResNet-9 federation of
20 clients writes 455 MB a round: seconds of a round that otherwise waits on the disk).

The round's state is copied to host memory first, on the caller's thread, because the next
round updates its tensors in place; the copy keeps which tensors share storage, so the file
holds what a synchronous ``write_checkpoint`` of the state would hold.  At most one write is
in flight: the next ``save`` waits for it.  An error of the write (a full disk) is raised by
the next ``save`` or by ``wait``; until then the previous checkpoint stays in place, since
the file is replaced atomically.
"""
from __future__ import annotations

import collections
import copy
import threading
from typing import Any, Optional

import torch

from .checkpoint import write_checkpoint


def host_copy(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied to the CPU; tensors that share a storage share its one copy (as ``torch.save``
    writes them: views of a storage stay views of it)."""
    copies: dict[tuple, torch.UntypedStorage] = {}

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return tensor.detach().to("cpu", copy=True)  # sparse or a subclass: no storage to share
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        host = copies.get(key) if storage.nbytes() else None
        if host is None:
            host = copies[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
        result = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(),
                                                         tensor.stride())
        if type(tensor) is torch.nn.Parameter:
            return torch.nn.Parameter(result, requires_grad=tensor.requires_grad)
        return result.requires_grad_(tensor.requires_grad)

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return copy_tensor(item)
        if isinstance(item, dict):
            entries = [(key, walk(entry)) for key, entry in item.items()]
            return collections.OrderedDict(entries) if isinstance(item, collections.OrderedDict) else dict(entries)
        if isinstance(item, list):
            return [walk(entry) for entry in item]
        if isinstance(item, tuple):
            entries = [walk(entry) for entry in item]
            return type(item)(*entries) if hasattr(item, "_fields") else tuple(entries)
        if item is None or isinstance(item, (bool, int, float, complex, str, bytes)):
            return item
        return copy.deepcopy(item)  # anything else the next round might change in place

    return walk(value)


class CheckpointWriter:
    """Writes ``write_checkpoint(path, state)`` on a background thread, one at a time."""

    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, path, state: dict) -> None:
        """Copy ``state`` to host memory now and write it to ``path`` in the background, after
        the write in flight (whose error, if any, is raised here instead)."""
        self.wait()
        snapshot = host_copy(state)
        # Not a daemon: an interpreter that exits (a second Ctrl-C included) finishes the write.
        self._thread = threading.Thread(target=self._write, args=(path, snapshot), name="pfl-checkpoint")
        self._thread.start()

    def _write(self, path, snapshot: dict) -> None:
        try:
            write_checkpoint(path, snapshot)
        except BaseException as error:  # raised again on the caller's thread by wait()
            self._error = error

    def wait(self) -> None:
        """Block until the write in flight is on disk; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
