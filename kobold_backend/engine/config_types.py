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

# Sanity bounds on config.json sizes, far above any released model (Llama 3.1 405B: 126 layers, hidden 16384,
# 128 heads, vocab 128256), checked before anything is allocated from them.
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}
# The least value of a size where 1 is not enough: a context of one position holds the prompt's first token and
# leaves no room for a generated one (--max-context takes at least 2 likewise).
CONFIG_MINIMUMS = {"max_position_embeddings": 2}


def config_range(key: str) -> Tuple[int, int]:
    """The least and the largest value config.json's (or a GGUF file's) size `key` may state."""
    return CONFIG_MINIMUMS.get(key, 1), CONFIG_BOUNDS[key]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "linear" (positions divided by factor), "llama3" (frequency-dependent), "longrope"
    (Phi-3: per-frequency short/long factors; `factor` is max_position_embeddings / original), "yarn"
    (frequencies blended between interpolated and original across the `beta_fast`..`beta_slow` rotation band) or
    "proportional" (Gemma 4: only the first `partial_rotary_factor` of the frequencies rotate, all divided by
    `factor`)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: Tuple[float, ...] = ()
    long_factor: Tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
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
    """One RoPE table: its base, its scaling (None: plain) and how many leading dimensions of a head it rotates
    (0: all of head_dim); its frequencies are spread over those `dim` dimensions. Fewer rotate GLM's partial
    rotary part (`partial_rotary_factor`: the others pass through) and DeepSeek's separate `qk_rope_head_dim` part
    of its latent attention; a layer whose heads differ from the config's (Gemma 4's wider global heads) sets it to
    its own head size. engine/rope.py says how each reads its table."""

    theta: float
    scaling: Optional[RopeScaling] = None
    dim: int = 0

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
    - `ropes`: per layer, the RoPE table it uses (Gemma 3 local/global layers differ); None: the layer has no
      rotary embedding at all (Cohere 2's global layers).
    - `cache_shape`: (kv heads, key size, value size) of one cached position when the layers' attention objects
      (Layer.attn, e.g. DeepSeek's latent attention) cache something else than num_kv_heads x head_dim K and V;
      such caches are kept in the layers' dtype only (`quantized_cache` False).
    - `norm`: "rms" (RMSNorm) or "layer" (LayerNorm without bias: mean removed, Cohere); q/k norms follow it.
    - `parallel_block`: attention and MLP both read the input norm's output and are added to the residual
      together (Cohere); `post_norm` is then absent.
    - `logit_scale`: final logits are multiplied by it (Cohere).
    - `rope_interleaved`: RoPE rotates pairs of neighbouring head dimensions (2i, 2i + 1) instead of the halves
      (i, i + dim / 2); the model reorders q and k per head so the rotate-half kernels serve both.
    - `head_dims` / `kv_heads` / `intermediate_sizes`: per layer, where layers differ (Gemma 4's global layers have
      wider heads and fewer KV heads, its KV-sharing layers a double-wide MLP); empty: the config's sizes.
    - `kv_sources`: per layer, None or the earlier layer whose cache it attends over; such a layer computes no
      keys or values of its own (Gemma 4's KV sharing).
    - `activation_sparsity`: per layer, Gemma 3n's target sparsity of the MLP gate (0: dense; empty: none).
    - `attn_output_gate`: q_proj yields, per head, the query and then a gate of head_dim each; the attention output
      is multiplied by sigmoid(gate) before o_proj (Qwen3.5's and Qwen3-Next's full-attention layers).
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
    ropes: Tuple[Optional[RopeSpec], ...] = ()
    cache_shape: Tuple[int, int, int] = (0, 0, 0)
    norm: str = "rms"
    parallel_block: bool = False
    logit_scale: Optional[float] = None
    rope_interleaved: bool = False
    head_dims: Tuple[int, ...] = ()
    kv_heads: Tuple[int, ...] = ()
    intermediate_sizes: Tuple[int, ...] = ()
    kv_sources: Tuple[Optional[int], ...] = ()
    activation_sparsity: Tuple[float, ...] = ()
    attn_output_gate: bool = False

    @property
    def quantized_cache(self) -> bool:
        """Whether the 8/4-bit KV cache can hold this model's cache."""
        return self.cache_shape == (0, 0, 0)


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

    def layer_rope(self, index: int) -> Optional[RopeSpec]:
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


def whole(value: Any, key: str, where: str) -> int:
    """An integer read from a config file (a JSON int, or a float or string holding one); anything else is one
    sentence naming the key."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        number = value if isinstance(value, int) else float(value)
        if isinstance(number, float) and not number.is_integer():
            raise ValueError
        return int(number)
    except (ValueError, OverflowError):
        raise ModelFormatError(f"{where}: {key} is {value!r:.60}; a whole number is expected.") from None


def number(value: Any, key: str, where: str, positive: bool = False) -> float:
    """A finite float read from a config file (above 0 with `positive`); anything else is one sentence naming
    the key."""
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        out = float(value)
    except (ValueError, OverflowError):
        out = math.nan
    if not math.isfinite(out) or positive and out <= 0:
        raise ModelFormatError(f"{where}: {key} is {value!r:.60}; a finite number{' above 0' if positive else ''} "
                               "is expected.")
    return out


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


def rope_theta(raw: Dict[str, Any], default: float = 10000.0, where: str = "config.json") -> float:
    params = _global_rope_parameters(raw)
    if raw.get("rope_theta") is None and isinstance(params, dict) and params.get("rope_theta") is not None:
        return number(params["rope_theta"], "rope_parameters.rope_theta", where, positive=True)
    value = raw.get("rope_theta")
    return number(default if value is None else value, "rope_theta", where, positive=True)


def parse_rope_scaling(raw: Dict[str, Any], value: Any, head_dim: int, where: str) -> Optional[RopeScaling]:
    """A `rope_scaling` / `rope_parameters` object (None when absent or "default")."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{where}: rope_scaling must be an object, found {value!r}.")
    kind = value.get("rope_type") or value.get("type")
    if kind == "default":
        return None
    factor = number(value.get("factor", 1.0), "rope_scaling.factor", where, positive=True)
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=factor,
            low_freq_factor=number(value.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor", where, True),
            high_freq_factor=number(value.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor", where, True),
            original_max_position_embeddings=whole(value.get("original_max_position_embeddings", 8192),
                                                   "rope_scaling.original_max_position_embeddings", where),
        )
    if kind in ("longrope", "su"):
        return _longrope(raw, value, head_dim, where)
    if kind == "yarn":
        return _yarn(raw, value)
    if kind == "proportional":
        partial = number(value.get("partial_rotary_factor", 1.0), "rope_scaling.partial_rotary_factor", where)
        if not 0.0 <= partial <= 1.0:
            raise ModelFormatError(f"{where}: partial_rotary_factor must lie in [0, 1], found {partial!r}.")
        return RopeScaling("proportional", factor=factor, partial_rotary_factor=partial)
    raise ModelFormatError(
        f"{where}: rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope, yarn, "
        "proportional; "
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
        factors.append(tuple(number(x, f"rope_scaling.{name}", where, positive=True) for x in f))
    max_pos = whole(raw.get("max_position_embeddings", 2048), "max_position_embeddings", where)
    # transformers 5: the top-level original_max_position_embeddings (Phi-3) wins; the scaling factor is the
    # object's `factor` when given, else max_position_embeddings / original
    original = whole(raw.get("original_max_position_embeddings") or value.get("original_max_position_embeddings")
                     or max_pos, "original_max_position_embeddings", where)
    if original < 2:
        raise ModelFormatError(f"{where}: original_max_position_embeddings {original} is below 2.")
    factor = number(value.get("factor") or max_pos / original, "rope_scaling.factor", where, positive=True)
    attention = value.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = number(attention, "rope_scaling.attention_factor", where, positive=True)
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=factors[0], long_factor=factors[1], attention_factor=attention)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(raw: Dict[str, Any], value: Dict[str, Any]) -> RopeScaling:
    """YaRN as transformers computes it: without `factor`, max_position_embeddings / original; the tables'
    attention factor is `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are given (DeepSeek), else 0.1 ln(factor) + 1."""
    original = int(value.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or raw.get("max_position_embeddings", 2048))
    factor = float(value.get("factor") or int(raw.get("max_position_embeddings", 2048)) / original)
    attention = value.get("attention_factor")
    if attention is None:
        mscale, mscale_all = value.get("mscale"), value.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), beta_fast=float(value.get("beta_fast") or 32),
                       beta_slow=float(value.get("beta_slow") or 1), truncate=bool(value.get("truncate", True)))


def yarn_softmax_scale(value: Any) -> float:
    """What DeepSeek multiplies its softmax scale by under YaRN: mscale(factor, mscale_all_dim) squared (1 when the
    scaling is not YaRN or has no mscale_all_dim)."""
    if not isinstance(value, dict) or (value.get("rope_type") or value.get("type")) in (None, "default"):
        return 1.0
    mscale_all = value.get("mscale_all_dim") or 0
    return _yarn_mscale(float(value.get("factor") or 1.0), float(mscale_all)) ** 2 if mscale_all else 1.0
