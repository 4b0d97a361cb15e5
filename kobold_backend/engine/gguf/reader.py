"""The GGUF container read with every count, length and offset proved against the file's size before it is used:
the header, the metadata (as plain Python values) and the tensor records (name, dims, type, byte range).

A GGUF file comes from anyone, so nothing here allocates or loops by a number the file states until the bytes that
number claims are known to be there; tensor dims are multiplied as Python integers (no 64-bit wrap-around) and each
tensor's bytes must lie inside the file. Every refusal is a ModelFormatError naming the file and the field.
Format: magic "GGUF", version (2 or 3), tensor count, metadata count, the metadata (key, type, value), the tensor
records (name, dims innermost first, GGML type, offset), padding to `general.alignment`, the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np

from kobold_backend.engine.model_files import open_model_file
from kobold_backend.errors import ModelFormatError

STRING, ARRAY = 8, 9
# Scalar metadata types: struct format (little-endian), numpy dtype.
SCALARS: Dict[int, str] = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                           12: "d"}
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# The fewest bytes one metadata entry (key length, type, a one-byte value) and one tensor record take.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's record: dims innermost first (as GGUF stores them), GGML type id, bytes from the data start."""

    name: str
    dims: Tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int


@dataclass
class GGUFContents:
    metadata: Dict[str, Any]
    tensors: Dict[str, TensorRecord]
    data_start: int


def ggml_type_sizes() -> Dict[int, Tuple[str, int, int]]:
    """GGML type id -> (name, values per block, bytes per block) for every type the `gguf` package knows."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (GGMLQuantizationType(t).name, int(block), int(size)) for t, (block, size) in
            GGML_QUANT_SIZES.items()}


class _Cursor:
    """Reads forward through the file's bytes; a read that would pass the end is refused, naming what was read."""

    def __init__(self, data: Any, size: int, where: str) -> None:
        self.data, self.size, self.where, self.pos = data, size, where, 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, message: str) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: {message}.")

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise self.fail(f"{what} runs past the end of the file ({n} bytes at offset {self.pos}, "
                            f"{self.left} left)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        return self.take(n, what).decode("utf-8", errors="replace")


def _value(cur: _Cursor, kind: int, what: str) -> Any:
    if kind == STRING:
        return cur.string(what)
    if kind in SCALARS:
        return cur.scalar(SCALARS[kind], what)
    if kind != ARRAY:
        raise cur.fail(f"{what} has value type {kind}, which is not a GGUF type")
    item = cur.scalar("I", f"the item type of {what}")
    count = cur.scalar("Q", f"the length of {what}")
    if item == STRING:
        if count > cur.left // 8:  # each string takes at least its 8-byte length
            raise cur.fail(f"{what} claims {count} strings but only {cur.left} bytes remain")
        return [cur.string(f"{what}[{i}]") for i in range(count)]
    if item not in SCALARS:
        raise cur.fail(f"{what} is an array of type {item}; arrays of numbers or strings are expected")
    fmt = SCALARS[item]
    size = struct.calcsize(fmt)
    if count > cur.left // size:
        raise cur.fail(f"{what} claims {count} values of {size} bytes but only {cur.left} bytes remain")
    return np.frombuffer(cur.take(count * size, what), dtype="<" + fmt, count=count).tolist()


def _metadata(cur: _Cursor, count: int) -> Dict[str, Any]:
    if count > cur.left // _MIN_KV_BYTES:
        raise cur.fail(f"the header claims {count} metadata entries but only {cur.left} bytes remain")
    meta: Dict[str, Any] = {}
    for i in range(count):
        key = cur.string(f"metadata key {i}")
        kind = cur.scalar("I", f"the type of metadata {key}")
        if key in meta:
            raise cur.fail(f"metadata key {key} appears twice")
        if key == "general.alignment" and kind != 4:
            raise cur.fail(f"general.alignment has value type {kind}; uint32 (4) is expected")
        meta[key] = _value(cur, kind, f"metadata {key}")
    return meta


def _tensor(cur: _Cursor, types: Dict[int, Tuple[str, int, int]], alignment: int) -> TensorRecord:
    name = cur.string("a tensor name")
    n_dims = cur.scalar("I", f"the dimension count of tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name} has {n_dims} dimensions; 1 to {MAX_DIMS} are allowed")
    dims = tuple(cur.scalar("Q", f"dimension {d} of tensor {name}") for d in range(n_dims))
    type_id = cur.scalar("I", f"the type of tensor {name}")
    offset = cur.scalar("Q", f"the offset of tensor {name}")
    if type_id not in types:
        raise cur.fail(f"tensor {name} has GGML type {type_id}, which is not a GGML type")
    type_name, block, size = types[type_id]
    if any(d < 1 or d >= 1 << 63 for d in dims):
        raise cur.fail(f"tensor {name} has dimensions {list(dims)}; each must be 1 to 2**63 - 1")
    if dims[0] % block:
        raise cur.fail(f"tensor {name} has rows of {dims[0]} values, not a whole number of {type_name} blocks "
                       f"of {block}")
    if offset % alignment:
        raise cur.fail(f"tensor {name} has offset {offset}, not a multiple of the alignment {alignment}")
    elements = 1
    for d in dims:
        elements *= d  # a Python integer: a product past 64 bits stays exact and fails the size check below
    return TensorRecord(name, dims, type_id, offset, elements // block * size)


def parse(data: Any, size: int, where: str) -> GGUFContents:
    """The metadata and tensor records of GGUF bytes `data` (bytes or an mmap) of length `size`."""
    cur = _Cursor(data, size, where)
    if size < 4 or cur.take(4, "the magic number") != b"GGUF":
        raise cur.fail("is not a GGUF file (it does not start with the bytes GGUF)")
    version = cur.scalar("I", "the version")
    if version & 0xFFFF == 0 and version:
        raise cur.fail("is a big-endian GGUF file; this engine reads little-endian GGUF files")
    if version not in (2, 3):
        raise cur.fail(f"has GGUF version {version}; versions 2 and 3 are supported")
    n_tensors = cur.scalar("Q", "the tensor count")
    n_kv = cur.scalar("Q", "the metadata count")
    meta = _metadata(cur, n_kv)
    alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment < 1 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment}; a power of two is expected")
    if n_tensors > cur.left // _MIN_TENSOR_BYTES:
        raise cur.fail(f"the header claims {n_tensors} tensors but only {cur.left} bytes remain")
    types = ggml_type_sizes()
    tensors: Dict[str, TensorRecord] = {}
    for _ in range(n_tensors):
        record = _tensor(cur, types, alignment)
        if record.name in tensors:
            raise cur.fail(f"tensor {record.name} appears twice")
        tensors[record.name] = record
    data_start = -(-cur.pos // alignment) * alignment
    for t in tensors.values():
        if data_start + t.offset + t.nbytes > size:
            raise cur.fail(f"tensor {t.name} ({t.nbytes} bytes at data offset {t.offset}) runs past the end of "
                           f"the file ({size} bytes, data from byte {data_start})")
    return GGUFContents(meta, tensors, data_start)


def open_mapped(path: Path) -> Tuple[mmap.mmap, GGUFContents]:
    """The file memory-mapped read-only and parsed; the map is the caller's to keep (tensor data stays in it)."""
    try:
        with open_model_file(path) as fh:
            size = fh.seek(0, 2)
            if size == 0:
                raise ModelFormatError(f"{path.name}: is not a GGUF file (it is empty).")
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ModelFormatError(f"{path.name}: could not be read ({exc.strerror or exc}).") from None
    try:
        return mapped, parse(mapped, len(mapped), path.name)
    except BaseException:
        mapped.close()
        raise


def tensor_view(mapped: Any, contents: GGUFContents, record: TensorRecord) -> np.ndarray:
    """The tensor's bytes as a uint8 view of the map, [rows, row_bytes] (rows: the product of all dims but the
    first); its range was proved inside the file when the records were read."""
    rows = 1
    for d in record.dims[1:]:
        rows *= d
    view = np.frombuffer(mapped, dtype=np.uint8, count=record.nbytes, offset=contents.data_start + record.offset)
    return view.reshape(rows, record.nbytes // rows)
