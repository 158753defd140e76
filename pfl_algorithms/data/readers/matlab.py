"""The variables a MATLAB v5 file declares (name, class, dimensions), read from their headers
alone, so that a reader can refuse a file before ``scipy.io.loadmat`` allocates and fills
what the file declares.

A v5 file is a 128-byte header, then one data element per variable: a ``miMATRIX`` element, or
a ``miCOMPRESSED`` one whose zlib stream holds the ``miMATRIX``.  The matrix starts with its
array flags (the class), its dimensions and its name.  Those first bytes are all that is read:
a compressed variable is inflated by at most ``HEADER_BYTES`` however much it declares (scipy
inflated 257 MB of a 1.5 MB file only to read one variable's header).  Format: MathWorks,
"MAT-File Format", R2024a, chapter 1.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Optional

MI_INT8, MI_INT32, MI_UINT32, MI_MATRIX, MI_COMPRESSED = 1, 5, 6, 14, 15
# mxCLASS ids (array flags' low byte) -> numpy's names for the numeric ones
CLASSES = {1: "cell", 2: "struct", 3: "object", 4: "char", 5: "sparse", 6: "float64", 7: "float32", 8: "int8",
           9: "uint8", 10: "int16", 11: "uint16", 12: "int32", 13: "uint32", 14: "int64", 15: "uint64"}
HEADER_BYTES = 4096  # more than flags, dims and a name need (a name is at most 63 characters)
_READ = 1 << 16      # compressed bytes read at a time while inflating a header


def declared_variables(path: Path) -> Optional[dict[str, tuple[str, tuple[int, ...]]]]:
    """name -> (class, dims) of every variable of the MATLAB v5 file ``path``, in file order;
    None when the file is not v5 (v4, or v7.3's HDF5: ``loadmat`` decides what those are).

    Raises:
        ValueError: naming the file, when a v5 variable's header is truncated or malformed.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(128)
        if len(header) < 128 or header[126:128] not in (b"IM", b"MI") or header[:4] == b"\x89HDF":
            return None
        order = "<" if header[126:128] == b"IM" else ">"
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        position = 128
        while position + 8 <= size:
            f.seek(position)
            kind, nbytes = struct.unpack(order + "II", f.read(8))
            if kind >> 16:  # a small data element at the top level: 4 bytes of data, no variable
                position += 8
                continue
            if position + 8 + nbytes > size:
                raise ValueError(f"{path}: truncated MATLAB file (a variable at byte {position} declares "
                                 f"{nbytes} bytes, {size - position - 8} are left)")
            if kind == MI_MATRIX:
                matrix = f.read(min(nbytes, HEADER_BYTES))
            elif kind == MI_COMPRESSED:
                matrix = _inflate_start(f, nbytes, order, path, position)
            else:
                matrix = None  # some other element (none in MATLAB's own files): skipped
            if matrix is not None and nbytes:
                name, variable = _matrix_header(matrix, order, path, position)
                out[name] = variable
            position += 8 + nbytes
        return out


def _inflate_start(f, nbytes: int, order: str, path: Path, position: int) -> bytes:
    """The data of the miMATRIX element a compressed element holds: its first ``HEADER_BYTES``
    at most (the inflater stops there, whatever the stream would give)."""
    inflater, want, left = zlib.decompressobj(), 8 + HEADER_BYTES, nbytes
    out = b""
    try:
        while len(out) < want and left > 0 and not inflater.eof:
            chunk = f.read(min(_READ, left))
            left -= len(chunk)
            # max_length: what is inflated beyond it stays compressed in unconsumed_tail, unread
            out += inflater.decompress(chunk, want - len(out))
    except zlib.error as error:
        raise ValueError(f"{path}: the variable at byte {position} is not valid compressed data ({error})") from error
    if len(out) < 8 or struct.unpack(order + "I", out[:4])[0] != MI_MATRIX:
        raise ValueError(f"{path}: the compressed variable at byte {position} holds no MATLAB array")
    return out[8:]


def _matrix_header(data: bytes, order: str, path: Path, position: int) -> tuple[str, tuple[str, tuple[int, ...]]]:
    """(name, (class, dims)) from the start of a miMATRIX element's data (its tag excluded)."""
    def element(offset: int) -> tuple[int, bytes, int]:
        if offset + 8 > len(data):
            raise ValueError(f"{path}: the variable at byte {position} has a truncated header")
        kind, nbytes = struct.unpack(order + "II", data[offset:offset + 8])
        if kind >> 16:  # small data element: size in the upper half, data in the next 4 bytes
            return kind & 0xFFFF, data[offset + 4:offset + 4 + (kind >> 16)], offset + 8
        end = offset + 8 + nbytes
        if end > len(data):
            raise ValueError(f"{path}: the variable at byte {position} has a truncated header")
        return kind, data[offset + 8:end], offset + 8 + (nbytes + 7) // 8 * 8

    kind, flags, offset = element(0)
    kind_dims, dims, offset = element(offset)
    kind_name, name, offset = element(offset)
    if kind != MI_UINT32 or len(flags) < 4 or kind_dims != MI_INT32 or len(dims) % 4 or kind_name != MI_INT8:
        raise ValueError(f"{path}: the variable at byte {position} is not a MATLAB array (bad header)")
    shape = struct.unpack(order + f"{len(dims) // 4}i", dims)
    if any(d < 0 for d in shape):
        raise ValueError(f"{path}: the variable at byte {position} declares negative dimensions {list(shape)}")
    mclass = struct.unpack(order + "I", flags[:4])[0] & 0xFF
    return name.decode("latin-1"), (CLASSES.get(mclass, f"class {mclass}"), tuple(shape))
