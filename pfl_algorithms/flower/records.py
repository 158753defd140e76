"""pfl :class:`Message` <-> Flower records, entries of one ``RecordDict`` under a prefix.

A message ``m`` sent under prefix ``p`` becomes:

* ``p.layout``   ConfigRecord: what each record holds (JSON: every tensor's kind, dtype, shape,
                 threshold and index bits; the structure of the extras; ``apply: false``
                 for a download the client reads but does not load);
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

Decoding trusts nothing it reads (the server decodes what any ClientApp sent): the layout must
be JSON of the shape above, dtypes only those of :data:`DTYPES`, every array a plain ``.npy``
whose header agrees with the layout before a byte is copied, a dense array exactly the
elements its shape needs, a Sparse payload's indices strictly increasing in [0, numel).  Given
an :class:`Expected`, the layout is also compared with what the receiver knows before anything
is allocated: each tensor's name, shape and dtype, the most elements any payload may declare,
the number of examples, and every value finite and small enough that the round's sums cannot
overflow.  Anything else raises :class:`RecordError`, one line naming the record key.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..engine.messages import Message, Sparse, Statistic

# numpy has no bfloat16: such tensors travel as their int16 bit patterns.
_BIT_PATTERNS = {torch.bfloat16: torch.int16}

# The dtypes a layout may name: real torch dtypes only, never whatever attribute of torch a
# name reaches (``getattr(torch, "load")`` is a function).
DTYPES = {name: getattr(torch, name) for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                                                  "bfloat16", "float32", "float64")}
_MAX_RANK = 8
_MAX_DEPTH = 32  # nesting of the extras


class RecordError(ValueError):
    """A received record that is not what its layout or its receiver expects (one line, naming
    the record key and what was expected)."""


@dataclass(frozen=True)
class Expected:
    """What a receiver knows a message must be, checked by :func:`decode` before it allocates.

    Attributes:
        tensors: name -> (shape, dtype) of every tensor the message may carry (it may omit
            some; no other name is accepted).
        most: the most elements the message's payloads (tensors and extras) may declare in all.
        num_examples: the ``num-examples`` it must carry; None for any count >= 0.
        senders: K, how many messages will be summed: every floating value must be finite with
            |x| <= (its dtype's largest value) / K, and every float number in the extras
            |x| <= (float64's largest) / K, so that no sum or weighted mean (weights in [0, 1])
            of K such messages overflows.
    """

    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    most: int
    num_examples: Optional[int] = None
    senders: int = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def one_line(error) -> str:
    """An error's text on one line, at most 200 characters."""
    return " ".join(str(error).split())[:200]


def _array(tensor: torch.Tensor):
    from flwr.common import Array

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype in _BIT_PATTERNS:
        tensor = tensor.view(_BIT_PATTERNS[tensor.dtype])
    return Array(tensor.numpy())


def _read(array, key: str, dtype: torch.dtype, *, count: Optional[int] = None,
          most: Optional[int] = None) -> torch.Tensor:
    """The tensor a received Array holds, in its own shape: a C-order ``.npy`` of ``dtype``
    (bfloat16: int16 bit patterns) with exactly ``count`` elements, or a vector of at most
    ``most``.  The header is checked against these before a byte is copied, and the data must
    be exactly what the header declares, so reading allocates no more than was received.

    Raises:
        RecordError: anything else (an object array, another dtype or size, a short buffer).
    """
    from flwr.common import Array

    if not isinstance(array, Array) or array.stype != "numpy.ndarray" or not isinstance(array.data, bytes):
        raise RecordError(f"{key}: not a numpy array")
    stream = io.BytesIO(array.data)
    try:
        version = np.lib.format.read_magic(stream)
        reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, found = reader(stream)
    except Exception as error:  # whatever the bytes are, they are not an array header
        raise RecordError(f"{key}: not a .npy array ({one_line(error)})") from None
    wanted = torch.empty(0, dtype=_BIT_PATTERNS.get(dtype, dtype)).numpy().dtype
    if found != wanted:
        raise RecordError(f"{key}: holds {found} where the layout says {_dtype_name(dtype)}")
    size = math.prod(shape)
    if count is not None and size != count:
        raise RecordError(f"{key}: holds {size} elements where the layout's shape needs {count}")
    if most is not None and (len(shape) != 1 or size > most):
        raise RecordError(f"{key}: holds shape {list(shape)}, expected a vector of at most {most} elements")
    if fortran and len(shape) > 1:
        raise RecordError(f"{key}: Fortran order, expected C order")
    if len(array.data) - stream.tell() != size * found.itemsize:
        raise RecordError(f"{key}: {len(array.data) - stream.tell()} bytes of data where its header needs "
                          f"{size * found.itemsize}")
    tensor = torch.from_numpy(np.frombuffer(array.data, dtype=found, count=size, offset=stream.tell()).copy())
    tensor = tensor.reshape(shape)
    return tensor.view(dtype) if dtype in _BIT_PATTERNS else tensor


def _payload_record(value, spec: dict):
    """One ArrayRecord for a tensor or Sparse payload; fills ``spec`` with what decoding needs."""
    from flwr.common import ArrayRecord

    tensor = value.tensor if isinstance(value, Sparse) else value
    if _dtype_name(tensor.dtype) not in DTYPES:  # refused here, not by the receiver's decode
        raise TypeError(f"a {_dtype_name(tensor.dtype)} tensor cannot be sent: a message carries "
                        f"{', '.join(DTYPES)}")
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


def _checked_spec(spec, key: str, expected: Optional[Expected], name: Optional[str] = None) -> int:
    """Check one payload's layout entry (and, for tensor ``name``, the expected shape and
    dtype) before anything is read; its element count."""
    if not isinstance(spec, dict) or spec.get("kind") not in ("dense", "sparse"):
        raise RecordError(f"{key}: layout entry {str(spec)[:80]} has no kind 'dense' or 'sparse'")
    dtype = spec.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise RecordError(f"{key}: dtype {str(dtype)[:40]!r} is none of {', '.join(DTYPES)}")
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) > _MAX_RANK
            or not all(type(size) is int and size >= 0 for size in shape)):
        raise RecordError(f"{key}: shape {str(shape)[:80]} is not a list of at most {_MAX_RANK} sizes >= 0")
    if spec["kind"] == "sparse":
        threshold, index_bits = spec.get("threshold"), spec.get("index_bits")
        if type(threshold) not in (int, float) or not threshold >= 0:
            raise RecordError(f"{key}: threshold {threshold!r} is not a number >= 0")
        if type(index_bits) is not int or index_bits < 0:
            raise RecordError(f"{key}: index_bits {index_bits!r} is not an int >= 0")
    if expected is not None and name is not None:
        if name not in expected.tensors:
            raise RecordError(f"{key}: no tensor {name!r} expected (one of {', '.join(map(str, expected.tensors))})")
        want_shape, want_dtype = expected.tensors[name]
        if tuple(shape) != tuple(want_shape) or DTYPES[dtype] != want_dtype:
            raise RecordError(f"{key}: the layout says {dtype} {shape}, expected {_dtype_name(want_dtype)} "
                              f"{list(want_shape)}")
    return math.prod(shape)


def _check_values(values: torch.Tensor, key: str, senders: int) -> None:
    """Every floating value finite and at most its dtype's largest / ``senders`` in magnitude."""
    if not values.is_floating_point() or values.numel() == 0:
        return
    if not bool(torch.isfinite(values).all()):
        raise RecordError(f"{key}: {int((~torch.isfinite(values)).sum())} non-finite values (NaN or infinite)")
    limit = torch.finfo(values.dtype).max / senders
    largest = float(values.abs().max())
    if largest > limit:
        raise RecordError(f"{key}: values up to {largest:.3g}, beyond {limit:.3g} ({_dtype_name(values.dtype)}'s "
                          f"largest / {senders} messages summed)")


def _payload(content, key: str, spec: dict, expected: Optional[Expected], device):
    """The tensor or Sparse payload of record ``key`` (its ``spec`` already checked)."""
    from flwr.common import ArrayRecord

    record = content[key] if key in content else None
    if not isinstance(record, ArrayRecord) or "values" not in record:
        raise RecordError(f"{key}: missing, or not an ArrayRecord with 'values'")
    dtype, shape = DTYPES[spec["dtype"]], spec["shape"]
    size = math.prod(shape)
    if spec["kind"] == "dense":
        values = _read(record["values"], f"{key}.values", dtype, count=size)
    else:
        if "indices" not in record:
            raise RecordError(f"{key}: a sparse payload without 'indices'")
        indices = _read(record["indices"], f"{key}.indices", torch.int64, most=size)
        values = _read(record["values"], f"{key}.values", dtype, count=indices.numel()).reshape(-1)
        increasing = bool((indices[1:] > indices[:-1]).all())
        if indices.numel() and not (indices[0] >= 0 and indices[-1] < size and increasing):
            raise RecordError(f"{key}.indices: positions must be strictly increasing in [0, {size})")
    if expected is not None:
        _check_values(values, f"{key}.values", expected.senders)
    if spec["kind"] == "dense":
        return values.reshape(shape).to(device)
    dense = torch.zeros(size, dtype=dtype)
    dense[indices] = values
    return Sparse(dense.reshape(shape).to(device), spec["threshold"], spec["index_bits"])


def encode(message: Message, prefix: str) -> dict:
    """The records of ``message`` under ``prefix`` (module docstring), by record name.

    Raises:
        TypeError: the extras hold a :class:`Statistic` request (answer it first) or a value
            no message can carry, or a tensor is of a dtype outside :data:`DTYPES` (complex).
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
    if not message.apply:
        layout["apply"] = False
    records[f"{prefix}.layout"] = ConfigRecord({"layout": json.dumps(layout)})
    records[f"{prefix}.counts"] = MetricRecord(counts)
    return records


def has_message(content, prefix: str) -> bool:
    """Whether ``content`` (a RecordDict) holds a message under ``prefix``."""
    return f"{prefix}.layout" in content


def _layout(content, prefix: str) -> dict:
    """The parsed layout record under ``prefix``: {"tensors": [...], "extras": {...}}."""
    from flwr.common import ConfigRecord

    key = f"{prefix}.layout"
    record = content[key]
    text = record.get("layout") if isinstance(record, ConfigRecord) else None
    if not isinstance(text, str):
        raise RecordError(f"{key}: not a ConfigRecord holding the layout as a JSON string")
    try:
        layout = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RecordError(f"{key}: not JSON ({one_line(error)})") from None
    if not (isinstance(layout, dict) and isinstance(layout.get("tensors"), list) and "extras" in layout):
        raise RecordError(f"{key}: expected an object with a 'tensors' list and 'extras'")
    names = [spec.get("name") if isinstance(spec, dict) else None for spec in layout["tensors"]]
    if not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
        raise RecordError(f"{key}: tensor names {str(names)[:80]} are not distinct strings")
    return layout


def _number(counts, key: str, name: str, kind: str):
    number = counts.get(name)
    if kind == "bool" and type(number) is int and number in (0, 1):
        return bool(number)
    if kind == "int" and type(number) is int:
        return number
    if kind == "float" and type(number) in (int, float):
        return float(number)
    raise RecordError(f"{key}: {name} is {str(number)[:40]}, expected {'an' if kind == 'int' else 'a'} {kind}")


def decode(content, prefix: str, device="cpu", expected: Optional[Expected] = None) -> Optional[Message]:
    """The message under ``prefix`` in ``content`` (a RecordDict), tensors on ``device``; None
    when there is none.  With ``expected``, the message must also be what it describes
    (:class:`Expected`), checked on the layout before any payload is read.

    Raises:
        RecordError: a record is missing, malformed or not as expected (module docstring).
    """
    from flwr.common import MetricRecord

    if not has_message(content, prefix):
        return None
    layout = _layout(content, prefix)
    apply = layout.get("apply", True)  # absent: the download is applied
    if not isinstance(apply, bool):
        raise RecordError(f"{prefix}.layout: apply {str(apply)[:40]}, expected true or false")
    counts_key = f"{prefix}.counts"
    counts = content[counts_key] if counts_key in content else None
    if not isinstance(counts, MetricRecord):
        raise RecordError(f"{counts_key}: missing, or not a MetricRecord")
    num_examples = counts.get("num-examples")
    if type(num_examples) is not int or num_examples < 0:
        raise RecordError(f"{counts_key}: num-examples {str(num_examples)[:40]}, expected an int >= 0")
    if expected is not None and expected.num_examples is not None and num_examples != expected.num_examples:
        raise RecordError(f"{counts_key}: num-examples {num_examples}, expected the partition's "
                          f"{expected.num_examples} training samples")

    sizes: dict[str, int] = {}  # record key -> elements declared, every spec checked before any payload is read
    for spec in layout["tensors"]:
        key = f"{prefix}.tensor.{spec['name']}"
        sizes[key] = _checked_spec(spec, key, expected, spec["name"])

    def walk(spec, depth: int) -> None:
        """Check the extras' structure and their tensors' specs (into ``sizes``)."""
        if depth > _MAX_DEPTH or not isinstance(spec, dict):
            raise RecordError(f"{prefix}.layout: extras nested deeper than {_MAX_DEPTH} or not objects")
        if "tensor" in spec:
            key = f"{prefix}.extra.{spec['tensor']}"
            if type(spec["tensor"]) is not int or key in sizes:
                raise RecordError(f"{prefix}.layout: extra tensor {str(spec['tensor'])[:40]} is no new index")
            sizes[key] = _checked_spec(spec, key, expected)
        elif "number" in spec:
            if type(spec["number"]) is not int or spec.get("type") not in ("bool", "int", "float"):
                raise RecordError(f"{prefix}.layout: number {str(spec)[:60]} lacks an index and a type")
        elif "dict" in spec and isinstance(spec["dict"], list):
            for item in spec["dict"]:
                if not (isinstance(item, list) and len(item) == 2 and type(item[0]) in (str, int)):
                    raise RecordError(f"{prefix}.layout: dict item {str(item)[:60]} is not [str or int key, value]")
                walk(item[1], depth + 1)
        elif "dict" not in spec and isinstance(spec.get("list", spec.get("tuple")), list):
            for item in spec["list"] if "list" in spec else spec["tuple"]:
                walk(item, depth + 1)
        else:
            raise RecordError(f"{prefix}.layout: extras entry {str(spec)[:60]} is no tensor, number, dict, list "
                              "or tuple")

    walk(layout["extras"], 0)
    if "dict" not in layout["extras"]:
        raise RecordError(f"{prefix}.layout: the extras are not a dict")
    declared = sum(sizes.values())
    if expected is not None and declared > expected.most:
        raise RecordError(f"{prefix}.layout: declares {declared} elements in all, more than the {expected.most} "
                          "this message may hold")

    tensors = {spec["name"]: _payload(content, f"{prefix}.tensor.{spec['name']}", spec, expected, device)
               for spec in layout["tensors"]}

    def value(spec) -> Any:
        if "tensor" in spec:
            return _payload(content, f"{prefix}.extra.{spec['tensor']}", spec, expected, device)
        if "number" in spec:
            number = _number(counts, counts_key, f"number.{spec['number']}", spec["type"])
            if expected is not None and isinstance(number, float):
                _check_values(torch.tensor([number], dtype=torch.float64), f"{counts_key} number.{spec['number']}",
                              expected.senders)
            return number
        if "dict" in spec:
            return {key: value(item) for key, item in spec["dict"]}
        if "list" in spec:
            return [value(item) for item in spec["list"]]
        return tuple(value(item) for item in spec["tuple"])

    return Message(tensors, value(layout["extras"]), num_examples, apply)


def state_record(tensors: Mapping[str, torch.Tensor]):
    """An ArrayRecord of named tensors (a client's bank rows, kept in its node's context)."""
    from flwr.common import ArrayRecord

    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = _array(tensor)
    return record


def state_tensors(record, dtypes: Mapping[str, torch.dtype], device) -> dict[str, torch.Tensor]:
    """The tensors of :func:`state_record`, each read back as ``dtypes[name]``.

    Raises:
        RecordError: a tensor is not of its dtype, or not a numpy array."""
    return {name: _read(record[name], name, dtypes[name]).to(device) for name in record}
