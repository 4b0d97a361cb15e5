"""Reads tensors from single or sharded safetensors files one at a time, so a model is never held in RAM twice."""

from __future__ import annotations

import json
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
