"""The operations the model calls, dispatched per device to the native kernels where loaded, else to torch.

`kobold_backend.ops.reference` defines each op; `kobold_backend.ops.native` loads the compiled kernels once
(on the first op that sees a CPU or CUDA tensor) and each call below only picks the loaded implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch

from kobold_backend.ops import ggml, kv_quant, native, reference
from kobold_backend.ops.exl2_weight import EXL2Weight, exl2_dequantize
from kobold_backend.ops.kv_quant import QuantizedKV
from kobold_backend.ops.reference import linear

if TYPE_CHECKING:
    from kobold_backend.ops.ggml import GGMLWeight
    from kobold_backend.ops.gptq_weight import GPTQWeight

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "attention",
    "clamped_swiglu_mul",
    "decode_attention",
    "decode_attention_at",
    "decode_attention_rows",
    "exl2_matmul",
    "gelu_tanh_mul",
    "ggml_matmul",
    "ggml_place",
    "gptq_dequantize",
    "gptq_matmul",
    "layer_norm",
    "linear",
    "rms_norm",
    "rope_cache_write",
    "rope_cache_write_at",
    "silu_mul",
]


#: Graph decode over an fp16 cache of at least this many positions (the captured length) runs the templated
#: flash-decoding kernel (csrc/cuda/flash_decode.cu): on the H200 its q8-cache decode of the 7B Q4_K_M file was
#: 246.9 tok/s at 4000 where torch's matmuls over the fp16 cache gave 197.6 (docs/performance.md)
NATIVE_DECODE_FROM = 1024


def _quantized(k_cache: Any, v_cache: Any) -> bool:
    """Whether either cache is in the 8/4-bit layout (ops/kv_quant.py reads and writes those)."""
    return isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV)


def _kernels(x: torch.Tensor) -> Any:
    if x.is_cuda:
        return native.cuda_kernels()
    if x.is_cpu:
        return native.cpu_kernels()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = _kernels(x)
    return reference.rms_norm(x, weight, eps) if k is None else k.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    k = _kernels(x)
    return reference.add_rms_norm(x, residual, weight, eps) if k is None else k.add_rms_norm(x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without bias (Cohere); torch only: it runs once per layer, beside the projections."""
    return reference.layer_norm(x, weight, eps)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    return reference.add_layer_norm(x, residual, weight, eps)


def gptq_matmul(x: torch.Tensor, w: GPTQWeight) -> torch.Tensor:
    k = _kernels(x) if w.bits == 4 else None  # the kernels read 4-bit words
    return reference.gptq_matmul(x, w) if k is None else k.gptq_matmul(x, w)


def exl2_matmul(x: torch.Tensor, w: EXL2Weight) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias): the CUDA kernels for fp16 on the GPU, else dequantize (torch) and one matmul."""
    k = native.cuda_kernels() if x.is_cuda else None
    if k is not None:
        return k.exl2_matmul(x, w)
    y = x @ exl2_dequantize(w).to(x.dtype).t()
    return y if w.bias is None else y + w.bias.to(y.dtype)


def ggml_matmul(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) for a linear in a GGML block format: the native kernels where loaded (and built
    with the GGML kernels), else dequantization + matmul in torch (ops/ggml.py)."""
    k = _kernels(x)
    return ggml.ggml_matmul(x, w) if k is None else k.ggml_matmul(x, w)


def ggml_place(w: GGMLWeight) -> GGMLWeight:
    """A GGML weight just placed on its device, as that device's kernels read it best (on CUDA: Q4_0, Q8_0 and
    Q6_K re-laid out for the integer GEMV, cuda_kernels.GGML_REPACK); elsewhere `w` itself."""
    k = _kernels(w.data)
    return w if k is None else k.ggml_place(w)


def gptq_dequantize(w: GPTQWeight) -> torch.Tensor:
    k = _kernels(w.qweight) if w.bits == 4 else None
    return reference.gptq_dequantize(w) if k is None else k.gptq_dequantize(w)


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
    if _quantized(k_cache, v_cache):
        return kv_quant.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
    kern = _kernels(q)
    if kern is None:
        return reference.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
    return kern.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)


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
    if _quantized(k_cache, v_cache):
        return kv_quant.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
    kern = _kernels(q)
    if kern is None:
        return reference.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
    return kern.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)


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
    if _quantized(k_cache, v_cache):
        return kv_quant.decode_attention_at(q, k_cache, v_cache, pos, length, scale, window, softcap, sinks)
    k = _kernels(q)
    if (k is None or (q.is_cuda and length < NATIVE_DECODE_FROM)
            or window is not None or softcap is not None or sinks is not None or v_cache.shape[-1] != q.shape[-1]):
        # Short caches: torch's batched matmuls, which beat the first native kernel everywhere (8 vs 35 us at 128
        # positions on the H200). A sliding window's start depends on the device position, which the torch
        # definition masks on the device.
        return reference.decode_attention_at(q, k_cache, v_cache, pos, length, scale, window, softcap, sinks)
    return k.decode_attention_at(q, k_cache, v_cache, pos, length, scale)


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
    """T query rows [B, T, Hq, D] at the device positions pos..pos+T-1, each over the cached positions up to its
    own (a speculative verification or a chat turn in a CUDA graph); one row is decode_attention_at's case."""
    if q.shape[1] == 1:
        return decode_attention_at(q[:, 0], k_cache, v_cache, pos, length, scale, window, softcap,
                                   sinks).unsqueeze(1)
    if _quantized(k_cache, v_cache):
        return kv_quant.decode_attention_rows(q, k_cache, v_cache, pos, length, scale, window, softcap, sinks)
    return reference.decode_attention_rows(q, k_cache, v_cache, pos, length, scale, window, softcap, sinks)


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
    """One query row against cached positions [seq_len - window, seq_len) (all of them without a window).

    Soft-capping, attention sinks and values of another head size than the keys take the torch definition."""
    if _quantized(k_cache, v_cache):
        return kv_quant.decode_attention(q, k_cache, v_cache, seq_len, scale, window, softcap, sinks)
    k = _kernels(q)
    if k is None or softcap is not None or sinks is not None or v_cache.shape[-1] != q.shape[-1]:
        return reference.decode_attention(q, k_cache, v_cache, seq_len, scale, window, softcap, sinks)
    if window is not None and seq_len > window:
        # the kernels read the cache through strides, so the window is a view starting at its first position
        start = seq_len - window
        return k.decode_attention(q, k_cache[:, :, start:], v_cache[:, :, start:], window, scale)
    return k.decode_attention(q, k_cache, v_cache, seq_len, scale)


def attention(
    q: torch.Tensor,
    k_cache: Any,
    v_cache: Any,
    pos: int,
    scale: float,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of a prompt chunk q [B, T, Hq, D] at positions pos.. over the cache (reference.attention)."""
    if _quantized(k_cache, v_cache):
        return kv_quant.attention(q, k_cache, v_cache, pos, scale, window, softcap, sinks)
    return reference.attention(q, k_cache, v_cache, pos, scale, window, softcap, sinks)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    k = _kernels(gate)
    return reference.silu_mul(gate, up) if k is None else k.silu_mul(gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return reference.gelu_tanh_mul(gate, up)


def clamped_swiglu_mul(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return reference.clamped_swiglu_mul(gate, up, alpha, limit)
