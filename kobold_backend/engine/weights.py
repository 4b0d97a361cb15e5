"""Reads tensors from single or sharded safetensors files one at a time, so a model is never held in RAM twice."""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from kobold_backend.errors import ModelFormatError


def safetensors_files(folder: Path) -> List[Path]:
    """The checkpoint's safetensors files: the index's shards if there is one, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelFormatError(f"{index} is not a valid safetensors index (no weight_map).") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{index} names shard {missing[0]} which is not in {folder}.")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
        if bins:
            raise ModelFormatError(
                f"{folder} has only pickle weights ({bins[0].name}); convert them to safetensors first "
                "(pickle files can run code and are not loaded)."
            )
        raise ModelFormatError(f"{folder} has no *.safetensors weight files.")
    return files


# safetensors' own limit on the JSON header (the Rust crate refuses larger ones).
MAX_HEADER_BYTES = 100_000_000
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: Path) -> Dict[str, Dict[str, object]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header (8-byte length + JSON),
    no tensor data read; every entry's types and its byte range inside the file checked, else one sentence naming
    the file and the field."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelFormatError(f"{path.name}: is not a safetensors file (shorter than its 8-byte header length).")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ModelFormatError(f"{path.name}: the header length {length} is larger than the file or "
                                   f"{MAX_HEADER_BYTES} bytes.")
        try:
            header = json.loads(fh.read(length))
        except (ValueError, RecursionError):
            raise ModelFormatError(f"{path.name}: the header is not JSON text.") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: the header is not a JSON object.")
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


class WeightReader:
    """Name -> tensor access across shards; tensors are read on request and never cached."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = safetensors_files(self.folder)
        self._stack = ExitStack()
        self._handles: Dict[str, object] = {}
        self._where: Dict[str, object] = {}
        self._stored: Dict[str, str] = {}
        for path in self.files:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                self._stack.close()
                raise ModelFormatError(f"{path.name} is not a readable safetensors file ({exc}).") from None
            for name in handle.keys():
                self._where[name] = handle
        self.total_bytes = sum(p.stat().st_size for p in self.files)

    def close(self) -> None:
        self._stack.close()
        self._where.clear()

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
