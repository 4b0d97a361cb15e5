"""Tensors of a GGUF file under their Hugging Face names, with the interface of engine/weights.WeightReader.

Norms, biases and the embedding table are read as float tensors (quantized ones dequantized exactly, in float32;
Gemma's norms given back as the checkpoint held them, the converter's +1 taken off); linear layers stored in a block
format stay in it as `GGMLWeight`s (see ops/ggml.py), only their rows reordered where llama.cpp permuted Q and K.
An expert of a stacked `ffn_*_exps` tensor is its slice of rows, read as stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend import ops
from kobold_backend.engine.gguf.config import GGUFArchitecture
from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.gguf.names import TensorNames, unpermute_rows
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGMLWeight, dequantize_rows

_DENSE_TYPES = ("F32", "F16", "BF16")


class GGUFWeights:
    """Name -> tensor access for one GGUF file; tensors are read on request and never cached."""

    def __init__(self, gguf: GGUFFile, arch: GGUFArchitecture, num_heads: int, num_kv_heads: int,
                 num_layers: Optional[int] = None) -> None:
        self.gguf = gguf
        self.folder: Path = gguf.path
        self.total_bytes = gguf.path.stat().st_size
        self._arch = arch
        self._names = TensorNames(arch.model_type)
        self._present = set(gguf.names())
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self._layers = num_layers  # layers past it (multi-token prediction) are not read

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        where = self._names.gguf(name, self._present)
        if where is None or where[0] not in self._present:
            return False
        return where[1] is None or where[1] < self.gguf.shape(where[0])[0]

    def names(self) -> List[str]:
        """The Hugging Face names of the tensors the engine reads from this file."""
        out: List[str] = []
        for g in self.gguf.names():
            experts = self.gguf.shape(g)[0] if "_exps." in g else 0
            out.extend(n for n in self._names.hf(g, experts) if self._in_stack(n))
        return out

    def _in_stack(self, name: str) -> bool:
        parts = name.split(".")
        return self._layers is None or parts[:2] != ["model", "layers"] or int(parts[2]) < self._layers

    def shape(self, name: str) -> Tuple[int, ...]:
        gname, expert = self._gguf(name)
        dims = self.gguf.shape(gname)
        if name.endswith("linear_attn.conv1d.weight") and len(dims) == 2:  # the converter squeezed [C, 1, K]
            return (dims[0], 1, dims[1])
        return dims if expert is None else dims[1:]

    def get_shape_checked(self, name: str, shape: Sequence[int]) -> None:
        """A ModelFormatError naming the tensor when its shape is not `shape` (nothing is read)."""
        self._check(name, shape)

    def get(self, name: str, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """A float tensor (float32 for quantized types and shifted norms; F16/BF16 as stored)."""
        gname, expert = self._check(name, shape)
        kind = self.gguf.type_name(gname)
        dims = self.shape(name)
        rows = self._rows(name, gname, expert)
        if kind == "F32":
            out = rows.view(torch.float32)
        elif kind == "F16":
            out = rows.view(torch.float16)
        elif kind == "BF16":
            out = rows.view(torch.bfloat16)
        else:
            out = dequantize_rows(rows, kind, dims[-1])
        # linear attention's gated norm multiplies by its weight itself: stored as it is
        if self._arch.norm_shift and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            out = out.float() + self._arch.norm_shift
        if name.endswith("linear_attn.A_log"):  # stored as ssm_a = -exp(A_log)
            out = torch.log(-out.float())
        return out.reshape(dims)

    def linear(self, prefix: str, k: int, n: int, device: torch.device,
               dtype: torch.dtype) -> Union[torch.Tensor, GGMLWeight]:
        """The projection `prefix` ([n, k]): a GGMLWeight for block formats (holding its bias), else a dense tensor
        in `dtype` (its bias, when the architecture declares one, read by the loader like a folder's)."""
        name = f"{prefix}.weight"
        gname, expert = self._check(name, (n, k))
        kind = self.gguf.type_name(gname)
        if kind in _DENSE_TYPES:  # a dense weight's bias is read by the loader, as from a folder
            return self.get(name).to(device=device, dtype=dtype).contiguous()
        bias = None
        if f"{prefix}.bias" in self:
            bias = self.get(f"{prefix}.bias", (n,)).to(device=device, dtype=dtype)
        data = self._rows(name, gname, expert).to(device).contiguous()
        return ops.ggml_place(GGMLWeight(data, kind, in_features=k, out_features=n, bias=bias))

    def _gguf(self, name: str) -> Tuple[str, Optional[int]]:
        where = self._names.gguf(name, self._present)
        if where is None or where[0] not in self._present:
            gname = where[0] if where else "no GGUF name"
            raise ModelFormatError(f"Tensor {name} ({gname}) is missing from {self.folder.name}.")
        if where[1] is not None and where[1] >= self.gguf.shape(where[0])[0]:
            raise ModelFormatError(f"Tensor {name}: {where[0]} in {self.folder.name} holds only "
                                   f"{self.gguf.shape(where[0])[0]} experts.")
        return where

    def _check(self, name: str, shape: Optional[Sequence[int]]) -> Tuple[str, Optional[int]]:
        gname, expert = self._gguf(name)
        found = self.shape(name)
        if shape is not None and tuple(found) != tuple(shape):
            raise ModelFormatError(
                f"Tensor {gname} in {self.folder.name} has shape {list(found)} but the config implies {list(shape)}."
            )
        return gname, expert

    def _rows(self, name: str, gname: str, expert: Optional[int]) -> torch.Tensor:
        """The stored bytes [rows, row_bytes] (one expert's rows of a stacked tensor), rows moved back to Hugging
        Face order for permuted Q/K."""
        raw = self.gguf.raw(gname)
        if expert is not None:
            per = raw.shape[0] // self.gguf.shape(gname)[0]
            raw = raw[expert * per:(expert + 1) * per]
        rows = torch.from_numpy(raw.copy())
        stem = name.rsplit(".", 1)[0].split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if self._arch.permuted_qk and stem in self._heads:
            heads = self._heads[stem]
            if rows.shape[0] % (2 * heads):
                raise ModelFormatError(f"Tensor {gname} in {self.folder.name} has {rows.shape[0]} rows, not an even "
                                       f"number per head for its {heads} heads.")
            rows = unpermute_rows(rows, heads)
        return rows
