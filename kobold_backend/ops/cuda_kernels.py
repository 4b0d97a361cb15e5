"""The ops on fp16 CUDA tensors through `_ext_cuda` (other dtypes use the torch reference): shapes and
alignment are checked, outputs allocated with torch, and the kernels get addresses, strides, the device and the
current stream by name, plus a per-(device, stream) workspace for split-K GEMV and split-sequence attention."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from kobold_backend.ops import ggml, reference
from kobold_backend.ops.exl2_weight import exl2_dequantize as reference_exl2
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

CUDA_CODES: Dict[torch.dtype, int] = {torch.float16: 1}
# Scratch per (device, stream) for split-K GEMV and split-sequence attention: 16 MiB + 256 KiB.
WS_FLOATS = 1 << 22
WS_COUNTERS = 1 << 16
EXL2_GEMV_MAX_ROWS = 4  # rows the EXL2 GEMV takes (csrc/cuda/exl2.cu); more go through dequantize + matmul
GGML_GEMV_MAX_ROWS = 4  # rows the GGML GEMV takes on CUDA (csrc/cuda/ggml.cu: fewer instances, smaller wheels)
# Rows the integer GGML GEMV takes (csrc/cuda/ggml_q8.cu: speculative verification's 5..8 too).
GGML_Q8_MAX_ROWS = 8
# Rows the tensor-core GPTQ product takes (csrc/cuda/gptq_mma.cu) past the GEMV's: a chat turn's new tokens read the
# packed weights once; longer prompt chunks dequantize once for cuBLAS.
MMA_MAX_ROWS = 128
# The GGML GEMV: "classic" (csrc/cuda/ggml.cu, fp16 activations), "q8" (csrc/cuda/ggml_q8.cu, int8 activations
# and dp4a) or "q8-pdl" (q8 with the GEMV launched programmatically behind its activation quantization, sm_90+);
# KOBOLD_BACKEND_GGML_KERNEL picks one per process, CudaKernels.ggml_kernel per instance.
GGML_KERNELS = ("classic", "q8", "q8-pdl")
DEFAULT_GGML_KERNEL = os.environ.get("KOBOLD_BACKEND_GGML_KERNEL", "q8-pdl")
# Q4_0, Q8_0 and Q6_K weights placed on CUDA are re-laid out for the integer GEMV's 16-byte loads (ops/ggml.py
# `repack`) unless the GGML kernel is "classic" or KOBOLD_BACKEND_GGML_REPACK=0 (the file's blocks, 2-byte loads).
GGML_REPACK = os.environ.get("KOBOLD_BACKEND_GGML_REPACK", "1") != "0"

# gptq_gemv's `variant`: chosen by shape, or one kernel forced (the whole-K ones only where their shape check
# passes; the 512-thread one takes 1 or 2 rows; the lean one, csrc/cuda/gptq_lean.cu, the 256-thread one's shapes,
# with or without programmatic dependent launch).
GEMV_AUTO, GEMV_SPLIT_K, GEMV_WHOLE_K, GEMV_WHOLE_K_512, GEMV_WHOLE_K_LEAN, GEMV_WHOLE_K_LEAN_PDL = 0, 1, 2, 3, 4, 5
GEMV_AUTO_CLASSIC = 6  # chosen by shape with the 256/512-thread whole-K kernels where GEMV_AUTO runs the lean one
# The rule GEMV_AUTO follows in this process: KOBOLD_BACKEND_GEMV_RULE=classic benchmarks the previous kernels.
DEFAULT_GEMV = GEMV_AUTO_CLASSIC if os.environ.get("KOBOLD_BACKEND_GEMV_RULE") == "classic" else GEMV_AUTO

# The parameter names of each binding in csrc/cuda/module_cuda.cpp, in order.
CUDA_SIGNATURES: Dict[str, Tuple[str, ...]] = {
    "gptq_gemv": ("x", "x_stride", "rows", "k", "perm", "qweight", "n", "scales", "zeros", "group_size", "groups",
                  "bias", "out", "ws", "variant", "device", "stream"),
    "gptq_dequantize": ("qweight", "k", "n", "scales", "zeros", "group_size", "groups", "out", "device", "stream"),
    "gptq_mma": ("x", "x_stride", "rows", "k", "qweight", "n", "scales", "zeros", "group_size", "groups", "bias",
                 "out", "partial", "splits", "device", "stream"),
    "exl2_gemv": ("x", "x_stride", "rows", "k", "perm", "q_weight", "n", "n_stored", "q_scale", "q_scale_max",
                  "chunks", "chunk_groups", "bias", "out", "ws", "device", "stream"),
    "exl2_dequantize": ("k", "perm", "q_weight", "n", "n_stored", "q_scale", "q_scale_max", "chunks",
                        "chunk_groups", "out", "device", "stream"),
    "rms_norm": ("x", "x_stride", "residual", "r_stride", "rows", "d", "weight", "w_dtype", "eps", "y",
                 "residual_out", "device", "stream"),
    "rope_cache_write": ("q", "k", "v", "qs", "ks", "vs", "b", "t", "hq", "hkv", "d", "cos", "sin", "cs_dtype",
                         "cos_stride", "sin_stride", "pos", "pos_dev", "max_pos", "k_cache", "v_cache", "kcs", "vcs",
                         "q_out", "device", "stream"),
    "decode_attention": ("q", "q_sb", "q_sh", "b", "hq", "hkv", "d", "k_cache", "v_cache", "kcs", "vcs", "seq_len",
                         "pos_dev", "scale", "out", "ws", "device", "stream"),
    "silu_mul": ("gate", "up", "n", "out", "device", "stream"),
    "ggml_gemv": ("type", "w", "row_bytes", "n", "k", "x", "x_stride", "rows", "bias", "out", "device", "stream"),
    "ggml_gemv_q8": ("type", "w", "row_bytes", "n", "k", "x", "x_stride", "rows", "bias", "out", "scratch", "pdl",
                     "device", "stream"),
    "ggml_dequantize": ("type", "w", "row_bytes", "n", "k", "out", "device", "stream"),
    "kvq_decode_attention": ("q", "q_f16", "out_f16", "q_sb", "q_sh", "b", "hq", "hkv", "d", "kd", "ks", "vd", "vs",
                             "kds", "kss", "vds", "vss", "k_bits", "v_bits", "seq_len", "pos_dev", "scale", "window",
                             "softcap", "out", "ws", "device", "stream"),
    "kvq_rope_write": ("q", "k", "v", "qs", "ks", "vs", "b", "t", "hq", "hkv", "d", "cos", "sin", "cs_dtype",
                       "cos_stride", "sin_stride", "pos", "pos_dev", "max_pos", "kd", "kscale", "vd", "vscale", "kds",
                       "kss", "vds", "vss", "k_bits", "v_bits", "q_out", "device", "stream"),
}


class CudaKernels:
    """The ops on fp16 CUDA tensors through `_ext_cuda` (other dtypes use the torch reference)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._workspaces: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._sms: Dict[int, int] = {}
        # torch's own fast accessor of the current cudaStream_t (what its compiler uses), if this torch has it.
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if DEFAULT_GGML_KERNEL not in GGML_KERNELS:
            raise ValueError(f"KOBOLD_BACKEND_GGML_KERNEL must be one of {', '.join(GGML_KERNELS)}, "
                             f"not {DEFAULT_GGML_KERNEL!r}")
        self.ggml_kernel = DEFAULT_GGML_KERNEL

    def _stream(self, device: torch.device) -> int:
        if self._raw_stream is not None:
            return int(self._raw_stream(device.index))
        return torch.cuda.current_stream(device).cuda_stream

    def _workspace(self, device: torch.device, stream: int) -> Tuple[int, int, int, int]:
        key = (device.index, stream)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = (torch.empty(WS_FLOATS, dtype=torch.float32, device=device),
                  torch.zeros(WS_COUNTERS, dtype=torch.int32, device=device))
            self._workspaces[key] = ws
        return ws[0].data_ptr(), WS_FLOATS, ws[1].data_ptr(), WS_COUNTERS

    def _call(self, kernel: str, device: torch.device, **args: Any) -> None:
        """Run `kernel` on `device`'s current stream (and workspace, for the kernels that take one)."""
        stream = self._stream(device)
        if "ws" in CUDA_SIGNATURES[kernel]:
            args["ws"] = self._workspace(device, stream)
        call(self.module, kernel, CUDA_SIGNATURES, device=device.index, stream=stream, **args)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (x.dtype != torch.float16 or weight.dtype not in (torch.float16, torch.float32)
                or weight.shape != x.shape[-1:] or weight.device != x.device):
            return reference.rms_norm(x, weight, eps)
        x2, w = rows(x), weight.contiguous()
        y = out_tensor(out, x.shape, x)
        self._call("rms_norm", x.device, x=x2.data_ptr(), x_stride=x2.stride(0), residual=0, r_stride=0,
                   rows=x2.shape[0], d=x2.shape[1], weight=w.data_ptr(), w_dtype=DTYPE_CODES[w.dtype],
                   eps=float(eps), y=y.data_ptr(), residual_out=0)
        return y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype != torch.float16 or residual.dtype != x.dtype or residual.shape != x.shape
                or weight.dtype not in (torch.float16, torch.float32) or weight.shape != x.shape[-1:]
                or residual.device != x.device or weight.device != x.device):
            return reference.add_rms_norm(x, residual, weight, eps)
        x2, r2, w = rows(x), rows(residual), weight.contiguous()
        y, ro = out_tensor(out, x.shape, x), out_tensor(residual_out, x.shape, x)
        self._call("rms_norm", x.device, x=x2.data_ptr(), x_stride=x2.stride(0), residual=r2.data_ptr(),
                   r_stride=r2.stride(0), rows=x2.shape[0], d=x2.shape[1], weight=w.data_ptr(),
                   w_dtype=DTYPE_CODES[w.dtype], eps=float(eps), y=y.data_ptr(), residual_out=ro.data_ptr())
        return y, ro

    def gptq_dequantize(self, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if w.scales.dtype != torch.float16 or w.zeros.dtype != torch.float16:
            return reference.gptq_dequantize(w)
        dev = w.qweight.device
        check_gptq(w, dev)
        y = out_tensor(out, (w.in_features, w.out_features), w.scales)
        self._call("gptq_dequantize", dev, qweight=w.qweight.data_ptr(), k=w.in_features, n=w.out_features,
                   scales=w.scales.data_ptr(), zeros=w.zeros.data_ptr(), group_size=w.group_size,
                   groups=w.scales.shape[0], out=y.data_ptr())
        return y

    def gptq_matmul(self, x: torch.Tensor, w: Any, out: Optional[torch.Tensor] = None,
                    variant: int = GEMV_AUTO) -> torch.Tensor:
        """x @ dequantize(w); 1..8 rows through the GEMV (`variant`: GEMV_AUTO picks the kernel by shape;
        GEMV_SPLIT_K, GEMV_WHOLE_K, GEMV_WHOLE_K_512, GEMV_WHOLE_K_LEAN and GEMV_WHOLE_K_LEAN_PDL force one, for
        tools/gptq_gemv_bench.py), up to MMA_MAX_ROWS through the tensor-core product, more through cuBLAS."""
        if (x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != torch.float16
                or w.scales.dtype != torch.float16 or w.zeros.dtype != torch.float16
                or (w.bias is not None and w.bias.dtype != torch.float16)):
            return reference.gptq_matmul(x, w)
        m, n = x.shape[0], w.out_features
        dev = x.device
        check_gptq(w, dev)
        gemv_ok = (1 <= m <= GEMV_MAX_ROWS and w.group_size % 8 == 0 and n % 4 == 0
                   and w.qweight.data_ptr() % 16 == 0 and w.scales.data_ptr() % 8 == 0
                   and w.zeros.data_ptr() % 8 == 0)
        if not gemv_ok:
            y = self._mma(x, w) if m <= MMA_MAX_ROWS else None
            if y is None:
                y = self._dequant_matmul(x, w)
            return y if out is None else out_tensor(out, y.shape, x).copy_(y)
        x2 = last_contiguous(x)
        y = out_tensor(out, (m, n), x)
        self._call("gptq_gemv", dev, x=x2.data_ptr(), x_stride=x2.stride(0), rows=m, k=w.in_features,
                   perm=0 if w.perm is None else w.perm.data_ptr(), qweight=w.qweight.data_ptr(), n=n,
                   scales=w.scales.data_ptr(), zeros=w.zeros.data_ptr(), group_size=w.group_size,
                   groups=w.scales.shape[0], bias=0 if w.bias is None else w.bias.data_ptr(), out=y.data_ptr(),
                   variant=DEFAULT_GEMV if variant == GEMV_AUTO else variant)
        return y

    def exl2_dequantize(self, w: Any) -> torch.Tensor:
        """fp16 [K, N] in input-feature order (the torch reference when the groups are not whole 32-row chunks)."""
        if w.chunks is None or w.in_features % 32:
            return reference_exl2(w).t()
        dev = w.q_weight.device
        y = torch.empty((w.in_features, w.out_features), dtype=torch.float16, device=dev)
        self._call("exl2_dequantize", dev, k=w.in_features, perm=w.perm.data_ptr(), q_weight=w.q_weight.data_ptr(),
                   n=w.out_features, n_stored=w.stored_columns, q_scale=w.q_scale.data_ptr(),
                   q_scale_max=w.q_scale_max.data_ptr(), chunks=w.chunks.data_ptr(),
                   chunk_groups=w.chunk_groups.data_ptr(), out=y.data_ptr())
        return y

    def exl2_matmul(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        """x [M, K] fp16 @ w.T (+ bias): the GEMV for 1..4 rows, else dequantize + one matmul."""
        if x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != torch.float16:
            y = x @ reference_exl2(w).to(x.dtype).t()
            return y if w.bias is None else y + w.bias.to(y.dtype)
        m = x.shape[0]
        gemv_ok = (1 <= m <= EXL2_GEMV_MAX_ROWS and w.chunks is not None and w.stored_columns % 32 == 0
                   and w.q_weight.data_ptr() % 16 == 0 and (w.bias is None or w.bias.dtype == torch.float16))
        if not gemv_ok:
            y = torch.matmul(x, self.exl2_dequantize(w))
            return y if w.bias is None else y + w.bias.to(y.dtype)
        x2 = last_contiguous(x)
        y = torch.empty((m, w.out_features), dtype=torch.float16, device=x.device)
        self._call("exl2_gemv", x.device, x=x2.data_ptr(), x_stride=x2.stride(0), rows=m, k=w.in_features,
                   perm=w.perm.data_ptr(), q_weight=w.q_weight.data_ptr(), n=w.out_features,
                   n_stored=w.stored_columns, q_scale=w.q_scale.data_ptr(), q_scale_max=w.q_scale_max.data_ptr(),
                   chunks=w.chunks.data_ptr(), chunk_groups=w.chunk_groups.data_ptr(),
                   bias=0 if w.bias is None else w.bias.data_ptr(), out=y.data_ptr())
        return y

    def _mma(self, x: torch.Tensor, w: Any) -> Optional[torch.Tensor]:
        """x @ dequantize(w) on the tensor cores reading the packed weights (None where the shape or the loaded
        module does not suit csrc/cuda/gptq_mma.cu: K or N not a multiple of 64, group size not one of 8)."""
        k, n = w.in_features, w.out_features
        if (k % 64 or n % 64 or w.group_size % 8
                or w.qweight.data_ptr() % 16 or w.scales.data_ptr() % 8 or w.zeros.data_ptr() % 8):
            return None
        dev = x.device
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        x2 = x.contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
        index = dev.index or 0  # a CUDA tensor's device always has its index
        sms = self._sms.get(index)
        if sms is None:
            sms = self._sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        # slices of K until there are ~4 blocks of 64 columns per multiprocessor
        splits = max(1, min(k // 64, 64, -(-4 * sms // (n // 64))))
        m = x2.shape[0]
        partial = torch.empty((splits, (m + 15) // 16 * 16, n), dtype=torch.float32, device=dev)
        y = torch.empty((m, n), dtype=torch.float16, device=dev)
        self._call("gptq_mma", dev, x=x2.data_ptr(), x_stride=x2.stride(0), rows=m, k=k, qweight=w.qweight.data_ptr(),
                   n=n, scales=w.scales.data_ptr(), zeros=w.zeros.data_ptr(), group_size=w.group_size,
                   groups=w.scales.shape[0], bias=0 if w.bias is None else w.bias.data_ptr(), out=y.data_ptr(),
                   partial=partial.data_ptr(), splits=splits)
        return y

    def _dequant_matmul(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        y = torch.matmul(x, self.gptq_dequantize(w))
        if w.bias is not None:
            y = y + w.bias
        return y

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self._rope_ok(q, k, v, cos, sin, k_cache, v_cache):
            return reference.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
        check_rope_range(pos, q.shape[1], k_cache.shape[2], cos.shape[0], sin.shape[0])
        return self._rope(q, k, v, cos, sin, int(pos), 0, k_cache, v_cache, out)

    def rope_cache_write_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """T tokens at the positions pos.., `pos` a device tensor read by the kernel (graph-capturable)."""
        if (not self._rope_ok(q, k, v, cos, sin, k_cache, v_cache) or pos.numel() != 1
                or pos.dtype != torch.int64 or pos.device != q.device):
            return reference.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
        return self._rope(q, k, v, cos, sin, 0, pos.data_ptr(), k_cache, v_cache, out)

    @staticmethod
    def _rope_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        dev = q.device
        return (rope_supported(q, k, v, cos, sin, k_cache, v_cache, CUDA_CODES)
                and all(t.device == dev for t in (k, v, cos, sin, k_cache, v_cache)))

    def _rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pos: int, pos_dev: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
              out: Optional[torch.Tensor]) -> torch.Tensor:
        b, t, hq, d = q.shape
        q, k, v = last_contiguous(q), last_contiguous(k), last_contiguous(v)
        q_out = out_tensor(out, q.shape, q)
        self._call("rope_cache_write", q.device, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), qs=q.stride()[:3],
                   ks=k.stride()[:3], vs=v.stride()[:3], b=b, t=t, hq=hq, hkv=k.shape[2], d=d, cos=cos.data_ptr(),
                   sin=sin.data_ptr(), cs_dtype=DTYPE_CODES[cos.dtype], cos_stride=cos.stride(0),
                   sin_stride=sin.stride(0), pos=pos, pos_dev=pos_dev,
                   max_pos=min(k_cache.shape[2], cos.shape[0], sin.shape[0]), k_cache=k_cache.data_ptr(),
                   v_cache=v_cache.data_ptr(), kcs=k_cache.stride()[:3], vcs=v_cache.stride()[:3],
                   q_out=q_out.data_ptr())
        return q_out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                         scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self._attention_ok(q, k_cache, v_cache, seq_len):
            return reference.decode_attention(q, k_cache, v_cache, seq_len, scale)
        return self._attention(q, k_cache, v_cache, seq_len, 0, scale, out)

    def decode_attention_at(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                            length: int, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention over cache[:, :, :length] with positions after the device tensor `pos` masked."""
        if (not self._attention_ok(q, k_cache, v_cache, length) or pos.numel() != 1 or pos.dtype != torch.int64
                or pos.device != q.device):
            return reference.decode_attention_at(q, k_cache, v_cache, pos, length, scale)
        return self._attention(q, k_cache, v_cache, length, pos.data_ptr(), scale, out)

    @staticmethod
    def _attention_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int) -> bool:
        dev = q.device
        return (attention_supported(q, k_cache, v_cache, seq_len, CUDA_CODES) and k_cache.device == dev
                and v_cache.device == dev and _attention_layout_ok(q, k_cache, v_cache))

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int, pos_dev: int,
                   scale: float, out: Optional[torch.Tensor]) -> torch.Tensor:
        q = last_contiguous(q)
        y = out_tensor(out, q.shape, q)
        b, hq, d = q.shape
        self._call("decode_attention", q.device, q=q.data_ptr(), q_sb=q.stride(0), q_sh=q.stride(1), b=b, hq=hq,
                   hkv=k_cache.shape[1], d=d, k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                   kcs=k_cache.stride()[:3], vcs=v_cache.stride()[:3], seq_len=int(seq_len), pos_dev=pos_dev,
                   scale=float(scale), out=y.data_ptr())
        return y

    def kvq_decode_attention(self, q: torch.Tensor, k_cache: Any, v_cache: Any, seq_len: int,
                             pos: Optional[torch.Tensor], scale: float, window: Optional[int] = None,
                             softcap: Optional[float] = None) -> Optional[torch.Tensor]:
        """Attention of q [B, Hq, D] (fp16 or fp32) over the first seq_len positions of 8/4-bit caches
        (ops/kv_quant.QuantizedKV), positions after the device tensor `pos` masked when given, only the last
        `window` of the rest with a sliding window, scores soft-capped with `softcap`; the output in q's dtype.
        None when the layout does not suit the kernel (the caller falls back to the torch definition)."""
        kd, ks, vd, vs = k_cache.data, k_cache.scales, v_cache.data, v_cache.scales
        dev = q.device
        kalign = 8 if k_cache.bits == 8 else 4
        if (q.dtype not in (torch.float16, torch.float32) or q.dim() != 3
                or any(t.device != dev or t.stride(-1) != 1 for t in (kd, ks, vd, vs))
                or kd.data_ptr() % kalign or any(s % kalign for s in kd.stride()[:3])
                or vd.data_ptr() % 2 or any(s % 2 for s in vd.stride()[:3])
                or not 1 <= seq_len <= kd.shape[2]
                or (pos is not None and (pos.numel() != 1 or pos.dtype != torch.int64 or pos.device != dev))):
            return None
        q = last_contiguous(q)
        b, hq, d = q.shape
        f16 = int(q.dtype == torch.float16)
        y = torch.empty((b, hq, d), dtype=q.dtype, device=dev)
        self._call("kvq_decode_attention", dev, q=q.data_ptr(), q_f16=f16, out_f16=f16, q_sb=q.stride(0),
                   q_sh=q.stride(1), b=b, hq=hq, hkv=kd.shape[1], d=d, kd=kd.data_ptr(), ks=ks.data_ptr(),
                   vd=vd.data_ptr(), vs=vs.data_ptr(), kds=kd.stride()[:3], kss=ks.stride()[:3],
                   vds=vd.stride()[:3], vss=vs.stride()[:3], k_bits=k_cache.bits, v_bits=v_cache.bits,
                   seq_len=int(seq_len), pos_dev=0 if pos is None else pos.data_ptr(), scale=float(scale),
                   window=int(window or 0), softcap=float(softcap or 0.0), out=y.data_ptr())
        return y

    def kvq_rope_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       pos: int, pos_dev: Optional[torch.Tensor], k_cache: Any, v_cache: Any
                       ) -> Optional[torch.Tensor]:
        """RoPE on q [B, T, Hq, D] and k, then k and v quantized into 8/4-bit caches at pos.. (or at the device
        tensor `pos_dev`); returns the rotated q, or None when the layout does not suit the kernel."""
        dev = q.device
        if (q.dtype != torch.float16 or q.dim() != 4 or k.dim() != 4
                or any(x.dtype != q.dtype or x.device != dev for x in (k, v))
                or tuple(k.shape) != tuple(v.shape) or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]
                or cos.dtype not in (torch.float16, torch.float32) or sin.dtype != cos.dtype
                or cos.dim() != 2 or cos.shape[1] != q.shape[3] or sin.shape != cos.shape
                or any(x.device != dev or x.stride(-1) != 1 for x in (cos, sin, k_cache.data, k_cache.scales,
                                                                       v_cache.data, v_cache.scales))
                or tuple(k_cache.shape[:2]) != (k.shape[0], k.shape[2]) or k_cache.head_dim != q.shape[3]
                or tuple(v_cache.shape) != tuple(k_cache.shape)
                or (pos_dev is not None and (pos_dev.numel() != 1
                                             or pos_dev.dtype != torch.int64 or pos_dev.device != dev))):
            return None
        b, t, hq, d = q.shape
        max_pos = min(k_cache.shape[2], cos.shape[0], sin.shape[0])
        if pos_dev is None:
            check_rope_range(pos, t, k_cache.shape[2], cos.shape[0], sin.shape[0])
        q, k, v = last_contiguous(q), last_contiguous(k), last_contiguous(v)
        q_out = torch.empty((b, t, hq, d), dtype=q.dtype, device=dev)
        kd, ks, vd, vs = k_cache.data, k_cache.scales, v_cache.data, v_cache.scales
        self._call("kvq_rope_write", dev, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), qs=q.stride()[:3],
                   ks=k.stride()[:3], vs=v.stride()[:3], b=b, t=t, hq=hq, hkv=k.shape[2], d=d, cos=cos.data_ptr(),
                   sin=sin.data_ptr(), cs_dtype=DTYPE_CODES[cos.dtype], cos_stride=cos.stride(0),
                   sin_stride=sin.stride(0), pos=0 if pos_dev is not None else int(pos),
                   pos_dev=0 if pos_dev is None else pos_dev.data_ptr(), max_pos=max_pos, kd=kd.data_ptr(),
                   kscale=ks.data_ptr(), vd=vd.data_ptr(), vscale=vs.data_ptr(), kds=kd.stride()[:3],
                   kss=ks.stride()[:3], vds=vd.stride()[:3], vss=vs.stride()[:3], k_bits=k_cache.bits,
                   v_bits=v_cache.bits, q_out=q_out.data_ptr())
        return q_out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate.dtype != torch.float16 or up.dtype != gate.dtype or up.shape != gate.shape or up.device != gate.device:
            return reference.silu_mul(gate, up)
        g, u = gate.contiguous(), up.contiguous()
        y = out_tensor(out, gate.shape, gate)
        self._call("silu_mul", gate.device, gate=g.data_ptr(), up=u.data_ptr(), n=g.numel(), out=y.data_ptr())
        return y

    def ggml_place(self, w: ggml.GGMLWeight) -> ggml.GGMLWeight:
        """`w` as the GEMV reads it best: Q4_0 / Q8_0 / Q6_K re-laid out for 16-byte loads (ops/ggml.py
        `repack`) when this instance runs the integer GEMV, the module reads that layout and GGML_REPACK is on."""
        if (GGML_REPACK and self.ggml_kernel != "classic"
                and w.type_name in ggml.REPACKED and ggml.kernel_layout_ok(w, w.data.device)):
            return ggml.repack(w)
        return w

    def ggml_dequantize(self, w: ggml.GGMLWeight) -> torch.Tensor:
        """The weight [out_features, in_features] in fp16, decoded by the kernel (a re-laid-out weight from a
        temporary copy in the file's layout)."""
        w = ggml.unpack(w)
        if not ggml.kernel_layout_ok(w, w.data.device):
            return ggml.ggml_dequantize(w).half()
        y = torch.empty((w.out_features, w.in_features), dtype=torch.float16, device=w.data.device)
        self._call("ggml_dequantize", w.data.device, type=ggml.TYPE_IDS[w.type_name], w=w.data.data_ptr(),
                   row_bytes=w.data.shape[1], n=w.out_features, k=w.in_features, out=y.data_ptr())
        return y

    def ggml_matmul(self, x: torch.Tensor, w: ggml.GGMLWeight) -> torch.Tensor:
        """fp16 x [M, K] @ w.T (+ bias): the GEMV for 1..4 rows (the integer one: 1..8), else kernel
        dequantization + one cuBLAS GEMM (a re-laid-out weight: the integer GEMV, else dequantization through the
        file's layout)."""
        if (x.dtype != torch.float16 or x.dim() != 2
                or x.shape[1] != w.in_features or not ggml.kernel_layout_ok(w, x.device, repacked=True)
                or (w.bias is not None and w.bias.dtype != torch.float16)):
            return ggml.ggml_matmul(x, w)
        m = x.shape[0]
        repacked = w.type_name != w.file_type_name  # only the integer GEMV reads it
        q8 = (self.ggml_kernel != "classic" or repacked) and _q8_layout_ok(w)
        most = GGML_Q8_MAX_ROWS if q8 else GGML_GEMV_MAX_ROWS
        if not 1 <= m <= most or (repacked and not q8):
            y = x @ self.ggml_dequantize(w).t()
            return y if w.bias is None else y + w.bias
        x2 = x if x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 else x.contiguous()
        bias = None if w.bias is None else w.bias.contiguous()
        y = torch.empty((m, w.out_features), dtype=torch.float16, device=x.device)
        args = dict(type=ggml.TYPE_IDS[w.type_name], w=w.data.data_ptr(), row_bytes=w.data.shape[1],
                    n=w.out_features, k=w.in_features, x=x2.data_ptr(), x_stride=x2.stride(0), rows=m,
                    bias=0 if bias is None else bias.data_ptr(), out=y.data_ptr())
        if q8:
            # int8 activations [M, K] and their (scale, scaled sum) per 16: M * K * 3 / 2 bytes
            scratch = torch.empty(m * w.in_features * 3 // 2, dtype=torch.uint8, device=x.device)
            self._call("ggml_gemv_q8", x.device, scratch=scratch.data_ptr(), pdl=self.ggml_kernel == "q8-pdl",
                       **args)
        else:
            self._call("ggml_gemv", x.device, **args)
        return y


def _q8_layout_ok(w: ggml.GGMLWeight) -> bool:
    """The integer GEMV's 16-byte loads of Q4_K/Q5_K blocks and re-laid-out rows need 16-byte aligned rows (rows
    of 144 / 176-byte blocks, or padded to 16 bytes)."""
    if w.type_name in ggml.REPACKED.values():
        return w.data.data_ptr() % 16 == 0
    return w.type_name not in ("Q4_K", "Q5_K") or w.data.data_ptr() % 16 == 0


def _attention_layout_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The CUDA kernel's 16-byte K-row and 4-byte V-row loads: head_dim % 8 == 0, <= 256 (kMaxDim: a head is held
    in shared memory; wider heads, Gemma 4's 512-wide global ones, take the torch definition), aligned strides."""
    d = q.shape[-1]
    ks, vs = k_cache.stride(), v_cache.stride()
    return (d % 8 == 0 and d <= 256 and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 4 == 0
            and all(s % 8 == 0 for s in ks[:3]) and all(s % 2 == 0 for s in vs[:3]))
