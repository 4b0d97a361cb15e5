"""GGML block formats (what GGUF files hold): the weight type and its dequantization, written from ggml's block
definitions.

A `GGMLWeight` keeps a linear layer's bytes exactly as the file stores them: `data` is uint8 `[N, row_bytes]`, one
row of blocks per output feature, each block covering `block_size` consecutive input features (or, for the CUDA
integer GEMV, the same bytes re-laid out per row: the "R" types below). Dequantization
follows ggml's arithmetic in float32 step for step (scale products first, then times the quant, then the min), so
the values equal llama.cpp's and the `gguf` package's bit for bit.

Block layouts (bytes, little-endian; `d`, `m`, `dmin` are fp16):
- Q8_0 (34 B / 32): d, int8 q[32]; w = q * d.
- Q4_0 (18 B / 32): d, q[16] nibbles (low nibble: element j, high: element j + 16); w = (q - 8) * d.
- Q4_1 (20 B / 32): d, m, q[16] as Q4_0; w = q * d + m.
- Q5_0 (22 B / 32): d, qh (uint32: bit j is element j's fifth bit), q[16] as Q4_0; w = (q | h << 4) - 16, times d.
- Q5_1 (24 B / 32): d, m, qh, q[16]; w = (q | h << 4) * d + m.
- Q4_K (144 B / 256): d, dmin, scales[12] (eight 6-bit scales and mins), q[128]; 64-element chunks of 32 bytes,
  low nibbles the chunk's first sub-block of 32, high nibbles its second; w = (d * sc) * q - (dmin * mn).
- Q5_K (176 B / 256): d, dmin, scales[12], qh[32] (bit i of byte l is sub-block i's element l), q[128] as Q4_K.
- Q6_K (210 B / 256): ql[128], qh[64], int8 scales[16], d; 128-element halves, each of four 32-element rows built
  from ql's low/high nibbles and qh's 2-bit pairs; w = (d * sc) * (q - 32) with one scale per 16 elements.
- Q4_0R, Q8_0R, Q6_KR: Q4_0 / Q8_0 / Q6_K rows re-laid out when placed for the CUDA integer GEMV (`repack`):
  the row's blocks without their fp16 d (16, 32 or 208 bytes each, so every block starts 16-byte aligned), then
  the blocks' d in order, then zero bytes up to a multiple of 16 (`row_bytes`). Same values, same memory (at most
  15 bytes a row more); dequantization undoes the re-layout first.
- MXFP4 (17 B / 32, gpt-oss's experts): e (uint8, e8m0), q[16] E2M1 codes as Q4_0's nibbles; w = 2 * E2M1(q) *
  2^(e - 128). No native kernel reads it: matmuls dequantize in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

# ggml_type id -> (name, elements per block, bytes per block); ids as in ggml.h's enum ggml_type.
GGML_TYPES: Dict[int, Tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}
# The re-laid-out forms (not file types): id | REPACK_BIT (csrc/cuda/ggml_q8.cu kRepacked), name + "R".
REPACK_BIT = 0x100
REPACKED_TYPES: Dict[int, Tuple[str, int, int]] = {
    REPACK_BIT | 2: ("Q4_0R", 32, 18), REPACK_BIT | 8: ("Q8_0R", 32, 34), REPACK_BIT | 14: ("Q6_KR", 256, 210)}
TYPE_IDS: Dict[str, int] = {name: tid for tid, (name, _, _) in {**GGML_TYPES, **REPACKED_TYPES}.items()}
_SIZES: Dict[str, Tuple[int, int]] = {name: (block, size)
                                      for name, block, size in [*GGML_TYPES.values(), *REPACKED_TYPES.values()]}
# The block types the native kernels read (csrc/include/ggml_blocks.h); F32/F16/BF16 stay dense torch tensors.
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Block type -> its re-laid-out form, and the byte offset of the fp16 d inside the file's block.
REPACKED: Dict[str, str] = {"Q4_0": "Q4_0R", "Q8_0": "Q8_0R", "Q6_K": "Q6_KR"}
_D_OFFSET = {"Q4_0": 0, "Q8_0": 0, "Q6_K": 208}
_ORIGINAL = {r: t for t, r in REPACKED.items()}


@dataclass
class GGMLWeight:
    """One linear layer in a GGML block format: `data` uint8 [out_features, row_bytes] as stored in the file."""

    data: torch.Tensor
    type_name: str
    in_features: int
    out_features: int
    bias: Optional[torch.Tensor] = None

    @property
    def file_type_name(self) -> str:
        """The block type the file stores (type_name without a re-layout's "R")."""
        return _ORIGINAL.get(self.type_name, self.type_name)

    @property
    def block_size(self) -> int:
        return _SIZES[self.type_name][0]

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.data.numel() + bias

    @property
    def bits_per_weight(self) -> float:
        return self.data.shape[1] * 8 / self.in_features


def kernel_layout_ok(w: GGMLWeight, device: torch.device, repacked: bool = False) -> bool:
    """Whether the native kernels can read `w` on `device`: a kernel type (its re-laid-out form only where
    `repacked`: the CUDA integer GEMV), uint8 [N, row_bytes] rows contiguous there, and a bias of N values (or
    none) there too."""
    data = w.data
    kind = w.file_type_name if repacked else w.type_name
    return (kind in KERNEL_TYPES and data.dtype == torch.uint8 and data.dim() == 2 and data.is_contiguous()
            and data.device == device
            and tuple(data.shape) == (w.out_features, row_bytes(w.type_name, w.in_features))
            and (w.bias is None or (tuple(w.bias.shape) == (w.out_features,) and w.bias.device == device)))


def row_bytes(type_name: str, n: int) -> int:
    """Bytes one row of n elements takes in this format."""
    block, size = _SIZES[type_name]
    if n % block:
        raise ValueError(f"{type_name} rows need a multiple of {block} elements, not {n}")
    return n // block * size if type_name not in _ORIGINAL else (n // block * size + 15) // 16 * 16


def repack(w: GGMLWeight) -> GGMLWeight:
    """`w` (Q4_0, Q8_0 or Q6_K) re-laid out for 16-byte loads (the module docstring's Q4_0R / Q8_0R / Q6_KR), on
    w's device; the bias is shared."""
    n, nb = w.out_features, w.in_features // w.block_size
    size, off = _SIZES[w.type_name][1], _D_OFFSET[w.type_name]
    blocks = w.data.reshape(n, nb, size)
    kind = REPACKED[w.type_name]
    out = torch.zeros((n, row_bytes(kind, w.in_features)), dtype=torch.uint8, device=w.data.device)
    quants = out[:, :nb * (size - 2)].view(n, nb, size - 2)  # filled in place: no third copy
    quants[:, :, :off] = blocks[:, :, :off]
    quants[:, :, off:] = blocks[:, :, off + 2:]
    out[:, nb * (size - 2):nb * size].view(n, nb, 2).copy_(blocks[:, :, off:off + 2])
    return GGMLWeight(out, kind, w.in_features, w.out_features, w.bias)


def unpack_rows(data: torch.Tensor, type_name: str, n: int) -> torch.Tensor:
    """Re-laid-out rows uint8 [rows, row_bytes(type_name, n)] -> the file's blocks [rows, nb * block bytes]."""
    kind = _ORIGINAL[type_name]
    block, size = _SIZES[kind]
    rows, nb, off = data.shape[0], n // block, _D_OFFSET[kind]
    body = data[:, :nb * (size - 2)].reshape(rows, nb, size - 2)
    d = data[:, nb * (size - 2):nb * size].reshape(rows, nb, 2)
    return torch.cat([body[:, :, :off], d, body[:, :, off:]], dim=2).reshape(rows, nb * size)


def unpack(w: GGMLWeight) -> GGMLWeight:
    """A re-laid-out weight back in its file layout (a new tensor); any other weight as it is."""
    if w.type_name not in _ORIGINAL:
        return w
    return GGMLWeight(unpack_rows(w.data, w.type_name, w.in_features), _ORIGINAL[w.type_name], w.in_features,
                      w.out_features, w.bias)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry along the last dim (little-endian fp16) -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2n] as ggml's 32-element blocks store them: low nibbles first, then high."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 4] (one little-endian uint32 per block) -> [B, 32] of 0/1, bit j at position j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int16) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int16) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins: sub-blocks 0-3 keep their low 6 bits in
    bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from bytes 8-11 and their top 2 bits
    from the top of bytes 0-3 (scales) and 4-7 (mins)."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 0x3F, (hi & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    q = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([q & 0x0F, q >> 4], dim=2).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1
    q = b[:, 48:].reshape(n, 4, 32)
    q = torch.stack([q & 0x0F, q >> 4], dim=2).reshape(n, 8, 32)
    return (d * (q | (high << 4)).float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)
    return (d * q).reshape(n, 256)


# E2M1 codes doubled (ggml's kvalues_mxfp4): the block's e8m0 scale is then taken as 2^(e - 128), half of 2^(e - 127)
_MXFP4_VALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_MXFP4_VALUES, dtype=torch.float32, device=b.device)
    scale = torch.ldexp(torch.ones_like(b[:, :1], dtype=torch.float32), b[:, :1].to(torch.int32) - 128)
    return lut[_nibbles(b[:, 1:]).long()] * scale


_BLOCK_DEQUANT: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4,
}


def dequantize_rows(data: torch.Tensor, type_name: str, n: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] in `type_name` -> float32 [rows, n], as ggml computes it."""
    rows = data.shape[0]
    if type_name == "F32":
        return data.contiguous().view(torch.float32).reshape(rows, n)
    if type_name == "F16":
        return data.contiguous().view(torch.float16).reshape(rows, n).float()
    if type_name == "BF16":
        return data.contiguous().view(torch.bfloat16).reshape(rows, n).float()
    if type_name in _ORIGINAL:
        return dequantize_rows(unpack_rows(data, type_name, n), _ORIGINAL[type_name], n)
    block, size = _SIZES[type_name]
    blocks = data.reshape(rows * (n // block), size)
    return _BLOCK_DEQUANT[type_name](blocks).reshape(rows, n)


def ggml_dequantize(w: GGMLWeight) -> torch.Tensor:
    """The float32 weight [out_features, in_features]."""
    return dequantize_rows(w.data, w.type_name, w.in_features)


def ggml_matmul(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N] in x's dtype: dequantize to x's dtype, then one matmul."""
    y = x @ ggml_dequantize(w).to(x.dtype).t()
    return y if w.bias is None else y + w.bias.to(y.dtype)
