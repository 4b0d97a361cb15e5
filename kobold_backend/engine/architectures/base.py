"""What an architecture description is: how to read its config.json and where its tensors live.

An `Architecture` turns the raw config into `Features` (switches the generic `Model` reads: biases, q/k norm,
norm placement, activation, scales, soft-capping, per-layer sliding windows and RoPE) and names the checkpoint
tensors of one decoder layer (`LayerLayout`). The loader and the model never branch on `model_type`; a new family
is one module in this package that subclasses `Architecture` and registers itself (see docs/dev/architectures.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kobold_backend.engine.config_types import ConfigData, Features, RopeSpec, rope_settings
from kobold_backend.errors import ModelFormatError

__all__ = ["Architecture", "Features", "LayerLayout", "Linear", "RopeSpec", "activation", "layer_type_windows",
           "lookup", "partial_ropes", "positive_window", "register", "supported_class_names", "supported_model_types",
           "uniform_windows"]


@dataclass(frozen=True)
class Linear:
    """One projection of a decoder layer: its checkpoint prefix (under `model.layers.N.`) and its [in, out] size.

    `parts` names the logical projections a fused checkpoint tensor holds, in output order, with their sizes
    (e.g. Phi-3's `self_attn.qkv_proj` holds q_proj, k_proj, v_proj). `quantized=False`: GPTQ checkpoints keep it
    dense (MoE routers); the loader reads either way, this only tells the planner and the bench what to expect."""

    prefix: str
    in_features: int
    out_features: int
    parts: Tuple[Tuple[str, int], ...] = ()
    quantized: bool = True


@dataclass(frozen=True)
class LayerLayout:
    """The checkpoint tensors of one decoder layer, keyed by the name the model gives them.

    `linears` keys are projection names (`q_proj`, ..., `qkv_proj`, `gate_up_proj`); `norms` keys are Layer fields
    (`input_norm`, `post_norm` = the norm before the MLP, `attn_out_norm`, `mlp_out_norm`, `q_norm`, `k_norm`) with
    (checkpoint name without `.weight`, size or shape: Cohere's q/k norms are [heads, head_dim]). `linears` keys
    must be `Layer` projection fields."""

    linears: Dict[str, Linear]
    norms: Dict[str, Tuple[str, Any]]
    biased: Tuple[str, ...] = ()
    #: linears the architecture's `build_mlp` loads itself (routed experts, router): listed so the split planner
    #: and the bench's synthetic checkpoints know them; the generic loader does not read them
    mlp_linears: Dict[str, Linear] = field(default_factory=dict)
    #: other dense tensors of the layer the generic loader reads into Layer fields, Layer field -> (checkpoint
    #: name under `model.layers.N.`, shape): gpt-oss's `sinks`
    extras: Dict[str, Tuple[str, Tuple[int, ...]]] = field(default_factory=dict)
    #: other tensors `build_mlp` or `layer_extras` reads itself (checkpoint name under `model.layers.N.` -> shape),
    #: listed so the split planner counts them: GLM-4.5's router bias, Gemma 4's layer scalar and stacked experts
    tensors: Dict[str, Tuple[int, ...]] = field(default_factory=dict)


class Architecture:
    """Base description: the Llama layout. Subclasses override what differs and call `register`."""

    #: config.json `model_type` values this description reads
    model_types: Tuple[str, ...] = ()
    #: config.json `architectures` class names it accepts
    class_names: Tuple[str, ...] = ()
    #: fused checkpoint projections: {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
    fused: Dict[str, str] = {}

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        """Read the architecture-specific switches. The default is Llama's (with its attention_bias/mlp_bias)."""
        biases: Tuple[str, ...] = ()
        if raw.get("attention_bias"):
            biases += ("q_proj", "k_proj", "v_proj", "o_proj")
        if raw.get("mlp_bias"):
            biases += ("gate_proj", "up_proj", "down_proj")
        return Features(biases=biases, activation=activation(raw, where))

    def layout(self, config: ConfigData, index: int) -> LayerLayout:
        """Where layer `index` keeps its tensors; the default is the Llama layout with optional fused projections."""
        h, inter = config.hidden_size, config.intermediate_size
        qd, kvd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        linears: Dict[str, Linear] = {}
        q_out = 2 * qd if config.features.attn_output_gate else qd  # the query, then its gate, per head
        if "qkv_proj" in self.fused:
            linears["qkv_proj"] = Linear(self.fused["qkv_proj"], h, qd + 2 * kvd,
                                         (("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)))
        else:
            linears.update(q_proj=Linear("self_attn.q_proj", h, q_out), k_proj=Linear("self_attn.k_proj", h, kvd),
                           v_proj=Linear("self_attn.v_proj", h, kvd))
        linears["o_proj"] = Linear("self_attn.o_proj", qd, h)
        if "gate_up_proj" in self.fused:
            linears["gate_up_proj"] = Linear(self.fused["gate_up_proj"], h, 2 * inter,
                                             (("gate_proj", inter), ("up_proj", inter)))
        else:
            linears.update(gate_proj=Linear("mlp.gate_proj", h, inter), up_proj=Linear("mlp.up_proj", h, inter))
        linears["down_proj"] = Linear("mlp.down_proj", inter, h)
        f = config.features
        norms = {"input_norm": ("input_layernorm", h)}
        if f.attn_out_norm:
            norms["attn_out_norm"] = ("post_attention_layernorm", h)
            norms["post_norm"] = ("pre_feedforward_layernorm", h)
        else:
            norms["post_norm"] = ("post_attention_layernorm", h)
        if f.mlp_out_norm:
            norms["mlp_out_norm"] = ("post_feedforward_layernorm", h)
        if f.qk_norm:
            norms["q_norm"] = ("self_attn.q_norm", config.head_dim)
            norms["k_norm"] = ("self_attn.k_norm", config.head_dim)
        return LayerLayout(linears, norms, f.biases)

    def build_attention(self, loader: Any, config: ConfigData, index: int) -> Optional[Any]:
        """Hook for an attention that is not q/k/v projections (DeepSeek's latent attention): an object the layer
        calls instead (see engine/mla.py), or None. Its `o_proj` stays in the layout."""
        return None

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The config of the decoder this engine runs; a multimodal checkpoint's description returns its
        `text_config` (with what it needs from the outer config). The default is `raw` itself."""
        return raw

    def stored_names(self, names: List[str]) -> Dict[str, str]:
        """Tensors the checkpoint stores under other names than the engine reads (`model.layers.N...`,
        `model.embed_tokens`, `model.norm`, `lm_head`): engine name -> stored name. The default is none."""
        return {}

    def unused_layers(self, raw: Dict[str, Any]) -> int:
        """How many layers the checkpoint stores after the decoder stack that inference does not run."""
        return 0

    def state_bytes(self, config: ConfigData, index: int, elem: int) -> Optional[int]:
        """Bytes of the fixed-size state layer `index` keeps in the cache instead of K/V (one sequence, `elem`:
        bytes of the layer's dtype), or None when the layer keeps K/V per position (the default)."""
        return None

    def build_mixer(self, loader: Any, config: ConfigData, index: int) -> Optional[Any]:
        """Hook for a token mixer other than the generic attention (linear attention): an object
        called as `mixer(x, cache, index, pos)` (see `Layer.mixer`); the layout then lists no q/k/v/o. None: the
        generic attention."""
        return None

    def build_mlp(self, loader: Any, config: ConfigData, index: int) -> Optional[Any]:
        """Hook for a non-dense MLP (routed experts): return an object the layer calls instead of gate/up/down.

        `loader` is the loader's per-layer context (see engine/loader.py `LayerLoader`). None: the dense MLP."""
        return None

    def layer_extras(self, loader: Any, config: ConfigData, index: int) -> Dict[str, Any]:
        """Hook for `Layer` fields beyond the layout's projections and norms (Gemma 4: `v_norm`, `per_layer_gate`,
        `out_scale`), read through the same per-layer `loader`. Default: none."""
        return {}

    def model_tensors(self, config: ConfigData) -> Dict[str, Tuple[int, ...]]:
        """Model-level tensors the hooks below read beside the embedding (name -> shape), for the split planner and
        `config_shapes`. Default: none."""
        return {}


    def residual_streams(self, loader: Any, config: ConfigData) -> Optional[Any]:
        """Hook for parallel residual streams around the layers (engine/altup.py `AltUpStreams`: `expand(h)` before
        the first layer, `collapse(streams)` after the last), read like `per_layer_embedding`. Default: none."""
        return None

    def per_layer_embedding(self, loader: Any, config: ConfigData) -> Optional[Any]:
        """Hook for a model-level per-layer input (engine/per_layer_input.py `PerLayerEmbedding`), read through a
        `loader` at prefix `model` on the embedding's device. Default: none."""
        return None


def partial_ropes(raw: Dict[str, Any], config: ConfigData, where: str, default: float) -> Tuple[RopeSpec, ...]:
    """One RoPE table per layer rotating head_dim * partial_rotary_factor dimensions (`default` when the config
    leaves the factor out)."""
    params = rope_settings(raw) or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default)) \
        if isinstance(params, dict) else raw.get("partial_rotary_factor", default)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ModelFormatError(f"{where}: partial_rotary_factor must be in (0, 1], found {factor!r}.")
    dim = int(config.head_dim * factor)
    if dim % 2:
        raise ModelFormatError(f"{where}: partial_rotary_factor {factor} rotates an odd {dim} dimensions per head.")
    return (RopeSpec(config.rope_theta, config.rope_scaling, dim),) * config.num_layers


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation(raw: Dict[str, Any], where: str, default: str = "silu") -> str:
    """The MLP gate activation from `hidden_act` (or Gemma's `hidden_activation`), as a `model.ACTIVATIONS` key."""
    name = raw.get("hidden_act") or raw.get("hidden_activation") or default
    if name not in _ACTIVATIONS:
        raise ModelFormatError(f"{where}: hidden_act {name!r} is not supported (supported: "
                               f"{', '.join(sorted(_ACTIVATIONS))}).")
    return _ACTIVATIONS[name]


def uniform_windows(raw: Dict[str, Any], config: ConfigData, where: str) -> Tuple[Optional[int], ...]:
    """`sliding_window` applied to every layer (Mistral); null or absent: full attention everywhere."""
    window = positive_window(raw.get("sliding_window"), where)
    return (window,) * config.num_layers


def layer_type_windows(raw: Dict[str, Any], config: ConfigData, window: Optional[int],
                       default_types: Tuple[str, ...], where: str) -> Tuple[Optional[int], ...]:
    """`window` on the layers config.json's `layer_types` (else `default_types`) marks "sliding_attention"."""
    types = raw.get("layer_types") or default_types
    if not isinstance(types, (list, tuple)) or len(types) != config.num_layers:
        raise ModelFormatError(f"{where}: layer_types must list one type per layer ({config.num_layers}).")
    unknown = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if unknown:
        raise ModelFormatError(f"{where}: layer type {unknown[0]!r} is not supported "
                               "(supported: sliding_attention, full_attention).")
    return tuple(window if t == "sliding_attention" else None for t in types)


def positive_window(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFormatError(f"{where}: sliding_window must be a positive integer or null, found {value!r}.")
    return int(value)


_REGISTRY: Dict[str, Architecture] = {}
_BY_CLASS: Dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for name in arch.model_types:
        _REGISTRY[name] = arch
    for name in arch.class_names:
        _BY_CLASS[name] = arch
    return arch


def supported_model_types() -> Tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def supported_class_names() -> Tuple[str, ...]:
    return tuple(sorted(_BY_CLASS))


def lookup(model_type: Any, class_names: Any, where: str) -> Architecture:
    """The description for a config's `model_type`; its `architectures` must name classes of the same family."""
    arch = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        names = supported_model_types()  # a multimodal family's *_text alias goes unnamed beside its own name
        listed = [n for n in names if not (n.endswith("_text") and n[: -len("_text")] in names)]
        raise ModelFormatError(f"{where}: model_type {model_type!r} is not supported; this engine runs "
                               f"{', '.join(listed)}.")
    for name in class_names or []:
        if name not in arch.class_names:
            raise ModelFormatError(
                f"{where}: architecture {name!r} does not match model_type {model_type!r} "
                f"(expected one of {', '.join(arch.class_names)})."
            )
    return arch
