"""GPTQWeight: the one in-memory layout of a 4-bit quantized linear that every GPTQ op takes.

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
        )

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.zeros, self.perm, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] values 0..15 -> [K/8, N] int32 (row 8r+j into bits 4j..4j+3)."""
    k, n = q.shape
    q = q.to(torch.int32).view(k // 8, 8, n)
    out = torch.zeros(k // 8, n, dtype=torch.int32, device=q.device)
    for j in range(8):
        out |= q[:, j, :] << (4 * j)
    return out
