"""The parsed model configuration's types, below both the architecture descriptions (engine/architectures, which
read a config) and the reader (engine/config.py, which looks the description up): RoPE scaling and how it is
parsed, quantization settings, the per-model `Features` and per-layer `RopeSpec` a description gives, and
`ConfigData`, the fields of a `ModelConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from kobold_backend.errors import ModelFormatError


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "linear" (positions divided by factor), "llama3" (frequency-dependent), "longrope"
    (Phi-3: per-frequency short/long factors; `factor` is max_position_embeddings / original) or "proportional"
    (Gemma 4: only the first `partial_rotary_factor` of the frequencies rotate, all divided by `factor`)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: Tuple[float, ...] = ()
    long_factor: Tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """Quantization settings: `method` "gptq" (4 or 8 bits), "awq" (AutoAWQ GEMM, 4-bit with zero points) or
    "exl2" (exllamav2's mixed 2-8 bit groups; `bits` 0, each linear carries its own widths)."""

    bits: int = 4
    group_size: int = -1
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    method: str = "gptq"


EXL2_QUANT = QuantConfig(bits=0, group_size=-1, sym=True, checkpoint_format="exl2", method="exl2")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: its base, its scaling (None: plain) and the head size it rotates (0: the config's)."""

    theta: float
    scaling: Optional[RopeScaling] = None
    head_dim: int = 0

    @property
    def attention_factor(self) -> float:
        """What the tables' cos and sin are multiplied by (LongRoPE's attention scaling; 1 otherwise)."""
        return 1.0 if self.scaling is None else self.scaling.attention_factor


@dataclass(frozen=True)
class Features:
    """The switches of one model that the generic forward reads. Defaults are Llama's.

    - `biases`: projections that carry a bias (`q_proj`, ..., or fused `qkv_proj`).
    - `qk_norm`: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
    - `norm_offset`: added to every RMSNorm weight at load (Gemma's `(1 + weight)`).
    - `attn_out_norm` / `mlp_out_norm`: RMSNorm on the attention / MLP output before the residual add (Gemma 2/3).
    - `activation`: the gate activation of the MLP (`silu`, `gelu_tanh`).
    - `embed_scale`: embeddings are multiplied by it (in the compute dtype) before the first layer (Gemma).
    - `attn_scale`: multiplies q·k (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5).
    - `attn_softcap` / `final_softcap`: `c * tanh(x / c)` on attention scores / final logits (Gemma 2).
    - `windows`: per layer, the sliding-window length (None: full attention).
    - `ropes`: per layer, the RoPE table it uses (Gemma 3 local/global layers differ).
    - `head_dims` / `kv_heads` / `intermediate_sizes`: per layer, where layers differ (Gemma 4's global layers have
      wider heads and fewer KV heads, its KV-sharing layers a double-wide MLP); empty: the config's sizes.
    - `kv_sources`: per layer, None or the earlier layer whose cache it attends over; such a layer computes no
      keys or values of its own (Gemma 4's KV sharing).
    - `activation_sparsity`: per layer, Gemma 3n's target sparsity of the MLP gate (0: dense; empty: none).
    """

    biases: Tuple[str, ...] = ()
    qk_norm: bool = False
    norm_offset: float = 0.0
    attn_out_norm: bool = False
    mlp_out_norm: bool = False
    activation: str = "silu"
    embed_scale: Optional[float] = None
    attn_scale: Optional[float] = None
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    windows: Tuple[Optional[int], ...] = ()
    ropes: Tuple[RopeSpec, ...] = ()
    head_dims: Tuple[int, ...] = ()
    kv_heads: Tuple[int, ...] = ()
    intermediate_sizes: Tuple[int, ...] = ()
    kv_sources: Tuple[Optional[int], ...] = ()
    activation_sparsity: Tuple[float, ...] = ()


@dataclass
class ConfigData:
    """A model's configuration as read (config.py's ModelConfig reads it): sizes, norms, RoPE, special ids,
    quantization, the architecture description (`arch`) and its `features`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = 1
    eos_token_ids: Tuple[int, ...] = (2,)
    model_type: str = "llama"
    torch_dtype: str = "float16"
    quant: Optional[QuantConfig] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)
    architecture: str = "LlamaForCausalLM"
    arch: Optional[Any] = field(default=None, repr=False)  # its engine/architectures description
    features: Features = field(default=None, repr=False)  # type: ignore[assignment]

    @property
    def is_gptq(self) -> bool:
        return self.quant is not None

    def layer_window(self, index: int) -> Optional[int]:
        """The sliding-window length of layer `index`, None for full attention."""
        return self.features.windows[index]

    def layer_rope(self, index: int) -> RopeSpec:
        return self.features.ropes[index]

    def layer_head_dim(self, index: int) -> int:
        return self.features.head_dims[index] if self.features.head_dims else self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        return self.features.kv_heads[index] if self.features.kv_heads else self.num_kv_heads

    def layer_intermediate(self, index: int) -> int:
        f = self.features
        return f.intermediate_sizes[index] if f.intermediate_sizes else self.intermediate_size

    def layer_kv_source(self, index: int) -> Optional[int]:
        return self.features.kv_sources[index] if self.features.kv_sources else None


def rope_settings(raw: Dict[str, Any]) -> Any:
    """The RoPE scaling object: `rope_scaling` (transformers 4 and the Hub's configs) or `rope_parameters`
    (what transformers 5 writes; it holds rope_theta too). Where `rope_parameters` is keyed by layer type
    (Gemma 3), the global layers' entry is the model's; the description reads the others."""
    return raw.get("rope_scaling") or _global_rope_parameters(raw)


def _global_rope_parameters(raw: Dict[str, Any]) -> Any:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return params["full_attention"]
    return params


def rope_theta(raw: Dict[str, Any], default: float = 10000.0) -> float:
    params = _global_rope_parameters(raw)
    if raw.get("rope_theta") is None and isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta") or default)


def parse_rope_scaling(raw: Dict[str, Any], value: Any, head_dim: int, where: str) -> Optional[RopeScaling]:
    """A `rope_scaling` / `rope_parameters` object (None when absent or "default")."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{where}: rope_scaling must be an object, found {value!r}.")
    kind = value.get("rope_type") or value.get("type")
    if kind == "default":
        return None
    factor = float(value.get("factor", 1.0))
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=float(value.get("low_freq_factor", 1.0)),
            high_freq_factor=float(value.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(value.get("original_max_position_embeddings", 8192)),
        )
    if kind in ("longrope", "su"):
        return _longrope(raw, value, head_dim, where)
    if kind == "proportional":
        partial = float(value.get("partial_rotary_factor", 1.0))
        if not 0.0 <= partial <= 1.0:
            raise ModelFormatError(f"{where}: partial_rotary_factor must lie in [0, 1], found {partial!r}.")
        return RopeScaling("proportional", factor=factor, partial_rotary_factor=partial)
    raise ModelFormatError(
        f"{where}: rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope, proportional; "
        "NTK alpha is a load option)."
    )


def _longrope(raw: Dict[str, Any], value: Dict[str, Any], head_dim: int, where: str) -> RopeScaling:
    """Phi-3's LongRoPE ("su"): per-frequency divisors (short below the original context, long above it) and an
    attention factor sqrt(1 + ln(s) / ln(original)) with s = max_position_embeddings / original, unless given."""
    factors = []
    for name in ("short_factor", "long_factor"):
        f = value.get(name)
        if not isinstance(f, list) or len(f) != head_dim // 2:
            raise ModelFormatError(f"{where}: rope_scaling {name} must be a list of head_dim / 2 = {head_dim // 2} "
                                   f"numbers, found {f!r:.60}.")
        factors.append(tuple(float(x) for x in f))
    max_pos = int(raw.get("max_position_embeddings", 2048))
    # transformers 5: the top-level original_max_position_embeddings (Phi-3) wins; the scaling factor is the
    # object's `factor` when given, else max_position_embeddings / original
    original = int(raw.get("original_max_position_embeddings") or value.get("original_max_position_embeddings")
                   or max_pos)
    factor = float(value.get("factor") or max_pos / original)
    attention = value.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=factors[0], long_factor=factors[1], attention_factor=float(attention))
