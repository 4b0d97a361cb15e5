"""The ops of kobold_backend/ops/__init__.py on CPU tensors through `_ext_cpu` (fp32, fp16, bf16): shapes are
checked, outputs allocated with torch, and the kernels get addresses, strides and dtype codes by name."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from kobold_backend.ops import ggml, reference
from kobold_backend.ops.marshal import (
    DTYPE_CODES,
    GEMV_MAX_ROWS,
    attention_supported,
    call,
    check_gptq,
    check_rope_range,
    last_contiguous,
    out_tensor,
    rope_supported,
    rows,
)

# The parameter names of each binding in csrc/cpu/module_cpu.cpp, in order.
CPU_SIGNATURES: Dict[str, Tuple[str, ...]] = {
    "gptq_gemv": ("x", "x_dtype", "x_stride", "rows", "k", "perm", "qweight", "n", "scales", "zeros", "sz_dtype",
                  "group_size", "groups", "bias", "bias_dtype", "out", "out_dtype", "threads"),
    "gptq_dequantize": ("qweight", "k", "n", "scales", "zeros", "sz_dtype", "group_size", "groups", "out",
                        "threads"),
    "rms_norm": ("x", "x_stride", "residual", "r_stride", "dtype", "rows", "d", "weight", "w_dtype", "eps", "y",
                 "residual_out", "threads"),
    "rope_cache_write": ("q", "k", "v", "dtype", "qs", "ks", "vs", "b", "t", "hq", "hkv", "d", "cos", "sin",
                         "cs_dtype", "cos_stride", "sin_stride", "pos", "k_cache", "v_cache", "kcs", "vcs", "q_out",
                         "threads"),
    "decode_attention": ("q", "dtype", "q_sb", "q_sh", "b", "hq", "hkv", "d", "k_cache", "v_cache", "kcs", "vcs",
                         "seq_len", "scale", "out", "threads"),
    "silu_mul": ("gate", "up", "dtype", "n", "out", "threads"),
    "ggml_gemv": ("type", "w", "row_bytes", "n", "k", "x", "x_dtype", "x_stride", "rows", "bias", "bias_dtype",
                  "out", "out_dtype", "threads"),
    "ggml_dequantize": ("type", "w", "row_bytes", "n", "k", "out", "out_dtype", "threads"),
    "kvq_decode_attention": ("q", "q_sb", "q_sh", "b", "hq", "hkv", "d", "kd", "ks", "vd", "vs", "kds", "kss", "vds",
                             "vss", "k_bits", "v_bits", "seq_len", "scale", "window", "softcap", "out", "threads"),
}
# Weights (multiply-adds) a thread of a GEMV or dequantization gets at least: below that, waking a thread for an
# OpenMP region costs more than it saves (the kernels without an `if` clause of their own; the others have one).
MIN_WEIGHTS_PER_THREAD = 1 << 18


def threads_for(weights: int) -> int:
    """Threads for a kernel over `weights` weights: torch's count (engine/cpu_threads.py sets it), fewer for small
    work."""
    return max(1, min(torch.get_num_threads(), weights // MIN_WEIGHTS_PER_THREAD))


class CpuKernels:
    """The ops of kobold_backend/ops/__init__.py on CPU tensors through `_ext_cpu` (fp32, fp16, bf16)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def _call(self, kernel: str, weights: Optional[int] = None, **args: Any) -> None:
        """The kernel with torch's thread count, or with threads_for(weights) when the work is counted."""
        threads = torch.get_num_threads() if weights is None else threads_for(weights)
        call(self.module, kernel, CPU_SIGNATURES, threads=threads, **args)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dtype not in DTYPE_CODES or weight.dtype not in DTYPE_CODES or weight.shape != x.shape[-1:]:
            return reference.rms_norm(x, weight, eps)
        x2, w = rows(x), weight.contiguous()
        y = out_tensor(out, x.shape, x)
        self._call("rms_norm", x=x2.data_ptr(), x_stride=x2.stride(0), residual=0, r_stride=0,
                   dtype=DTYPE_CODES[x.dtype], rows=x2.shape[0], d=x2.shape[1], weight=w.data_ptr(),
                   w_dtype=DTYPE_CODES[w.dtype], eps=float(eps), y=y.data_ptr(), residual_out=0)
        return y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype not in DTYPE_CODES or residual.dtype != x.dtype or residual.shape != x.shape
                or weight.dtype not in DTYPE_CODES or weight.shape != x.shape[-1:]):
            return reference.add_rms_norm(x, residual, weight, eps)
        x2, r2, w = rows(x), rows(residual), weight.contiguous()
        y, ro = out_tensor(out, x.shape, x), out_tensor(residual_out, x.shape, x)
        self._call("rms_norm", x=x2.data_ptr(), x_stride=x2.stride(0), residual=r2.data_ptr(),
                   r_stride=r2.stride(0), dtype=DTYPE_CODES[x.dtype], rows=x2.shape[0], d=x2.shape[1],
                   weight=w.data_ptr(), w_dtype=DTYPE_CODES[w.dtype], eps=float(eps), y=y.data_ptr(),
                   residual_out=ro.data_ptr())
        return y, ro

    def gptq_dequantize(self, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if w.scales.dtype not in DTYPE_CODES or w.zeros.dtype != w.scales.dtype:
            return reference.gptq_dequantize(w)
        check_gptq(w, w.qweight.device)
        y = out_tensor(out, (w.in_features, w.out_features), w.scales)
        self._call("gptq_dequantize", weights=w.in_features * w.out_features,
                   qweight=w.qweight.data_ptr(), k=w.in_features, n=w.out_features,
                   scales=w.scales.data_ptr(), zeros=w.zeros.data_ptr(), sz_dtype=DTYPE_CODES[w.scales.dtype],
                   group_size=w.group_size, groups=w.scales.shape[0], out=y.data_ptr())
        return y

    def gptq_matmul(self, x: torch.Tensor, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (x.dim() != 2 or x.shape[1] != w.in_features or x.dtype not in DTYPE_CODES
                or w.scales.dtype not in DTYPE_CODES or w.zeros.dtype != w.scales.dtype
                or (w.bias is not None and w.bias.dtype not in DTYPE_CODES)):
            return reference.gptq_matmul(x, w)
        m = x.shape[0]
        if not (1 <= m <= GEMV_MAX_ROWS and w.group_size % 8 == 0):
            y = self._dequant_matmul(x, w)
            return y if out is None else out_tensor(out, y.shape, x).copy_(y)
        check_gptq(w, x.device)
        x2 = last_contiguous(x)
        y = out_tensor(out, (m, w.out_features), x)
        bias = w.bias
        self._call("gptq_gemv", weights=m * w.in_features * w.out_features,
                   x=x2.data_ptr(), x_dtype=DTYPE_CODES[x.dtype], x_stride=x2.stride(0), rows=m,
                   k=w.in_features, perm=0 if w.perm is None else w.perm.data_ptr(), qweight=w.qweight.data_ptr(),
                   n=w.out_features, scales=w.scales.data_ptr(), zeros=w.zeros.data_ptr(),
                   sz_dtype=DTYPE_CODES[w.scales.dtype], group_size=w.group_size, groups=w.scales.shape[0],
                   bias=0 if bias is None else bias.data_ptr(),
                   bias_dtype=DTYPE_CODES[bias.dtype] if bias is not None else 0, out=y.data_ptr(),
                   out_dtype=DTYPE_CODES[x.dtype])
        return y

    def _dequant_matmul(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        y = torch.matmul(x, self.gptq_dequantize(w).to(x.dtype))
        if w.bias is not None:
            y = y + w.bias.to(y.dtype)
        return y

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not rope_supported(q, k, v, cos, sin, k_cache, v_cache, DTYPE_CODES):
            return reference.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
        b, t, hq, d = q.shape
        check_rope_range(pos, t, k_cache.shape[2], cos.shape[0], sin.shape[0])
        q, k, v = last_contiguous(q), last_contiguous(k), last_contiguous(v)
        q_out = out_tensor(out, q.shape, q)
        self._call("rope_cache_write", q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dtype=DTYPE_CODES[q.dtype],
                   qs=q.stride()[:3], ks=k.stride()[:3], vs=v.stride()[:3], b=b, t=t, hq=hq, hkv=k.shape[2], d=d,
                   cos=cos.data_ptr(), sin=sin.data_ptr(), cs_dtype=DTYPE_CODES[cos.dtype],
                   cos_stride=cos.stride(0), sin_stride=sin.stride(0), pos=int(pos), k_cache=k_cache.data_ptr(),
                   v_cache=v_cache.data_ptr(), kcs=k_cache.stride()[:3], vcs=v_cache.stride()[:3],
                   q_out=q_out.data_ptr())
        return q_out

    def rope_cache_write_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if q.dim() != 4 or pos.numel() != 1:
            return reference.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
        return self.rope_cache_write(q, k, v, cos, sin, int(pos), k_cache, v_cache, out=out)

    def decode_attention_at(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                            length: int, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if pos.numel() != 1:
            return reference.decode_attention_at(q, k_cache, v_cache, pos, length, scale)
        return self.decode_attention(q, k_cache, v_cache, min(int(pos) + 1, length), scale, out=out)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                         scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not attention_supported(q, k_cache, v_cache, seq_len, DTYPE_CODES):
            return reference.decode_attention(q, k_cache, v_cache, seq_len, scale)
        q = last_contiguous(q)
        y = out_tensor(out, q.shape, q)
        b, hq, d = q.shape
        self._call("decode_attention", q=q.data_ptr(), dtype=DTYPE_CODES[q.dtype], q_sb=q.stride(0),
                   q_sh=q.stride(1), b=b, hq=hq, hkv=k_cache.shape[1], d=d, k_cache=k_cache.data_ptr(),
                   v_cache=v_cache.data_ptr(), kcs=k_cache.stride()[:3], vcs=v_cache.stride()[:3],
                   seq_len=int(seq_len), scale=float(scale), out=y.data_ptr())
        return y

    def kvq_decode_attention(self, q: torch.Tensor, k_cache: Any, v_cache: Any, seq_len: int, scale: float,
                             window: Optional[int] = None, softcap: Optional[float] = None) -> Optional[torch.Tensor]:
        """Attention of q [B, Hq, D] over the first seq_len positions of 8/4-bit caches (ops/kv_quant.QuantizedKV)
        (the last `window` of them with a sliding window; scores soft-capped with `softcap`), read in place; the
        output in q's dtype. None when the layout does not suit the kernel."""
        kd, ks, vd, vs = k_cache.data, k_cache.scales, v_cache.data, v_cache.scales
        if (q.dim() != 3 or not q.is_floating_point() or not 1 <= seq_len <= kd.shape[2]
                or any(t.device.type != "cpu" or t.stride(-1) != 1 for t in (kd, ks, vd, vs))):
            return None
        qf = last_contiguous(q.float())
        b, hq, d = qf.shape
        y = torch.empty((b, hq, d), dtype=torch.float32)
        self._call("kvq_decode_attention", q=qf.data_ptr(), q_sb=qf.stride(0), q_sh=qf.stride(1), b=b, hq=hq,
                   hkv=kd.shape[1], d=d, kd=kd.data_ptr(), ks=ks.data_ptr(), vd=vd.data_ptr(), vs=vs.data_ptr(),
                   kds=kd.stride()[:3], kss=ks.stride()[:3], vds=vd.stride()[:3], vss=vs.stride()[:3],
                   k_bits=k_cache.bits, v_bits=v_cache.bits, seq_len=int(seq_len), scale=float(scale),
                   window=int(window or 0), softcap=float(softcap or 0.0), out=y.data_ptr())
        return y.to(q.dtype)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate.dtype not in DTYPE_CODES or up.dtype != gate.dtype or up.shape != gate.shape:
            return reference.silu_mul(gate, up)
        g, u = gate.contiguous(), up.contiguous()
        y = out_tensor(out, gate.shape, gate)
        self._call("silu_mul", gate=g.data_ptr(), up=u.data_ptr(), dtype=DTYPE_CODES[g.dtype], n=g.numel(),
                   out=y.data_ptr())
        return y

    def ggml_place(self, w: ggml.GGMLWeight) -> ggml.GGMLWeight:
        """`w` as the CPU kernels read it: the file's layout, unchanged."""
        return w

    def ggml_dequantize(self, w: ggml.GGMLWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out_features, in_features] in `dtype`, decoded by the kernel (one rounding per value)."""
        if dtype not in DTYPE_CODES or not ggml.kernel_layout_ok(w, w.data.device):
            return ggml.ggml_dequantize(w).to(dtype)
        y = torch.empty((w.out_features, w.in_features), dtype=dtype)
        self._call("ggml_dequantize", weights=w.in_features * w.out_features,
                   type=ggml.TYPE_IDS[w.type_name], w=w.data.data_ptr(), row_bytes=w.data.shape[1],
                   n=w.out_features, k=w.in_features, out=y.data_ptr(), out_dtype=DTYPE_CODES[dtype])
        return y

    def ggml_matmul(self, x: torch.Tensor, w: ggml.GGMLWeight) -> torch.Tensor:
        """x [M, K] @ w.T (+ bias) in x's dtype: the GEMV for 1..8 rows, else kernel dequantization + one matmul."""
        if (x.dtype not in DTYPE_CODES or x.dim() != 2
                or x.shape[1] != w.in_features or not ggml.kernel_layout_ok(w, x.device)
                or (w.bias is not None and w.bias.dtype not in DTYPE_CODES)):
            return ggml.ggml_matmul(x, w)
        m = x.shape[0]
        if not 1 <= m <= GEMV_MAX_ROWS:
            y = x @ self.ggml_dequantize(w, x.dtype).t()
            return y if w.bias is None else y + w.bias.to(y.dtype)
        x2, bias = last_contiguous(x), w.bias
        bias = None if bias is None else bias.contiguous()
        y = torch.empty((m, w.out_features), dtype=x.dtype)
        self._call("ggml_gemv", weights=m * w.in_features * w.out_features,
                   type=ggml.TYPE_IDS[w.type_name], w=w.data.data_ptr(), row_bytes=w.data.shape[1],
                   n=w.out_features, k=w.in_features, x=x2.data_ptr(), x_dtype=DTYPE_CODES[x.dtype],
                   x_stride=x2.stride(0), rows=m, bias=0 if bias is None else bias.data_ptr(),
                   bias_dtype=0 if bias is None else DTYPE_CODES[bias.dtype], out=y.data_ptr(),
                   out_dtype=DTYPE_CODES[x.dtype])
        return y
