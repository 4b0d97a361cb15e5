"""EXL2Weight (exllamav2's mixed-bit format, kept as stored) and its dequantization, the reference every EXL2 op
is checked against. The format is written down in docs/exl2.md; in short, for a linear of K inputs, N outputs:

- `q_weight` int32 [qrows, Np] (Np = N rounded up to 32): groups of consecutive (permuted) input rows, each at its
  own width b in {2, 3, 4, 5, 6, 8}. Within a group, column n is a little-endian bit stream: row i of the group
  occupies bits [i*b, i*b + b) of the group's words, word j holding stream bits [32j, 32j + 32); a value may
  straddle two words (b = 3, 5, 6).
- `q_groups` int16 [2G]: per group its width and its first row in `q_weight`; a group's row count is
  (next first row - first row) * 32 / b, the last group takes the rows that remain.
- `q_scale` int32 [G, Np/8]: 4-bit scale codes, column n at bits 4*(n % 8) of word n // 8; `q_scale_max` fp16 [G].
- weight = (q - 2^(b-1)) * scale, scale = (code + 1)^2 * (q_scale_max / 256), each product rounded to fp16 as
  exllamav2 computes it, so the values equal its `get_weight_tensor_dq()` bit for bit.
- stored row k holds input feature perm[k], perm = argsort(`q_invperm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

BIT_WIDTHS = (2, 3, 4, 5, 6, 8)
CHUNK = 32  # rows a b-bit chunk packs into exactly b words


@dataclass(frozen=True)
class GroupTable:
    """Per group: width, first input row (in stored order), row count and first word row of `q_weight`."""

    bits: Tuple[int, ...]
    row: Tuple[int, ...]
    rows: Tuple[int, ...]
    qrow: Tuple[int, ...]


def group_table(q_groups: torch.Tensor, qrows: int, k: int) -> GroupTable:
    """Read `q_groups` (as exllamav2 does: the last group takes the remaining rows). Raises ValueError with one
    sentence when a width is not 2/3/4/5/6/8 or the word rows do not add up to `k` input rows."""
    flat = [int(v) for v in q_groups.reshape(-1).tolist()]
    if len(flat) % 2 or not flat:
        raise ValueError(f"q_groups has {len(flat)} entries, not two per group")
    bits, qrow = flat[0::2], flat[1::2]
    bad = sorted({b for b in bits if b not in BIT_WIDTHS})
    if bad:
        raise ValueError(f"q_groups holds bit widths {bad}; EXL2 widths are {list(BIT_WIDTHS)}")
    if qrow[0] != 0 or any(b <= a for a, b in zip(qrow, qrow[1:])) or qrow[-1] >= qrows:
        raise ValueError(f"q_groups' first word rows {qrow} do not rise from 0 within the {qrows} rows of q_weight")
    rows: List[int] = []
    row: List[int] = []
    total = 0
    for i, b in enumerate(bits):
        if i + 1 < len(bits):
            span = (qrow[i + 1] - qrow[i]) * 32
            if span % b:
                raise ValueError(f"q_groups' group {i} spans {span // 32} word rows, not whole {b}-bit rows")
            n = span // b
        else:
            n = k - total
            if n <= 0 or -(-n * b // 32) != qrows - qrow[i]:
                raise ValueError(f"q_weight's {qrows} word rows do not hold the {k} input rows q_groups describes")
        row.append(total)
        rows.append(n)
        total += n
    return GroupTable(tuple(bits), tuple(row), tuple(rows), tuple(qrow))


@dataclass
class EXL2Weight:
    """One EXL2 linear as stored (see the module docstring); `perm` int64 [K] (stored row -> input feature),
    `groups` the parsed `q_groups`; `chunks` int32 [K/32, 2] (word row, width) of each 32-row chunk when every group
    is a whole number of chunks (what the CUDA kernels walk), else None."""

    q_weight: torch.Tensor
    q_scale: torch.Tensor
    q_scale_max: torch.Tensor
    q_groups: torch.Tensor
    perm: torch.Tensor
    groups: GroupTable
    in_features: int
    out_features: int
    bias: Optional[torch.Tensor] = None
    chunks: Optional[torch.Tensor] = None
    chunk_groups: Optional[torch.Tensor] = None

    @property
    def stored_columns(self) -> int:
        return int(self.q_weight.shape[1])

    @property
    def nbytes(self) -> int:
        tensors = [self.q_weight, self.q_scale, self.q_scale_max, self.q_groups, self.perm, self.bias, self.chunks,
                   self.chunk_groups]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def file_bits(self) -> int:
        """Bits the checkpoint spends on this linear (weights, scales, group table, int32 q_invperm; no bias)."""
        stored = [self.q_weight, self.q_scale, self.q_scale_max, self.q_groups]
        return sum(t.numel() * t.element_size() * 8 for t in stored) + 32 * self.in_features

    def to(self, device: torch.device | str) -> EXL2Weight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return EXL2Weight(move(self.q_weight), move(self.q_scale), move(self.q_scale_max), move(self.q_groups),
                          move(self.perm), self.groups, self.in_features, self.out_features, move(self.bias),
                          move(self.chunks), move(self.chunk_groups))


def chunk_tables(groups: GroupTable) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(int32 [C, 2] word row and width of each 32-row chunk, int32 [C] its group) or None when a group's rows are
    not a multiple of 32."""
    if any(n % CHUNK for n in groups.rows):
        return None
    words: List[Tuple[int, int]] = []
    owner: List[int] = []
    for g, (b, n, q) in enumerate(zip(groups.bits, groups.rows, groups.qrow)):
        for c in range(n // CHUNK):
            words.append((q + c * b, b))
            owner.append(g)
    return torch.tensor(words, dtype=torch.int32), torch.tensor(owner, dtype=torch.int32)


def unpack_group(w: EXL2Weight, g: int) -> torch.Tensor:
    """int64 [rows, Np]: the quantized values of group g's stored rows, row i at bits [i*b, i*b + b) of each
    column's stream of words."""
    b, rows, q0 = w.groups.bits[g], w.groups.rows[g], w.groups.qrow[g]
    words = w.q_weight[q0 : q0 + -(-rows * b // 32)].to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[:1])])  # a value may read into the next word
    offset = torch.arange(rows, dtype=torch.int64, device=words.device) * b
    lo, hi = words[offset // 32], words[offset // 32 + 1]
    return (((hi << 32) | lo) >> (offset % 32).unsqueeze(1)) & ((1 << b) - 1)


def group_scales(w: EXL2Weight) -> torch.Tensor:
    """float32 [G, Np]: each group's per-column scale, (code + 1)^2 * fp16(q_scale_max / 256) rounded to fp16."""
    words = w.q_scale.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    codes = ((words.unsqueeze(-1) >> shifts) & 15).reshape(words.shape[0], -1)
    smax = (w.q_scale_max.float() / 256).half().float()
    return (((codes + 1) ** 2).float() * smax.unsqueeze(1)).half().float()


def exl2_dequantize(w: EXL2Weight) -> torch.Tensor:
    """The fp16 weight [out_features, in_features], equal to exllamav2's reconstruction (computed group by group,
    so the temporaries stay the size of one group)."""
    scales = group_scales(w)
    stored = torch.empty((w.in_features, w.stored_columns), dtype=torch.float16, device=w.q_weight.device)
    for g, (b, row, rows) in enumerate(zip(w.groups.bits, w.groups.row, w.groups.rows)):
        q = unpack_group(w, g) - (1 << (b - 1))
        stored[row : row + rows] = (q.float() * scales[g]).half()
    dense = torch.empty_like(stored)
    dense[w.perm.to(stored.device)] = stored
    return dense[:, : w.out_features].t().contiguous()


def exl2_matmul(x: torch.Tensor, w: EXL2Weight) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype: dequantize, then one matmul."""
    y = x @ exl2_dequantize(w).to(x.dtype).t()
    return y if w.bias is None else y + w.bias.to(y.dtype)
