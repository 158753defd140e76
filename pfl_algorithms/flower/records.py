"""pfl :class:`Message` <-> Flower records, entries of one ``RecordDict`` under a prefix.

A message ``m`` sent under prefix ``p`` becomes:

* ``p.layout``   ConfigRecord: what each record holds (JSON: every tensor's kind, dtype, shape,
                 threshold and index bits; the structure of the extras);
* ``p.tensor.<group>`` one ArrayRecord per parameter group (and ``buffers``): ``values`` for a
                 dense tensor; ``indices`` (int64 flat positions) and ``values`` for a
                 :class:`Sparse` one, only the entries it keeps;
* ``p.extra.<i>`` one ArrayRecord per tensor among the extras (nested in dicts, lists, tuples);
* ``p.counts``   MetricRecord: ``num-examples`` and the extras' numbers (``number.<j>``).

Decoding rebuilds the same message: dense tensors bitwise, a Sparse payload as a Sparse with
the same threshold and index bits whose kept entries are those sent, so
``decode(encode(m)).bits() == m.bits()`` and the ledger counts a Flower run's records as a
native run counts its messages (``engine.messages``: a Sparse payload costs its kept entries,
indices as its ``index_bits`` say).  A :class:`Statistic` request cannot travel: the client
answers it before sending (``flower.client``).
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..engine.messages import Message, Sparse, Statistic

# numpy has no bfloat16: such tensors travel as their int16 bit patterns.
_BIT_PATTERNS = {torch.bfloat16: torch.int16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _array(tensor: torch.Tensor):
    from flwr.common import Array

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype in _BIT_PATTERNS:
        tensor = tensor.view(_BIT_PATTERNS[tensor.dtype])
    return Array(tensor.numpy())


def _tensor(array, dtype_name: str, device) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    tensor = torch.from_numpy(np.array(array.numpy(), copy=True))
    if dtype in _BIT_PATTERNS:
        tensor = tensor.view(dtype)
    if tensor.dtype != dtype:
        raise ValueError(f"a record holds {tensor.dtype} where its layout says {dtype}")
    return tensor.to(device)


def _payload_record(value, spec: dict):
    """One ArrayRecord for a tensor or Sparse payload; fills ``spec`` with what decoding needs."""
    from flwr.common import ArrayRecord

    tensor = value.tensor if isinstance(value, Sparse) else value
    spec.update(dtype=_dtype_name(tensor.dtype), shape=list(tensor.shape))
    record = ArrayRecord()
    if isinstance(value, Sparse):
        spec.update(kind="sparse", threshold=value.threshold, index_bits=value.index_bits)
        flat = tensor.detach().reshape(-1)
        indices = torch.nonzero(value.kept().reshape(-1)).reshape(-1)
        record["indices"] = _array(indices)
        record["values"] = _array(flat[indices])
    else:
        spec["kind"] = "dense"
        record["values"] = _array(tensor)
    return record


def _payload(record, spec: dict, device):
    values = _tensor(record["values"], spec["dtype"], device)
    if spec["kind"] == "dense":
        return values.reshape(spec["shape"])
    dense = torch.zeros(spec["shape"], dtype=values.dtype, device=device)
    dense.view(-1)[_tensor(record["indices"], "int64", device)] = values
    return Sparse(dense, spec["threshold"], spec["index_bits"])


def encode(message: Message, prefix: str) -> dict:
    """The records of ``message`` under ``prefix`` (module docstring), by record name.

    Raises:
        TypeError: the extras hold a :class:`Statistic` request (answer it first) or a value
            no message can carry.
    """
    from flwr.common import ConfigRecord, MetricRecord

    records: dict = {}
    counts = {"num-examples": int(message.num_examples)}
    layout: dict = {"tensors": []}
    for name, value in message.tensors.items():
        spec = {"name": name}
        records[f"{prefix}.tensor.{name}"] = _payload_record(value, spec)
        layout["tensors"].append(spec)

    def structure(value):
        if isinstance(value, Statistic):
            raise TypeError(f"a {type(value).__name__} request cannot be sent: the client answers it before its upload")
        if isinstance(value, (torch.Tensor, Sparse)):
            spec = {"tensor": sum(1 for k in records if k.startswith(f"{prefix}.extra."))}
            records[f"{prefix}.extra.{spec['tensor']}"] = _payload_record(value, spec)
            return spec
        if isinstance(value, bool):
            index = len(counts) - 1
            counts[f"number.{index}"] = int(value)
            return {"number": index, "type": "bool"}
        if isinstance(value, (int, float)):
            index = len(counts) - 1
            counts[f"number.{index}"] = value
            return {"number": index, "type": type(value).__name__}
        if isinstance(value, Mapping):
            return {"dict": [[key, structure(item)] for key, item in value.items()]}
        if isinstance(value, (list, tuple)):
            return {type(value).__name__: [structure(item) for item in value]}
        raise TypeError(f"a message can carry tensors, Sparse tensors, numbers and lists/dicts of them, "
                        f"got {type(value).__name__}")

    layout["extras"] = structure(dict(message.extras))
    records[f"{prefix}.layout"] = ConfigRecord({"layout": json.dumps(layout)})
    records[f"{prefix}.counts"] = MetricRecord(counts)
    return records


def has_message(content, prefix: str) -> bool:
    """Whether ``content`` (a RecordDict) holds a message under ``prefix``."""
    return f"{prefix}.layout" in content


def decode(content, prefix: str, device="cpu") -> Optional[Message]:
    """The message under ``prefix`` in ``content`` (a RecordDict), tensors on ``device``; None
    when there is none."""
    if not has_message(content, prefix):
        return None
    layout = json.loads(content[f"{prefix}.layout"]["layout"])
    counts = content[f"{prefix}.counts"]
    tensors = {spec["name"]: _payload(content[f"{prefix}.tensor.{spec['name']}"], spec, device)
               for spec in layout["tensors"]}

    def value(spec) -> Any:
        if "tensor" in spec:
            return _payload(content[f"{prefix}.extra.{spec['tensor']}"], spec, device)
        if "number" in spec:
            number = counts[f"number.{spec['number']}"]
            return {"bool": bool, "int": int, "float": float}[spec["type"]](number)
        if "dict" in spec:
            return {key: value(item) for key, item in spec["dict"]}
        if "list" in spec:
            return [value(item) for item in spec["list"]]
        return tuple(value(item) for item in spec["tuple"])

    return Message(tensors, value(layout["extras"]), int(counts["num-examples"]))


def state_record(tensors: Mapping[str, torch.Tensor]):
    """An ArrayRecord of named tensors (a client's bank rows, kept in its node's context)."""
    from flwr.common import ArrayRecord

    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = _array(tensor)
    return record


def state_tensors(record, dtypes: Mapping[str, torch.dtype], device) -> dict[str, torch.Tensor]:
    """The tensors of :func:`state_record`, each read back as ``dtypes[name]``."""
    return {name: _tensor(record[name], _dtype_name(dtypes[name]), device) for name in record}
