"""Opens a GGUF file (memory-mapped, read by the bounds-checked parser in reader.py): metadata values with the
types the engine relies on checked (metadata.py), and tensor records."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from kobold_backend.engine.gguf.metadata import check_metadata
from kobold_backend.engine.gguf.reader import TensorRecord, ggml_type_sizes, open_mapped, tensor_view
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGML_TYPES

# The most values a float table read whole (`floats`: RoPE factors, head_dim / 2 of them) may hold.
MAX_TABLE = 1 << 16


class GGUFFile:
    """Metadata as plain Python values and tensors by GGUF name; data stays in the memory map until read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map, contents = open_mapped(path)
        self._contents = contents
        self.metadata: Dict[str, Any] = contents.metadata
        self._tensors: Dict[str, TensorRecord] = contents.tensors
        try:
            check_metadata(self.metadata, path.name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._tensors = {}
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view of the data: the map goes when that view does
            pass

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path.name} has no general.architecture; it is not a model GGUF file.")
        return arch

    def names(self) -> List[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def type_name(self, name: str) -> str:
        tid = self._tensors[name].type_id
        if tid not in GGML_TYPES:
            supported = ", ".join(n for n, _, _ in GGML_TYPES.values())
            raise ModelFormatError(
                f"Tensor {name} in {self.path.name} has GGML type {ggml_type_sizes()[tid][0]}, which "
                f"this engine does not read (supported: {supported})."
            )
        return GGML_TYPES[tid][0]

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape in PyTorch order (GGUF stores the innermost dimension first)."""
        return tuple(reversed(self._tensors[name].dims))

    def raw(self, name: str) -> np.ndarray:
        """The stored data: [rows, row_bytes] uint8 for every type (a view of the memory map)."""
        return tensor_view(self._map, self._contents, self._tensors[name])

    def floats(self, name: str) -> List[float]:
        """A small float tensor's values (RoPE factor tables), as float32 whatever the stored float type."""
        if name not in self._tensors:
            raise ModelFormatError(f"Tensor {name} is missing from {self.path.name}.")
        kind = self.type_name(name)
        if kind not in ("F32", "F16", "BF16"):
            raise ModelFormatError(f"Tensor {name} in {self.path.name} is {kind}; a float type is expected.")
        count = self.shape(name)[-1] if len(self.shape(name)) == 1 else MAX_TABLE + 1
        if count > MAX_TABLE:
            raise ModelFormatError(f"Tensor {name} in {self.path.name} has shape {list(self.shape(name))}; a table "
                                   f"of at most {MAX_TABLE} values is expected.")
        raw = self.raw(name).reshape(-1)
        if kind == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).tolist()
        return raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32).tolist()
