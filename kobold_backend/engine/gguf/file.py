"""Opens a GGUF file (memory-mapped through the `gguf` package's reader): metadata values and tensor records."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGML_TYPES


class GGUFFile:
    """Metadata as plain Python values and tensors by GGUF name; data stays in the memory map until read."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            self._reader = GGUFReader(str(path), "r")
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise ModelFormatError(f"{path.name} is not a readable GGUF file ({exc}).") from None
        self.metadata: Dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if not name.startswith("GGUF."):
                self.metadata[name] = _field_value(field)
        self._tensors = {t.name: t for t in self._reader.tensors}

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None  # type: ignore[assignment]  # drops the memory map

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
        tid = int(self._tensors[name].tensor_type)
        if tid not in GGML_TYPES:
            supported = ", ".join(n for n, _, _ in GGML_TYPES.values())
            raise ModelFormatError(
                f"Tensor {name} in {self.path.name} has GGML type {self._tensors[name].tensor_type.name}, which "
                f"this engine does not read (supported: {supported})."
            )
        return GGML_TYPES[tid][0]

    def shape(self, name: str) -> Tuple[int, ...]:
        """The tensor's shape in PyTorch order (GGUF stores the innermost dimension first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def raw(self, name: str) -> np.ndarray:
        """The stored data: [rows, row_bytes] uint8 for every type (a view of the memory map)."""
        rows = int(np.prod(self.shape(name)[:-1]))  # 1 for a 1-D tensor (the product of no dimensions)
        return self._tensors[name].data.view(np.uint8).reshape(rows, -1)

    def floats(self, name: str) -> List[float]:
        """A small float tensor's values (RoPE factor tables), as float32 whatever the stored float type."""
        if name not in self._tensors:
            raise ModelFormatError(f"Tensor {name} is missing from {self.path.name}.")
        kind = self.type_name(name)
        if kind not in ("F32", "F16", "BF16"):
            raise ModelFormatError(f"Tensor {name} in {self.path.name} is {kind}; a float type is expected.")
        raw = self.raw(name).reshape(-1)
        if kind == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).tolist()
        return raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32).tolist()



def _field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    def one(part: np.ndarray, kind: Any) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()
        return value[0] if len(value) == 1 else value

    kinds = list(field.types)
    if not kinds:
        return None
    if kinds[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], kinds[-1]) for i in field.data]
    return one(field.parts[field.data[0]], kinds[0])
