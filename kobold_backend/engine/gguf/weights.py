"""Tensors of a GGUF file under their Hugging Face names, with the interface of engine/weights.WeightReader.

Norms, biases and the embedding table are read as float tensors (quantized ones dequantized exactly, in float32);
linear layers stored in a block format stay in it as `GGMLWeight`s (see ops/ggml.py), only their rows reordered
where llama.cpp permuted Q and K.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.engine.gguf.config import architecture
from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.gguf.names import gguf_name, hf_name, unpermute_rows
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGMLWeight, dequantize_rows

_DENSE_TYPES = ("F32", "F16", "BF16")


class GGUFWeights:
    """Name -> tensor access for one GGUF file; tensors are read on request and never cached."""

    def __init__(self, gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> None:
        self.gguf = gguf
        self.folder: Path = gguf.path
        self.total_bytes = gguf.path.stat().st_size
        self._permuted = architecture(gguf.architecture, gguf.path.name).permuted_qk
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}

    def close(self) -> None:
        self.gguf.close()

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        gname = gguf_name(name)
        return gname is not None and gname in self.gguf

    def names(self) -> List[str]:
        """The Hugging Face names of the tensors the engine reads from this file."""
        return [n for n in (hf_name(g) for g in self.gguf.names()) if n is not None]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.gguf.shape(self._gguf(name))

    def get_shape_checked(self, name: str, shape: Sequence[int]) -> None:
        """A ModelFormatError naming the tensor when its shape is not `shape` (nothing is read)."""
        self._check(name, shape)

    def get(self, name: str, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """A float tensor (float32 for quantized types; F16/BF16 as stored)."""
        gname = self._check(name, shape)
        kind = self.gguf.type_name(gname)
        dims = self.gguf.shape(gname)
        rows = self._rows(name, gname)
        if kind == "F32":
            out = rows.view(torch.float32)
        elif kind == "F16":
            out = rows.view(torch.float16)
        elif kind == "BF16":
            out = rows.view(torch.bfloat16)
        else:
            out = dequantize_rows(rows, kind, dims[-1])
        return out.reshape(dims)

    def linear(self, prefix: str, k: int, n: int, device: torch.device,
               dtype: torch.dtype) -> Union[torch.Tensor, GGMLWeight]:
        """The projection `prefix` ([n, k]): a GGMLWeight for block formats, else a dense tensor in `dtype`."""
        name = f"{prefix}.weight"
        gname = self._check(name, (n, k))
        kind = self.gguf.type_name(gname)
        bias = None
        if f"{prefix}.bias" in self:
            bias = self.get(f"{prefix}.bias", (n,)).to(device=device, dtype=dtype)
        if kind in _DENSE_TYPES:
            w = self.get(name).to(device=device, dtype=dtype).contiguous()
            if bias is not None:
                raise ModelFormatError(f"{prefix}: dense GGUF projections with a bias are not supported yet.")
            return w
        data = self._rows(name, gname).to(device).contiguous()
        return GGMLWeight(data, kind, in_features=k, out_features=n, bias=bias)

    def _gguf(self, name: str) -> str:
        gname = gguf_name(name)
        if gname is None or gname not in self.gguf:
            raise ModelFormatError(f"Tensor {name} ({gname or 'no GGUF name'}) is missing from {self.folder.name}.")
        return gname

    def _check(self, name: str, shape: Optional[Sequence[int]]) -> str:
        gname = self._gguf(name)
        found = self.gguf.shape(gname)
        if shape is not None and tuple(found) != tuple(shape):
            raise ModelFormatError(
                f"Tensor {gname} in {self.folder.name} has shape {list(found)} but the config implies {list(shape)}."
            )
        return gname

    def _rows(self, name: str, gname: str) -> torch.Tensor:
        """The stored bytes [rows, row_bytes], rows moved back to Hugging Face order for permuted Q/K."""
        rows = torch.from_numpy(self.gguf.raw(gname).copy())
        stem = name.rsplit(".", 1)[0].split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if self._permuted and stem in self._heads:
            rows = unpermute_rows(rows, self._heads[stem])
        return rows
