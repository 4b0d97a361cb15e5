"""Reads tensors from single or sharded safetensors files one at a time, so a model is never held in RAM twice."""

from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from kobold_backend.engine.model_files import is_model_file, model_files, open_model_file, read_model_text
from kobold_backend.errors import ModelFormatError


def safetensors_files(folder: Path) -> List[Path]:
    """The checkpoint's safetensors files: the index's shards if there is one, else every *.safetensors (each a
    regular file: model_files)."""
    index = folder / "model.safetensors.index.json"
    if is_model_file(index):
        return _indexed_shards(folder, index)
    files = model_files(folder, "*.safetensors")
    if not files:
        bins = model_files(folder, "*.bin") + model_files(folder, "*.pt")
        if bins:
            raise ModelFormatError(
                f"{folder} has only pickle weights ({bins[0].name}); convert them to safetensors first "
                "(pickle files can run code and are not loaded)."
            )
        raise ModelFormatError(f"{folder} has no *.safetensors weight files.")
    return files


def _indexed_shards(folder: Path, index: Path) -> List[Path]:
    """The shard files an index's weight_map names (tensor name -> file name), each confined to the model folder."""
    try:
        weight_map = json.loads(read_model_text(index))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
        raise ModelFormatError(f"{index.name} is not a valid safetensors index (no weight_map).") from None
    if not isinstance(weight_map, dict):
        raise ModelFormatError(f"{index.name}: weight_map is {type(weight_map).__name__}; an object mapping tensor "
                               "names to shard file names is expected.")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ModelFormatError(f"{index.name}: weight_map maps {tensor[:80]!r} to {name!r:.40}; a shard file "
                                   "name is expected.")
    files = sorted({_shard_path(folder, index, name) for name in set(weight_map.values())})
    for path in files:
        if not is_model_file(path):
            raise ModelFormatError(f"{index.name} names shard {path.name} which is not in {folder.name}.")
    return files


def _shard_path(folder: Path, index: Path, name: str) -> Path:
    """The shard `name` inside `folder`: a relative path without `..` whose real path (symbolic links followed)
    stays in the folder, or for a Hugging Face cache snapshot (`<repo>/snapshots/<revision>`) in the repository's
    `blobs`; anything else is the same sentence whether or not that file exists."""
    parts = name.replace("\\", "/").split("/")
    outside = ModelFormatError(f"{index.name} names shard {name[:120]!r} outside the model folder; shards must be "
                               "files inside it.")
    if "\0" in name or name.startswith("/") or ".." in parts or ":" in parts[0]:
        raise outside
    path = folder.joinpath(*parts)
    root = os.path.realpath(str(folder))
    allowed = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    real = os.path.realpath(str(path))
    if not any(os.path.commonpath([base, real]) == base and real != base for base in allowed):
        raise outside
    return path


# A safetensors file's JSON header and its tensor count: real ones stay below a few MB and 10,000 tensors per
# file; these bounds (8 MiB, 65,536 tensors) keep what a header costs to parse (about 17 times its size in Python,
# less in the safetensors crate) small before anything else is read.
MAX_HEADER_BYTES = 8 << 20
MAX_TENSORS = 1 << 16
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: Path) -> Dict[str, Dict[str, object]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header (8-byte length + JSON),
    no tensor data read; every entry's types and its byte range inside the file checked, else one sentence naming
    the file and the field."""
    with open_model_file(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        length = _header_length(path, fh, size)
        try:
            header = json.loads(fh.read(length))
        except (ValueError, RecursionError):
            raise ModelFormatError(f"{path.name}: the header is not JSON text.") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: the header is not a JSON object.")
    if len(header) > MAX_TENSORS + 1:  # and __metadata__
        raise ModelFormatError(f"{path.name}: the header lists {len(header)} tensors, more than the {MAX_TENSORS} "
                               "one safetensors file may hold here.")
    data = size - 8 - length
    out: Dict[str, Dict[str, object]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise ModelFormatError(f"{path.name}: tensor {name} has no valid dtype, shape and data_offsets inside "
                                   f"the file's {data} data bytes.")
        count = 1
        for d in shape:
            count *= d
        width = _DTYPE_BYTES.get(entry["dtype"])
        if width is not None and count * width != offsets[1] - offsets[0]:
            raise ModelFormatError(f"{path.name}: tensor {name} has shape {shape} of {entry['dtype']} "
                                   f"({count * width} bytes) but data_offsets span {offsets[1] - offsets[0]} bytes.")
        out[name] = entry
    return out


def _header_length(path: Path, fh: BinaryIO, size: int) -> int:
    """The JSON header length at the start of an open safetensors file, inside the file and MAX_HEADER_BYTES."""
    head = fh.read(8)
    if len(head) < 8:
        raise ModelFormatError(f"{path.name}: is not a safetensors file (shorter than its 8-byte header length).")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise ModelFormatError(f"{path.name}: the header length {length} is larger than the file ({size} bytes).")
    if length > MAX_HEADER_BYTES:
        raise ModelFormatError(f"{path.name}: the header is {length} bytes, more than the {MAX_HEADER_BYTES >> 20} "
                               "MiB a safetensors header may take here.")
    return length


def check_header_bounds(path: Path) -> None:
    """The file's header length checked (regular file, inside the file, at most MAX_HEADER_BYTES) before the
    safetensors crate parses it; the message starts "<name> is not a readable safetensors file"."""
    with open_model_file(path) as fh:
        try:
            _header_length(path, fh, os.fstat(fh.fileno()).st_size)
        except ModelFormatError as exc:
            reason = str(exc).split(": ", 1)[-1].rstrip(".")
            raise ModelFormatError(f"{path.name} is not a readable safetensors file ({reason}).") from None


class WeightReader:
    """Name -> tensor access across shards; tensors are read on request and never cached."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = safetensors_files(self.folder)
        self._stack = ExitStack()
        self._handles: Dict[str, object] = {}
        self._where: Dict[str, object] = {}
        self._stored: Dict[str, str] = {}
        try:
            for path in self.files:
                self._open(path)
        except BaseException:
            self.close()
            raise
        self.total_bytes = sum(p.stat().st_size for p in self.files)

    def _open(self, path: Path) -> None:
        check_header_bounds(path)
        try:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{path.name} is not a readable safetensors file ({exc}).") from None
        names = handle.keys()
        if len(names) > MAX_TENSORS:
            raise ModelFormatError(f"{path.name} lists {len(names)} tensors, more than the {MAX_TENSORS} one "
                                   "safetensors file may hold here.")
        for name in names:
            self._where[name] = handle

    def close(self) -> None:
        self._stack.close()
        self._where.clear()
        self._stored.clear()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> List[str]:
        return list(self._where)

    def rename(self, stored: Dict[str, str]) -> None:
        """Read the tensors of `stored` (engine name -> name in the files) under their engine names only (a
        multimodal checkpoint's text model under `language_model.`)."""
        for name, source in stored.items():
            self._where[name] = self._where.pop(source)
            self._stored[name] = source

    def shape(self, name: str) -> Tuple[int, ...]:
        handle = self._handle(name)
        return tuple(handle.get_slice(self._stored.get(name, name)).get_shape())  # type: ignore[attr-defined]

    def get_shape_checked(self, name: str, shape: Sequence[int]) -> None:
        """A ModelFormatError naming the tensor when its header's shape is not `shape` (nothing is read)."""
        found = self.shape(name)
        if tuple(found) != tuple(shape):
            raise ModelFormatError(f"Tensor {name} has shape {list(found)} but the config implies {list(shape)}.")

    def get(self, name: str, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Read one tensor; when `shape` is given, a mismatch is a ModelFormatError naming the tensor."""
        handle = self._handle(name)
        if shape is not None:
            self.get_shape_checked(name, shape)
        try:
            return handle.get_tensor(self._stored.get(name, name))  # type: ignore[attr-defined]
        except Exception as exc:
            raise ModelFormatError(f"Tensor {name} could not be read ({exc}).") from None

    def _handle(self, name: str) -> object:
        try:
            return self._where[name]
        except KeyError:
            raise ModelFormatError(
                f"Tensor {name} is missing from the checkpoint in {self.folder}."
            ) from None
