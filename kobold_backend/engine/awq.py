"""AWQ 4-bit linear layers (AutoAWQ's "GEMM" checkpoints) re-laid out once at load as `GPTQWeight`s.

AutoAWQ stores, per linear with in_features K and out_features N and group size G:
- `qweight` int32 [K, N/8]: eight 4-bit values of one input row per word, output columns 8c..8c+7 in the nibble
  order (0, 2, 4, 6, 1, 3, 5, 7), i.e. nibble i holds column 8c + AWQ_ORDER[i];
- `qzeros` int32 [K/G, N/8]: zero points packed the same way (true zeros, no offset);
- `scales` fp16 [K/G, N]; w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
Only the packing differs from normalised GPTQ (rows packed along K, zeros unpacked): moving the nibbles is exact,
so the GPTQ kernels then compute with the checkpoint's own values.
"""

from __future__ import annotations

import torch

from kobold_backend.engine.config import QuantConfig
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.gptq_weight import GPTQWeight, pack_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's nibble order -> int32 [R, N] in column order."""
    r, words = packed.shape
    out = torch.empty(r, words, 8, dtype=torch.int32, device=packed.device)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = (packed >> (4 * i)) & 0xF
    return out.reshape(r, words * 8)


def load_awq_linear(
    reader: WeightReader,
    prefix: str,
    in_features: int,
    out_features: int,
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> GPTQWeight:
    """Read `prefix.{qweight,qzeros,scales,bias}` and lay them out as a GPTQWeight."""
    k, n = in_features, out_features
    if k % 8 or n % 8:
        raise ModelFormatError(f"{prefix}: AWQ needs in/out features divisible by 8, found {k}x{n}.")
    group = quant.group_size if quant.group_size > 0 else k
    if k % group:
        raise ModelFormatError(f"{prefix}: in_features {k} is not a multiple of the AWQ group size {group}.")
    qweight = reader.get(f"{prefix}.qweight", (k, n // 8))
    if qweight.dtype != torch.int32:
        raise ModelFormatError(f"{prefix}.qweight has dtype {qweight.dtype}; AWQ stores int32.")
    qzeros = reader.get(f"{prefix}.qzeros", (k // group, n // 8))
    scales = reader.get(f"{prefix}.scales", (k // group, n))
    bias = reader.get(f"{prefix}.bias", (n,)) if f"{prefix}.bias" in reader else None
    q = unpack_awq_cols(qweight.to(device))
    return GPTQWeight(
        qweight=pack_rows(q).contiguous(),
        scales=scales.to(device=device, dtype=dtype).contiguous(),
        zeros=unpack_awq_cols(qzeros.to(device)).to(dtype).contiguous(),
        perm=None,
        group_size=group,
        in_features=k,
        out_features=n,
        bias=None if bias is None else bias.to(device=device, dtype=dtype),
    )
