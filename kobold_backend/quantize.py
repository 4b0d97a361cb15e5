"""The project's own 4-bit GPTQ quantizer: turns a dense Llama-family safetensors folder into the GPTQ layout the
engine reads (symmetric, v1 "gptq" checkpoint format, sequential groups, embeddings and lm_head kept in fp16).

`method="gptq"` is GPTQ proper (Frantar et al., 2022): each linear's weight is quantized column by column and the
rounding error is spread over the columns not yet quantized, using the inverse Hessian `2 X^T X` of that linear's
inputs X. The inputs come from running calibration token ids through the model layer by layer, with the layers
before already quantized ("true sequential": q/k/v, then o, then gate/up, then down). `method="rtn"` rounds each
weight to the nearest level of its group and needs no calibration. Act-order (desc_act) is not implemented.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.rope import cos_sin_tables
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.gptq_weight import pack_rows
from kobold_backend.ops.reference import rms_norm, rotate_half

log = logging.getLogger(__name__)

BITS = 4
MAXQ = (1 << BITS) - 1
SYM_ZERO = (MAXQ + 1) // 2
METHODS = ("gptq", "rtn")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
COPIED_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json")
Progress = Callable[[int, int, str], None]


@dataclass
class QuantizedLinear:
    """One linear quantized to 4 bits: `w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]` with g = k // group_size."""

    q: torch.Tensor  # int64 [K, N], values 0..15
    scales: torch.Tensor  # float16 [G, N]
    zeros: torch.Tensor  # int64 [G, N], true zero points
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The weight as the engine computes it, float32 [N, K] (nn.Linear layout)."""
        groups = torch.arange(self.q.shape[0], device=self.q.device) // self.group_size
        s = self.scales.float()[groups]
        return ((self.q - self.zeros[groups]).float() * s).t().contiguous()

    def pack(self) -> Dict[str, torch.Tensor]:
        """qweight int32 [K/8, N], qzeros int32 [G, N/8] (v1: zero - 1), scales fp16 [G, N], g_idx int32 [K]."""
        k = self.q.shape[0]
        return {
            "qweight": pack_rows(self.q.cpu()),
            "qzeros": pack_int4_cols(self.zeros.cpu() - 1),
            "scales": self.scales.cpu().contiguous(),
            "g_idx": (torch.arange(k) // self.group_size).to(torch.int32),
        }


def pack_int4_cols(z: torch.Tensor) -> torch.Tensor:
    """[G, N] values 0..15 -> int32 [G, N/8] with column 8c+j in bits 4j..4j+3."""
    g, n = z.shape
    z = z.to(torch.int32).view(g, n // 8, 8)
    out = torch.zeros(g, n // 8, dtype=torch.int32, device=z.device)
    for j in range(8):
        out |= z[:, :, j] << (4 * j)
    return out


def _sym_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-column fp16 scales of a group's rows w [rows, N]: 2·max|w| / 15 (AutoGPTQ's symmetric quantizer),
    rounded to fp16 so that quantizing with them gives exactly what the engine dequantizes."""
    amax = w.abs().amax(dim=0)
    return (2 * amax / MAXQ).to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)


def _round(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + SYM_ZERO, 0, MAXQ)


def _group_size(k: int, group_size: int) -> int:
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs or gs % 8:
        raise ValueError(f"in_features {k} is not a multiple of group size {group_size} (a multiple of 8)")
    return gs


def quantize_rtn(weight: torch.Tensor, group_size: int) -> QuantizedLinear:
    """Round-to-nearest per group, symmetric: weight [N, K] (nn.Linear layout)."""
    w = weight.detach().float().t()  # [K, N]
    k, n = w.shape
    gs = _group_size(k, group_size)
    scales = torch.stack([_sym_scales(w[g * gs:(g + 1) * gs]) for g in range(k // gs)])
    s = scales.float().repeat_interleave(gs, dim=0)
    q = _round(w, s).to(torch.int64)
    return QuantizedLinear(q=q, scales=scales, zeros=torch.full_like(q[: k // gs], SYM_ZERO), group_size=gs)


def quantize_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01, block_size: int = 128
) -> QuantizedLinear:
    """GPTQ: weight [N, K], hessian [K, K] = sum of x xᵀ over the calibration inputs x of this linear.

    Columns are quantized in order; a group's scales are chosen when its first column is reached, from the
    group's columns as updated by the errors of the columns before (so block_size is a multiple of the group).
    Inputs that were always zero get weight 0. `damp` adds damp·mean(diag H) to the diagonal.
    """
    w = weight.detach().float().clone()  # [N, K]; GPTQ works on columns = input features
    n, k = w.shape
    gs = _group_size(k, group_size)
    h = hessian.detach().float().clone().to(w.device)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    hinv = _inverse_hessian_cholesky(h, damp)
    block = max(gs, block_size // gs * gs)
    q = torch.zeros(n, k, dtype=torch.int64, device=w.device)
    scales = torch.zeros(k // gs, n, dtype=torch.float16, device=w.device)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        scale = torch.ones(n, device=w.device)
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:
                s16 = _sym_scales(w1[:, i:i + gs].t())
                scales[col // gs] = s16
                scale = s16.float()
            x = w1[:, i]
            qi = _round(x, scale)
            q[:, col] = qi.to(torch.int64)
            err = (x - (qi - SYM_ZERO) * scale) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    zeros = torch.full((k // gs, n), SYM_ZERO, dtype=torch.int64, device=w.device)
    return QuantizedLinear(q=q.t().contiguous(), scales=scales, zeros=zeros, group_size=gs)


def _inverse_hessian_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹ after damping; the damping grows tenfold until H is positive definite."""
    h64 = h.double()
    mean_diag = torch.diag(h64).mean()
    for attempt in range(6):
        damped = h64 + (damp * 10 ** attempt) * mean_diag * torch.eye(h.shape[0], dtype=h64.dtype, device=h.device)
        chol, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            return torch.linalg.cholesky(inv, upper=True).float()
    raise ValueError("the calibration Hessian is not positive definite even after damping")


def output_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error ||X(W - Ŵ)ᵀ|| / ||X Wᵀ|| over the calibration inputs, from H = XᵀX."""
    d = (weight.float() - quantized.float()).to(hessian.device)
    w = weight.float().to(hessian.device)
    num = torch.einsum("nk,kl,nl->", d, hessian.float(), d)
    den = torch.einsum("nk,kl,nl->", w, hessian.float(), w)
    return math.sqrt(max(float(num), 0.0) / max(float(den), 1e-30))


class _Hessian:
    """Running sum of x xᵀ over the rows of the inputs seen."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h += x.t() @ x
        self.rows += x.shape[0]


def _batches(x: torch.Tensor, size: int) -> List[torch.Tensor]:
    return list(torch.split(x, size, dim=0))


class _LayerRunner:
    """A dense Llama decoder layer in float32, run over the calibration batch; weights can be swapped for their
    dequantized versions as they are quantized."""

    def __init__(self, config: ModelConfig, weights: Dict[str, torch.Tensor], cos: torch.Tensor,
                 sin: torch.Tensor) -> None:
        self.cfg = config
        self.w = weights
        self.cos = cos
        self.sin = sin

    def attn_input(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.w["input_layernorm"], self.cfg.rms_norm_eps)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = F.linear(x, self.w["self_attn.q_proj"]).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = F.linear(x, self.w["self_attn.k_proj"]).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = F.linear(x, self.w["self_attn.v_proj"]).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        c, s = self.cos[:t].view(1, 1, t, -1), self.sin[:t].view(1, 1, t, -1)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        if cfg.num_heads != cfg.num_kv_heads:
            k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
            v = v.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.head_dim ** -0.5)
        return out.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim)

    def mlp_input(self, h: torch.Tensor, attn: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        h2 = h + F.linear(attn, self.w["self_attn.o_proj"])
        return h2, rms_norm(h2, self.w["post_attention_layernorm"], self.cfg.rms_norm_eps)

    def down_input(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(F.linear(x, self.w["mlp.gate_proj"])) * F.linear(x, self.w["mlp.up_proj"])

    def output(self, h2: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return h2 + F.linear(m, self.w["mlp.down_proj"])


def quantize_checkpoint(
    src: Union[str, Path],
    dst: Union[str, Path],
    calibration: Optional[torch.Tensor] = None,
    group_size: int = 128,
    method: str = "gptq",
    damp: float = 0.01,
    device: str = "cpu",
    batch_size: int = 16,
    progress: Optional[Progress] = None,
) -> Dict[str, object]:
    """Quantize the dense folder `src` into `dst` (created; files there are overwritten).

    `calibration` is a LongTensor [n, T] of token ids (required for "gptq", ignored by "rtn"). Writes
    model.safetensors, config.json (with `quantization_config`), quantize_config.json and copies the tokenizer
    and generation config. Returns a report: settings and, per linear, the relative output error on the
    calibration inputs of the method used and of round-to-nearest (for comparison).
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    src, dst = Path(src), Path(dst)
    config = ModelConfig.from_dir(src)
    if config.is_gptq:
        raise ModelFormatError(f"{src} is already quantized.")
    if method == "gptq" and (calibration is None or calibration.dim() != 2):
        raise ValueError("GPTQ needs calibration token ids as a LongTensor [n, T]")
    dev = torch.device(device)
    dst.mkdir(parents=True, exist_ok=True)
    total = config.num_layers + 2
    out: Dict[str, torch.Tensor] = {}
    errors: Dict[str, Dict[str, float]] = {}
    with WeightReader(src) as reader:
        names = reader.names()
        layer_names = {f"model.layers.{i}.{p}.weight" for i in range(config.num_layers) for p in PROJECTIONS}
        for name in names:
            if name not in layer_names and not name.startswith("model.layers."):
                out[name] = reader.get(name).to(torch.float16).contiguous()
        _tick(progress, 1, total, "embeddings")
        hidden = None
        cos = sin = None
        if method == "gptq":
            assert calibration is not None
            embed = reader.get("model.embed_tokens.weight").float().to(dev)
            hidden = _batches(embed[calibration.to(dev)], batch_size)
            cos, sin = cos_sin_tables(config, calibration.shape[1], dev, torch.float32)
            del embed
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            weights = {name[len(prefix):-len(".weight")]: reader.get(name).float().to(dev)
                       for name in names if name.startswith(prefix)}
            missing = [p for p in PROJECTIONS if p not in weights]
            if missing:
                raise ModelFormatError(f"{src}: tensor {prefix}{missing[0]}.weight is missing.")
            for name in weights:
                if name not in PROJECTIONS:
                    out[f"{prefix}{name}.weight"] = weights[name].to(torch.float16).cpu()
            if method == "gptq":
                assert hidden is not None and cos is not None and sin is not None
                hidden = _quantize_layer_gptq(config, weights, hidden, cos, sin, group_size, damp, prefix, out,
                                              errors)
            else:
                for p in PROJECTIONS:
                    ql = quantize_rtn(weights[p], group_size)
                    _store(out, prefix + p, ql)
            _tick(progress, i + 2, total, f"layer {i + 1}/{config.num_layers}")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    qconfig = {"bits": BITS, "group_size": group_size, "desc_act": False, "sym": True, "true_sequential": True,
               "damp_percent": damp, "static_groups": False, "checkpoint_format": "gptq", "quant_method": "gptq",
               "model_file_base_name": "model", "quantizer": f"kobold_backend.quantize ({method})"}
    (dst / "quantize_config.json").write_text(json.dumps(qconfig, indent=2) + "\n")
    raw = {k: v for k, v in config.raw.items() if k != "dtype"}  # transformers 5 writes "dtype"
    raw.update(torch_dtype="float16", quantization_config=qconfig)
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in COPIED_FILES:
        if (src / name).is_file() and src.resolve() != dst.resolve():
            shutil.copyfile(src / name, dst / name)
    _tick(progress, total, total, "written")
    return {"method": method, "bits": BITS, "group_size": group_size, "sym": True, "checkpoint_format": "gptq",
            "damp": damp, "calibration_shape": None if calibration is None else list(calibration.shape),
            "relative_output_error": errors}


def _tick(progress: Optional[Progress], done: int, total: int, message: str) -> None:
    if progress is not None:
        progress(done, total, message)


def _store(out: Dict[str, torch.Tensor], prefix: str, ql: QuantizedLinear) -> None:
    for key, tensor in ql.pack().items():
        out[f"{prefix}.{key}"] = tensor


def _quantize_layer_gptq(
    config: ModelConfig,
    weights: Dict[str, torch.Tensor],
    hidden: List[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    group_size: int,
    damp: float,
    prefix: str,
    out: Dict[str, torch.Tensor],
    errors: Dict[str, Dict[str, float]],
) -> List[torch.Tensor]:
    """Quantize one layer's seven linears in true-sequential order; return the layer's outputs computed with
    the quantized weights (the next layer's calibration inputs)."""
    run = _LayerRunner(config, weights, cos, sin)
    dev = hidden[0].device

    def quantize(names: Tuple[str, ...], inputs: List[torch.Tensor]) -> None:
        acc = _Hessian(inputs[0].shape[-1], dev)
        for x in inputs:
            acc.add(x)
        for name in names:
            dense = weights[name]
            ql = quantize_gptq(dense, acc.h, group_size, damp)
            deq = ql.dequantize().to(dev)
            errors[prefix + name] = {
                "gptq": output_error(dense, deq, acc.h),
                "rtn": output_error(dense, quantize_rtn(dense, group_size).dequantize().to(dev), acc.h),
            }
            _store(out, prefix + name, ql)
            weights[name] = deq

    with torch.no_grad():
        xs = [run.attn_input(h) for h in hidden]
        quantize(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), xs)
        attn = [run.attention(x) for x in xs]
        del xs
        quantize(("self_attn.o_proj",), attn)
        mids = [run.mlp_input(h, a) for h, a in zip(hidden, attn)]
        del attn
        quantize(("mlp.gate_proj", "mlp.up_proj"), [m[1] for m in mids])
        downs = [run.down_input(m[1]) for m in mids]
        quantize(("mlp.down_proj",), downs)
        return [run.output(m[0], d) for m, d in zip(mids, downs)]
