"""load_exl2_linear: one exllamav2 EXL2 linear (`q_weight`, `q_scale`, `q_scale_max`, `q_groups`, `q_invperm`,
optional `bias`) read from a checkpoint, checked, and kept as stored in an EXL2Weight (format: docs/exl2.md).

Every malformed linear is refused here, before anything is moved to a device, with one sentence naming the tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable

import torch

from kobold_backend.engine.config import EXL2_QUANT, ModelConfig
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.exl2_weight import EXL2Weight, chunk_tables, group_table

TENSORS: Dict[str, torch.dtype] = {
    "q_weight": torch.int32,
    "q_scale": torch.int32,
    "q_scale_max": torch.float16,
    "q_groups": torch.int16,
    "q_invperm": torch.int32,
}


def with_exl2_detected(config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """The config, marked EXL2 when its tensors are (conversions by older exllamav2 releases carry no
    quantization_config in config.json)."""
    if config.quant is None and any(name.endswith(".q_weight") for name in names):
        return dataclasses.replace(config, quant=EXL2_QUANT)
    return config


def is_exl2_linear(reader: WeightReader, prefix: str) -> bool:
    """Whether the checkpoint stores `prefix` in EXL2 tensors (any of them, so that a missing one is named)."""
    return any(f"{prefix}.{name}" in reader for name in TENSORS)


def load_exl2_linear(
    reader: WeightReader,
    prefix: str,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> EXL2Weight:
    """Read and check `prefix`'s EXL2 tensors for a [out_features, in_features] projection."""
    k, n = in_features, out_features
    missing = [name for name in TENSORS if f"{prefix}.{name}" not in reader]
    if missing:
        raise ModelFormatError(f"{prefix} is EXL2 but {', '.join(f'{prefix}.{m}' for m in missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} missing from the checkpoint.")
    t = {name: reader.get(f"{prefix}.{name}") for name in TENSORS}
    if t["q_invperm"].dtype == torch.int16:
        t["q_invperm"] = t["q_invperm"].to(torch.int32)
    for name, want in TENSORS.items():
        if t[name].dtype != want:
            raise ModelFormatError(f"{prefix}.{name} has dtype {t[name].dtype}; EXL2 stores {want}.")
    qw = t["q_weight"]
    stored = -(-n // 32) * 32
    if qw.dim() != 2 or qw.shape[1] not in (n, stored) or qw.shape[1] % 8:
        raise ModelFormatError(f"{prefix}.q_weight has shape {tuple(qw.shape)}; {n} output features need "
                               f"[rows, {stored}].")
    np_ = int(qw.shape[1])
    groups = int(t["q_groups"].numel()) // 2
    expect = {"q_scale": (groups, np_ // 8), "q_scale_max": (groups,), "q_groups": (2 * groups,), "q_invperm": (k,)}
    for name, shape in expect.items():
        if tuple(t[name].shape) != shape:
            raise ModelFormatError(f"{prefix}.{name} has shape {tuple(t[name].shape)}, expected {shape} for "
                                   f"{groups} groups of a {k}x{n} linear.")
    try:
        table = group_table(t["q_groups"], int(qw.shape[0]), k)
    except ValueError as e:
        raise ModelFormatError(f"{prefix}: {e}.") from None
    invperm = t["q_invperm"].to(torch.int64)
    if not torch.equal(torch.sort(invperm).values, torch.arange(k)):
        raise ModelFormatError(f"{prefix}.q_invperm is not a permutation of its {k} input rows.")
    bias = None
    if f"{prefix}.bias" in reader:
        bias = reader.get(f"{prefix}.bias", (n,)).to(device=device, dtype=dtype)
    chunks = chunk_tables(table)
    dev = torch.device(device)
    return EXL2Weight(
        q_weight=qw.contiguous().to(dev),
        q_scale=t["q_scale"].contiguous().to(dev),
        q_scale_max=t["q_scale_max"].to(dev),
        q_groups=t["q_groups"].to(dev),
        perm=torch.argsort(invperm).to(dev),
        groups=table,
        in_features=k,
        out_features=n,
        bias=bias,
        chunks=None if chunks is None else chunks[0].to(dev),
        chunk_groups=None if chunks is None else chunks[1].to(dev),
    )
