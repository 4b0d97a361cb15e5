"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: dequantized at load.

A tensor `<name>_blocks` uint8 [..., N, G, 16] holds 32 FP4 (E2M1) codes per block, two per byte, the low nibble
first; `<name>_scales` uint8 [..., N, G] is each block's power-of-two scale, biased by 127. Row n of the weight is
the G blocks of 32 values in order, so the result is [..., N, G * 32] ([out, in] for the gpt-oss experts).
"""

from __future__ import annotations

import torch

#: the 16 E2M1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float tensor [..., N, G * 32] from `blocks` uint8 [..., N, G, 16] and `scales` uint8 [..., N, G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                         f"({scales.dtype}) are not uint8 [..., G, 16] and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)
