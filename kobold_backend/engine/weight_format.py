"""What a loaded model's weights are stored as, in words and bits per weight, for the load log, doctor and the
model routes ("GGUF Q4_K+Q6_K, 4.90 bpw", "GPTQ 4-bit g128, 4.16 bpw", "EXL2 4+3+6-bit, 4.13 bpw",
"float16, 16.00 bpw")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from kobold_backend.engine.config import ModelConfig
from kobold_backend.ops.exl2_weight import EXL2Weight
from kobold_backend.ops.ggml import GGMLWeight
from kobold_backend.ops.gptq_weight import GPTQWeight


@dataclass(frozen=True)
class WeightFormat:
    """`name` ("GGUF", "GPTQ", "AWQ", "EXL2" or a float dtype), `detail` (block types, bits and group size, or EXL2's
    widths by share) and what the decoder layers' linear weights take in memory, in bits per weight (scales, zeros
    and block headers included; GPTQ/AWQ scales and zeros are held in the compute dtype, float32 on the CPU; EXL2
    counted as its files store it)."""

    name: str
    detail: str
    bits_per_weight: float

    def __str__(self) -> str:
        head = f"{self.name} {self.detail}".strip()
        return f"{head}, {self.bits_per_weight:.2f} bpw"


def _linears(layers: Iterable[Any]) -> Iterable[Any]:
    for layer in layers:
        for t in layer.tensors():
            if isinstance(t, (GPTQWeight, GGMLWeight, EXL2Weight)) or (isinstance(t, torch.Tensor) and t.dim() == 2):
                yield t


def describe(config: ModelConfig, layers: Iterable[Any]) -> WeightFormat:
    """The format of the decoder layers' linear weights (embeddings and head are often stored differently)."""
    bits = 0
    weights = 0
    ggml_types: Counter = Counter()
    exl2_widths: Counter = Counter()
    dense_dtypes: Counter = Counter()
    for w in _linears(layers):
        if isinstance(w, GGMLWeight):
            n = w.in_features * w.out_features
            ggml_types[w.file_type_name] += n
            bits += w.data.numel() * 8
        elif isinstance(w, EXL2Weight):
            n = w.in_features * w.out_features
            for b, rows in zip(w.groups.bits, w.groups.rows):
                exl2_widths[b] += rows * w.out_features
            bits += w.file_bits
        elif isinstance(w, GPTQWeight):
            n = w.in_features * w.out_features
            bits += (w.nbytes - (0 if w.bias is None else w.bias.numel() * w.bias.element_size())) * 8
        else:
            n = w.numel()
            dense_dtypes[str(w.dtype).replace("torch.", "")] += n
            bits += n * w.element_size() * 8
        weights += n
    bpw = bits / max(weights, 1)
    if ggml_types:
        return WeightFormat("GGUF", "+".join(t for t, _ in ggml_types.most_common()), bpw)
    if exl2_widths:
        return WeightFormat("EXL2", "+".join(str(b) for b, _ in exl2_widths.most_common()) + "-bit", bpw)
    quant = config.quant
    if quant is not None:
        group = "" if quant.group_size <= 0 else f" g{quant.group_size}"
        return WeightFormat(quant.method.upper(), f"{quant.bits}-bit{group}", bpw)
    dtype = dense_dtypes.most_common(1)[0][0] if dense_dtypes else "float16"
    return WeightFormat(dtype, "", bpw)
