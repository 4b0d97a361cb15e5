"""The quantized KV cache layout (8- and 4-bit) and the attention ops that read it.

Layout, per layer and per K or V (exllamav2's Q8/Q4 caches work the same way): every cached vector of one head
(head_dim values at one position) is split into groups of 32 values; each group is rotated by the orthonormal
32x32 Hadamard matrix H (which spreads an outlier channel over the group, so one large value does not flatten the
others to zero) and stored as symmetric integers with one fp16 scale, max|x| / qmax:
  - 8 bits: int8 in [-127, 127], data [B, H, S, D];
  - 4 bits: in [-7, 7] stored +8 as nibbles, value 2j in the low and 2j+1 in the high nibble of byte j,
    data uint8 [B, H, S, D/2];
  - scales fp16 [B, H, S, D/32].
That is D + D/16 bytes per vector at 8 bits (53 % of fp16 at D=128) and D/2 + D/16 at 4 bits (28 %).

Because H is orthonormal and symmetric, q.k = (Hq).(Hk) and sum_j p_j v_j = H sum_j p_j (H v_j): attention runs in
the rotated space on the stored integers (the query rotated once, the output rotated back once), so no kernel
rotates a cached vector. On CUDA two kernels (csrc/cuda/kv_quant.cu) do the work of a step: `kvq_rope_write`
(RoPE, rotation and quantization of the new keys and values, fused) and `kvq_decode_attention` (reads the integers,
dequantizing in registers); both are graph-capturable. On the CPU, csrc/cpu/kv_quant_cpu.cpp's
`kvq_decode_attention` reads the integers in place. Prompt chunks dequantize only the attended range; any layout
the kernels do not take uses the torch definitions below. Context shifting re-quantizes the re-rotated keys from
their dequantized values (values move as bytes).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from kobold_backend.ops import native, reference

GROUP = 32
BITS: Dict[str, int] = {"q8": 8, "q4": 4}
_QMAX = {8: 127, 4: 7}
_hadamards: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}


def hadamard(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal, symmetric 32x32 Hadamard matrix (Sylvester's construction) on `device`."""
    key = (torch.device(device), dtype)
    h = _hadamards.get(key)
    if h is None:
        m = torch.ones((1, 1), dtype=torch.float64)
        while m.shape[0] < GROUP:
            m = torch.cat([torch.cat([m, m], 1), torch.cat([m, -m], 1)], 0)
        h = (m / GROUP ** 0.5).to(device=device, dtype=dtype)
        _hadamards[key] = h
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H applied to every group of 32 values of the last dimension, in float32 (H is its own inverse)."""
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    return torch.matmul(xf, hadamard(x.device)).reshape(shape)


def bytes_per_vector(scheme: str, head_dim: int, elem: int) -> int:
    """Bytes one cached head vector takes: `elem` per value unquantized (scheme 'fp16'), else data + scales."""
    if scheme not in BITS:
        return head_dim * elem
    return head_dim * BITS[scheme] // 8 + head_dim // GROUP * 2


def quantize(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D*bits/8], scales fp16 [..., D/32]) in the layout above."""
    qmax = _QMAX[bits]
    xr = rotate(x)
    groups = xr.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    scales = (groups.abs().amax(-1) / qmax).to(torch.float16)
    s = scales.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(groups / s.clamp_min(1e-30)), torch.zeros_like(groups))
    q = q.clamp(-qmax, qmax).reshape(x.shape)
    if bits == 8:
        return q.to(torch.int8), scales
    n = (q + 8).to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, bits: int, rotated: bool = False) -> torch.Tensor:
    """(data, scales) -> float32 [..., D]; `rotated` keeps the values in the Hadamard-rotated space."""
    if bits == 8:
        q = data.float()
    else:
        q = torch.stack(((data & 15).float() - 8, (data >> 4).float() - 8), dim=-1).flatten(-2)
    d = q.shape[-1]
    x = (q.reshape(*q.shape[:-1], d // GROUP, GROUP) * scales.float().unsqueeze(-1)).reshape(q.shape)
    return x if rotated else rotate(x)


class QuantizedKV:
    """One layer's K or V cache in the quantized layout, indexed like the [B, H, S, D] tensor it stands for.

    Indexing over the first three dimensions (`kv[:, :, a:b]`, `kv[:, :, p]`) gives a view of data and scales;
    `copy_` takes another QuantizedKV (bytes copied as they are) or a float tensor (quantized); `float()`
    dequantizes. So the cache's clone/copy/truncate, beams and context shifting use it as they use a tensor.
    """

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> None:
        self.data = data
        self.scales = scales
        self.bits = bits
        self.dtype = dtype  # the compute dtype dequantized reads are returned in

    @classmethod
    def empty(cls, shape: Tuple[int, int, int, int], bits: int, dtype: torch.dtype,
              device: torch.device | str) -> QuantizedKV:
        b, h, s, d = shape
        if d % GROUP:
            raise ValueError(f"a quantized KV cache needs head_dim a multiple of {GROUP}, not {d}")
        data = torch.zeros((b, h, s, d * bits // 8), dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
        return cls(data, torch.zeros((b, h, s, d // GROUP), dtype=torch.float16, device=device), bits, dtype)

    @property
    def head_dim(self) -> int:
        return self.scales.shape[-1] * GROUP

    @property
    def shape(self) -> Tuple[int, ...]:
        return (*self.scales.shape[:-1], self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales))

    def __getitem__(self, index: Any) -> QuantizedKV:
        if isinstance(index, tuple) and len(index) > 3:
            raise IndexError("a QuantizedKV is indexed over batch, head and position only")
        return QuantizedKV(self.data[index], self.scales[index], self.bits, self.dtype)

    def copy_(self, src: Any) -> QuantizedKV:
        if isinstance(src, QuantizedKV):
            if src.bits != self.bits:
                raise ValueError(f"cannot copy a {src.bits}-bit cache into a {self.bits}-bit one")
            self.data.copy_(src.data)
            self.scales.copy_(src.scales)
        else:
            data, scales = quantize(src, self.bits)
            self.data.copy_(data)
            self.scales.copy_(scales)
        return self

    def clone(self) -> QuantizedKV:
        return QuantizedKV(self.data.clone(), self.scales.clone(), self.bits, self.dtype)

    def float(self) -> torch.Tensor:
        return dequantize(self.data, self.scales, self.bits)

    def dense(self, end: int) -> torch.Tensor:
        """Positions [0, end) dequantized to the compute dtype, [B, H, end, D]."""
        return self[:, :, :end].float().to(self.dtype)

    def write(self, x: torch.Tensor, pos: int) -> None:
        """x [B, H, T, D] quantized into positions pos..pos+T-1."""
        self[:, :, pos : pos + x.shape[2]].copy_(x)

    def write_at(self, x: torch.Tensor, pos: torch.Tensor) -> None:
        """x [B, H, T, D] quantized into the T positions held by the device tensor `pos` (graph-capturable)."""
        data, scales = quantize(x, self.bits)
        self.data.index_copy_(2, pos, data)
        self.scales.index_copy_(2, pos, scales)


def _rope(q: torch.Tensor, k: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    q_rot = (q.float() * c + reference.rotate_half(q.float()) * s).to(q.dtype)
    k_rot = k.float() * c + reference.rotate_half(k.float()) * s
    return q_rot, k_rot


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pos: int, k_cache: Any, v_cache: Any) -> torch.Tensor:
    """reference.rope_cache_write into quantized caches: the rotated keys, rounded to k's dtype, and the values
    quantized (one CUDA kernel where it is loaded, else the torch definition)."""
    out = _native_write(q, k, v, cos, sin, pos, None, k_cache, v_cache)
    if out is not None:
        return out
    t = q.shape[1]
    q_rot, k_rot = _rope(q, k, cos[pos : pos + t].view(1, t, 1, -1), sin[pos : pos + t].view(1, t, 1, -1))
    _store(k_cache, k_rot.to(k.dtype).transpose(1, 2), pos)
    _store(v_cache, v.transpose(1, 2), pos)
    return q_rot


def rope_cache_write_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        pos: torch.Tensor, k_cache: Any, v_cache: Any) -> torch.Tensor:
    """rope_cache_write for T tokens at positions pos..pos+T-1, `pos` a device tensor (CUDA-graph capturable)."""
    out = _native_write(q, k, v, cos, sin, 0, pos, k_cache, v_cache)
    if out is not None:
        return out
    at = reference.row_positions(pos, q.shape[1])
    c = cos.index_select(0, at).view(1, -1, 1, cos.shape[-1])
    s = sin.index_select(0, at).view(1, -1, 1, sin.shape[-1])
    q_rot, k_rot = _rope(q, k, c, s)
    _store_at(k_cache, k_rot.to(k.dtype).transpose(1, 2), at)
    _store_at(v_cache, v.transpose(1, 2), at)
    return q_rot


def _native_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                  pos_dev: Optional[torch.Tensor], k_cache: Any, v_cache: Any) -> Optional[torch.Tensor]:
    if not (q.is_cuda and isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
        return None
    kern = native.cuda_kernels()
    if kern is None:
        return None
    return kern.kvq_rope_write(q, k, v, cos, sin, pos, pos_dev, k_cache, v_cache)


def _store(cache: Any, x: torch.Tensor, pos: int) -> None:
    if isinstance(cache, QuantizedKV):
        cache.write(x, pos)
    else:
        cache[:, :, pos : pos + x.shape[2]].copy_(x)


def _store_at(cache: Any, x: torch.Tensor, pos: torch.Tensor) -> None:
    if isinstance(cache, QuantizedKV):
        cache.write_at(x, pos)
    else:
        cache.index_copy_(2, pos, x)


def _dense(cache: Any, end: int) -> torch.Tensor:
    return cache.dense(end) if isinstance(cache, QuantizedKV) else cache[:, :, :end]


def attention(q: torch.Tensor, k_cache: Any, v_cache: Any, pos: int, scale: float,
              window: Optional[int] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.attention for a prompt chunk: the attended positions [0, pos + T) dequantized once per call."""
    n = pos + q.shape[1]
    return reference.attention(q, _dense(k_cache, n), _dense(v_cache, n), pos, scale, window, softcap, sinks)


def decode_attention(q: torch.Tensor, k_cache: Any, v_cache: Any, seq_len: int, scale: float,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One query row [B, Hq, D] against the first seq_len quantized positions (the kernels have no sinks)."""
    out = None if sinks is not None else _native_call(q, k_cache, v_cache, seq_len, None, scale, window, softcap)
    if out is not None:
        return out
    return reference.decode_attention(q, _dense(k_cache, seq_len), _dense(v_cache, seq_len), seq_len, scale,
                                      window, softcap, sinks)


def decode_attention_at(q: torch.Tensor, k_cache: Any, v_cache: Any, pos: torch.Tensor, length: int, scale: float,
                        window: Optional[int] = None, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decode_attention over the first `length` positions, those after the device tensor `pos` masked."""
    out = None if sinks is not None else _native_call(q, k_cache, v_cache, length, pos, scale, window, softcap)
    if out is not None:
        return out
    return reference.decode_attention_at(q, _dense(k_cache, length), _dense(v_cache, length), pos, length, scale,
                                         window, softcap, sinks)


def decode_attention_rows(q: torch.Tensor, k_cache: Any, v_cache: Any, pos: torch.Tensor, length: int,
                          scale: float, window: Optional[int] = None, softcap: Optional[float] = None,
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference.decode_attention_rows over quantized caches: each row of q [B, T, Hq, D] through the native
    one-row kernel at its own device position where one is loaded (no sinks), else the first `length` positions
    dequantized once for all rows."""
    at = reference.row_positions(pos, q.shape[1])
    rows = [None if sinks is not None else _native_call(q[:, i], k_cache, v_cache, length, at[i : i + 1], scale,
                                                        window, softcap) for i in range(q.shape[1])]
    if all(r is not None for r in rows):
        return torch.stack(rows, dim=1)  # type: ignore[arg-type]
    return reference.decode_attention_rows(q, _dense(k_cache, length), _dense(v_cache, length), pos, length, scale,
                                           window, softcap, sinks)


def _native_call(q: torch.Tensor, k_cache: Any, v_cache: Any, length: int, pos: Optional[torch.Tensor],
                 scale: float, window: Optional[int], softcap: Optional[float]) -> Optional[torch.Tensor]:
    """The native kernel's result when one can read these caches directly (both quantized), else None and the
    reference dequantizes the range. The kernels rotate the query into the cache's Hadamard space and the output
    back, and apply the sliding window and soft-capping themselves."""
    if not (isinstance(k_cache, QuantizedKV)
            and isinstance(v_cache, QuantizedKV) and q.dim() == 3 and q.shape[1] % k_cache.shape[1] == 0
            and k_cache.head_dim == q.shape[2] and k_cache.head_dim <= 256):
        return None
    if q.is_cpu:
        kern = native.cpu_kernels()
        if kern is None:
            return None
        n = length if pos is None else min(int(pos) + 1, length)
        return kern.kvq_decode_attention(q, k_cache, v_cache, n, scale, window, softcap)
    if not q.is_cuda:
        return None
    kern = native.cuda_kernels()
    if kern is None:
        return None
    x = q if q.dtype in (torch.float16, torch.float32) else q.float()
    out = kern.kvq_decode_attention(x, k_cache, v_cache, length, pos, scale, window, softcap)
    return None if out is None else out.to(q.dtype)
