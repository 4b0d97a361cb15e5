"""GPTQ 4- and 8-bit linear layers normalised once at load: true zeros, act-order rows sorted by group.

After normalisation every kernel sees one layout, whatever the checkpoint's zero format
(v1 "zero - 1" or gptq_v2), symmetry, group size or act-order were.
"""

from __future__ import annotations

from typing import Optional

import torch

from kobold_backend.engine.config import QuantConfig
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.gptq_weight import GPTQWeight, pack_rows
from kobold_backend.ops.reference import unpack_cols, unpack_rows


def load_gptq_linear(
    reader: WeightReader,
    prefix: str,
    in_features: int,
    out_features: int,
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> GPTQWeight:
    """Read `prefix.{qweight,qzeros,scales,g_idx,bias}` and normalise them (see module docstring)."""
    k, n, bits = in_features, out_features, quant.bits
    per = 32 // bits  # values per int32 word
    if k % 8 or n % 8:
        raise ModelFormatError(f"{prefix}: GPTQ needs in/out features divisible by 8, found {k}x{n}.")
    qweight = reader.get(f"{prefix}.qweight", (k // per, n))
    if qweight.dtype != torch.int32:
        raise ModelFormatError(f"{prefix}.qweight has dtype {qweight.dtype}; GPTQ stores int32.")
    zshape = reader.shape(f"{prefix}.qzeros")
    groups = zshape[0]
    group_size = quant.group_size if quant.group_size > 0 else k
    if quant.group_size == -1 and groups > 1:
        group_size = k // groups  # as exllama does when the config omits the group size
    if -(-k // group_size) != groups:
        raise ModelFormatError(
            f"{prefix}.qzeros has {groups} groups but in_features {k} with group size {group_size} "
            f"needs {-(-k // group_size)}."
        )
    qzeros = reader.get(f"{prefix}.qzeros", (groups, n // per))
    scales = reader.get(f"{prefix}.scales", (groups, n))
    g_idx = reader.get(f"{prefix}.g_idx", (k,)) if f"{prefix}.g_idx" in reader else None
    bias = reader.get(f"{prefix}.bias", (n,)) if f"{prefix}.bias" in reader else None
    if bias is not None and not bool(bias.any()):
        bias = None

    qweight = qweight.to(device)
    zeros = unpack_cols(qzeros.to(device), bits)
    if quant.checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 checkpoints store zero - 1
    perm = _act_order_perm(g_idx, k, group_size, groups, prefix)
    if perm is not None:
        perm = perm.to(device)
        qweight = pack_rows(unpack_rows(qweight, bits).index_select(0, perm), bits)
    return GPTQWeight(
        qweight=qweight.contiguous(),
        scales=scales.to(device=device, dtype=dtype).contiguous(),
        zeros=zeros.to(dtype=dtype).contiguous(),
        perm=perm,
        group_size=group_size,
        in_features=k,
        out_features=n,
        bias=None if bias is None else bias.to(device=device, dtype=dtype),
        bits=bits,
    )


def _act_order_perm(
    g_idx: Optional[torch.Tensor], k: int, group_size: int, groups: int, prefix: str
) -> Optional[torch.Tensor]:
    """None when g_idx is absent or trivial (k // group_size); else the stable sort of rows by group."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    trivial = torch.arange(k, dtype=torch.int64) // group_size
    if torch.equal(g_idx, trivial) or (groups == 1 and not bool(g_idx.any())):
        return None
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ModelFormatError(f"{prefix}.g_idx holds group numbers outside 0..{groups - 1}.")
    counts = torch.bincount(g_idx, minlength=groups)
    expected = torch.full((groups,), group_size, dtype=counts.dtype)
    expected[-1] = k - group_size * (groups - 1)
    if not torch.equal(counts, expected):
        raise ModelFormatError(
            f"{prefix}.g_idx gives groups of unequal sizes; expected {group_size} rows per group."
        )
    return torch.sort(g_idx, stable=True).indices
