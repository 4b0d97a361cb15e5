"""Pure-torch definitions of every engine operation: the oracle for the native kernels and the last fallback."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager, Optional, Tuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kobold_backend.ops.gptq_weight import GPTQWeight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    residual_out = x + residual
    return rms_norm(residual_out, weight, eps), residual_out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without bias over the last axis, in float32 (Cohere's): (x - mean) / sqrt(var + eps) * weight."""
    xf = x.float()
    centered = xf - xf.mean(-1, keepdim=True)
    y = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    residual_out = x + residual
    return layer_norm(residual_out, weight, eps), residual_out


def unpack_rows(qweight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[K*bits/32, N] int32 -> [K, N] int32 (row (32/bits)r+j from bits bits*j.. of word r)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    q = (qweight.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return q.reshape(qweight.shape[0] * per, qweight.shape[1])


def unpack_cols(qzeros: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[G, N*bits/32] int32 -> [G, N] int32 (column (32/bits)c+j from bits bits*j.. of word c)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qzeros.device, dtype=torch.int32)
    z = (qzeros.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)
    return z.reshape(qzeros.shape[0], qzeros.shape[1] * per)


def gptq_dequantize(w: GPTQWeight) -> torch.Tensor:
    """[K, N] weights in sorted row order, in the dtype of `w.scales`."""
    q = unpack_rows(w.qweight, w.bits)[: w.in_features]
    groups = torch.arange(w.in_features, device=q.device) // w.group_size
    return (q.to(w.scales.dtype) - w.zeros[groups]) * w.scales[groups]


def gptq_matmul(x: torch.Tensor, w: GPTQWeight) -> torch.Tensor:
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    y = torch.matmul(x, gptq_dequantize(w).to(x.dtype))
    if w.bias is not None:
        y = y + w.bias.to(y.dtype)
    return y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """q,k,v: [B, T, H, D]; cos/sin: [S, D]; caches [B, Hkv, S, D] written at pos..pos+T-1."""
    t = q.shape[1]
    c = cos[pos : pos + t].view(1, t, 1, -1)
    s = sin[pos : pos + t].view(1, t, 1, -1)
    q_rot = (q.float() * c + rotate_half(q.float()) * s).to(q.dtype)
    k_rot = (k.float() * c + rotate_half(k.float()) * s).to(k.dtype)
    k_cache[:, :, pos : pos + t].copy_(k_rot.transpose(1, 2))
    v_cache[:, :, pos : pos + t].copy_(v.transpose(1, 2))
    return q_rot


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of q [B, T, Hq, D] (positions pos..pos+T-1) over cache[:, :, :pos+T] (values may have
    their own head size).

    `window` w: query i sees keys j with i - w < j <= i (sliding window, as transformers masks it);
    `softcap` c: scores become c * tanh(scores / c) before the mask (Gemma 2);
    `sinks` [Hq]: one learned logit per head joins the softmax's denominator and attends to nothing (gpt-oss)."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    n = pos + t
    start = 0 if window is None else max(0, pos - window + 1)  # keys no query of this call can see
    k = k_cache[:, :, start:n]
    v = v_cache[:, :, start:n]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    windowed = window is not None and n - start > window
    mask = None
    explicit = softcap is not None or sinks is not None
    if (t > 1 and pos > 0) or windowed or explicit:
        rows = torch.arange(pos, n, device=q.device).view(t, 1)
        cols = torch.arange(start, n, device=q.device).view(1, n - start)
        mask = cols <= rows
        if windowed:
            mask = mask & (cols > rows - window)  # type: ignore[operator]
    if explicit:
        scores = torch.matmul(q.transpose(1, 2).float(), k.float().transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = _softmax(scores.masked_fill(~mask, float("-inf")), sinks)  # type: ignore[operator]
        return torch.matmul(probs, v.float()).to(q.dtype).transpose(1, 2)
    with _sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, is_causal=(mask is None and t > 1), scale=scale
        )
    return out.transpose(1, 2)


def _softmax(scores: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last axis of float32 scores [B, H, T, N]; with `sinks` [H], each head's sink logit joins
    the denominator (its probability is dropped)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _sdpa_backends(device: torch.device) -> ContextManager[object]:
    """Keep SDPA off the cuDNN backend on CUDA: it rebuilds a graph for every new shape (hundreds of
    milliseconds, once per chat turn length) and costs ~1.6 ms of CPU per call (shared/perf/anchors.md)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3 has no cuDNN backend to avoid
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_len: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [B, Hq, D] against the first seq_len cached positions (the last `window` of them) -> [B, Hq, Dv]."""
    return attention(q.unsqueeze(1), k_cache, v_cache, seq_len - 1, scale, window, softcap, sinks).squeeze(1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) (tanh approximation, transformers' gelu_pytorch_tanh) * up."""
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated unit: gate clamped above at `limit`, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def row_positions(pos: torch.Tensor, t: int) -> torch.Tensor:
    """The device positions pos, pos+1, ..., pos+t-1 of t rows fed at the device-tensor position `pos`."""
    return pos.reshape(1) + torch.arange(t, device=pos.device, dtype=pos.dtype)


def rope_cache_write_at(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """rope_cache_write for T tokens at positions pos..pos+T-1, `pos` a device tensor (CUDA-graph capturable)."""
    at = row_positions(pos, q.shape[1])
    c = cos.index_select(0, at).view(1, -1, 1, cos.shape[-1])
    s = sin.index_select(0, at).view(1, -1, 1, sin.shape[-1])
    q_rot = (q.float() * c + rotate_half(q.float()) * s).to(q.dtype)
    k_rot = (k.float() * c + rotate_half(k.float()) * s).to(k.dtype)
    k_cache.index_copy_(2, at, k_rot.transpose(1, 2))
    v_cache.index_copy_(2, at, v.transpose(1, 2))
    return q_rot


def decode_attention_at(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    length: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """decode_attention over cache[:, :, :length] with positions after the device tensor `pos` masked, and with
    a `window`, positions at or before `pos - window` too (the window start is computed on the device, so a
    CUDA graph captured once serves every position)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    k = k_cache[:, :, :length]
    v = v_cache[:, :, :length]
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    cols = torch.arange(length, device=q.device)
    masked = cols > pos
    if window is not None and length > window:
        masked = masked | (cols <= pos - window)
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
    else:
        probs = _softmax(scores.view(b, hq, 1, length), sinks).view(scores.shape).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq, v.shape[-1])


def decode_attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    length: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """decode_attention_at for T query rows q [B, T, Hq, D] at positions pos..pos+T-1 (a verification forward):
    row i sees the cached positions up to pos + i (with a window, only those after pos + i - window); returns
    [B, T, Hq, Dv]."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    k = k_cache[:, :, :length]
    v = v_cache[:, :, :length]
    qg = q.reshape(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    last = row_positions(pos, t).repeat_interleave(g).view(t * g, 1)  # the position of each score row
    cols = torch.arange(length, device=q.device).view(1, length)
    masked = cols > last
    if window is not None and length > window:
        masked = masked | (cols <= last - window)
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # per query head: [B, Hkv, T, G, N] -> [B, Hq, T, N] and back
        by_head = scores.view(b, hkv, t, g, length).permute(0, 1, 3, 2, 4).reshape(b, hq, t, length)
        probs = _softmax(by_head, sinks).view(b, hkv, g, t, length).permute(0, 1, 3, 2, 4).reshape(scores.shape)
    out = torch.matmul(probs.to(v.dtype), v).view(b, hkv, t, g, v.shape[-1])
    return out.permute(0, 2, 1, 3, 4).reshape(b, t, hq, v.shape[-1])
