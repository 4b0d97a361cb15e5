"""GPTQWeight: the one in-memory layout of a 4- or 8-bit quantized linear that every GPTQ op takes.

The engine's loader (kobold_backend/engine/gptq.py) normalises any checkpoint to it; the ops (reference and
native kernels) read it. It lives here, with the ops, so that ops never import the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class GPTQWeight:
    """One quantized linear; see docs/architecture.md for the layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: Optional[torch.Tensor]
    group_size: int
    in_features: int
    out_features: int
    bias: Optional[torch.Tensor] = None
    bits: int = 4  # 4: the native kernels' format; 8: GPTQ 8-bit, computed by the torch definitions

    def to(self, device: torch.device | str) -> GPTQWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GPTQWeight(
            qweight=move(self.qweight),
            scales=move(self.scales),
            zeros=move(self.zeros),
            perm=move(self.perm),
            group_size=self.group_size,
            in_features=self.in_features,
            out_features=self.out_features,
            bias=move(self.bias),
            bits=self.bits,
        )

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.zeros, self.perm, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack_rows(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[K, N] values 0..2^bits-1 -> [K*bits/32, N] int32 (row (32/bits)r+j into bits bits*j.. of word r)."""
    per = 32 // bits
    k, n = q.shape
    q = q.to(torch.int32).view(k // per, per, n)
    out = torch.zeros(k // per, n, dtype=torch.int32, device=q.device)
    for j in range(per):
        out |= q[:, j, :] << (bits * j)
    return out
