"""Control-vector files: the GGUF format repeng and llama.cpp's cvector-generator write
(general.architecture = "controlvector", one 1-D F32 tensor `direction.<i>` per 0-based decoder block) and a
safetensors file with the same tensor names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

_DIRECTION = re.compile(r"^direction\.(\d+)$")


class ControlVectorError(ValueError):
    """A file that is not a usable control vector; the message says what was found."""


@dataclass
class ControlVector:
    """directions[i] (float32, CPU) is added to the residual stream after decoder block i."""

    directions: Dict[int, torch.Tensor]
    model_hint: Optional[str] = None


def load_control_vector(path: Path) -> ControlVector:
    """Read a .gguf or .safetensors control vector (the format is told by the file's first bytes)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _load_gguf(path)
    return _load_safetensors(path)


def _field_value(field: Any) -> Any:
    """The scalar or string held by a GGUFReader field (works with gguf 0.6 onwards)."""
    part = field.parts[field.data[0]]
    if field.types and int(field.types[0]) == 8:  # GGUFValueType.STRING
        return bytes(part).decode("utf-8", errors="replace")
    return part.tolist()[0]


def _load_gguf(path: Path) -> ControlVector:
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ControlVectorError("reading GGUF control vectors needs the 'gguf' package") from e
    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise ControlVectorError(f"not a readable GGUF file ({e})") from e
    arch_field = reader.fields.get("general.architecture")
    arch = _field_value(arch_field) if arch_field is not None else None
    if arch != "controlvector":
        raise ControlVectorError(f"general.architecture is {arch!r}, not 'controlvector'")
    hint_field = reader.fields.get("controlvector.model_hint")
    hint = _field_value(hint_field) if hint_field is not None else None
    directions: Dict[int, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = _DIRECTION.match(tensor.name)
        if match is None:
            continue
        type_name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        if type_name not in ("F32", "F16"):
            raise ControlVectorError(f"tensor {tensor.name} is {type_name}; control vectors are F32 (or F16)")
        shape = [int(d) for d in tensor.shape]
        if len([d for d in shape if d > 1]) > 1:
            raise ControlVectorError(f"tensor {tensor.name} is not 1-D (shape {shape})")
        flat = np.asarray(tensor.data).reshape(-1)
        directions[int(match.group(1))] = torch.from_numpy(flat.astype(np.float32, copy=True))
    return _checked(directions, hint)


def _load_safetensors(path: Path) -> ControlVector:
    from safetensors import safe_open

    directions: Dict[int, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            hint = (f.metadata() or {}).get("controlvector.model_hint")
            for name in f.keys():
                match = _DIRECTION.match(name)
                if match is None:
                    continue
                t = f.get_tensor(name)
                if t.dim() != 1:
                    raise ControlVectorError(f"tensor {name} has shape {list(t.shape)}; directions are 1-D")
                if not t.is_floating_point():
                    raise ControlVectorError(f"tensor {name} is {t.dtype}; directions are floating point")
                directions[int(match.group(1))] = t.float().contiguous()
    except ControlVectorError:
        raise
    except Exception as e:
        raise ControlVectorError(f"neither a GGUF nor a readable safetensors file ({e})") from e
    return _checked(directions, hint)


def _checked(directions: Dict[int, torch.Tensor], hint: Optional[str]) -> ControlVector:
    if not directions:
        raise ControlVectorError("the file holds no direction.<layer> tensors")
    for index, t in directions.items():
        if not bool(torch.isfinite(t).all()):
            raise ControlVectorError(f"direction.{index} holds non-finite values")
    return ControlVector(dict(sorted(directions.items())), hint)
