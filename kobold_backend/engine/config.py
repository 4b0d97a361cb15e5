"""Model configuration read once from a model folder: config.json, generation_config.json and GPTQ settings.

Anything this engine cannot run is refused here with one sentence naming what was found.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from kobold_backend.errors import ModelFormatError

if TYPE_CHECKING:
    from kobold_backend.engine.architectures import Architecture, Features, RopeSpec

# Sanity bounds on config.json sizes, far above any released model (Llama 3.1 405B: 126 layers, hidden 16384,
# 128 heads, vocab 128256), checked before anything is allocated from them.
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "linear" (positions divided by factor), "llama3" (frequency-dependent) or "longrope"
    (Phi-3: per-frequency short/long factors; `factor` is max_position_embeddings / original)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: Tuple[float, ...] = ()
    long_factor: Tuple[float, ...] = ()
    attention_factor: float = 1.0


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


@dataclass
class ModelConfig:
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
    arch: Optional[Architecture] = field(default=None, repr=False)
    features: Features = field(default=None, repr=False)  # type: ignore[assignment]

    @property
    def is_gptq(self) -> bool:
        return self.quant is not None

    @property
    def description(self) -> Architecture:
        """The architecture description this config was read with (see engine/architectures)."""
        assert self.arch is not None, "ModelConfig built without from_dict has no architecture"
        return self.arch

    def layer_window(self, index: int) -> Optional[int]:
        """The sliding-window length of layer `index`, None for full attention."""
        return self.features.windows[index]

    def layer_rope(self, index: int) -> RopeSpec:
        return self.features.ropes[index]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of a model folder, or of a .gguf file (from its metadata; no tensor data is read)."""
        folder = Path(path)
        if folder.suffix == ".gguf" and folder.is_file():
            from kobold_backend.engine.gguf.checkpoint import gguf_config

            return gguf_config(folder)
        if not folder.is_dir():
            raise ModelFormatError(f"Model folder {folder} does not exist or is not a folder.")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            gguf = sorted(folder.glob("*.gguf"))
            if gguf:
                raise ModelFormatError(
                    f"{folder} holds a GGUF file ({gguf[0].name}) but no config.json; give the .gguf file itself "
                    f"as the model ({folder / gguf[0].name})."
                )
            raise ModelFormatError(f"{folder} has no config.json; it is not a Hugging Face model folder.")
        raw = _read_json(cfg_path)
        return cls.from_dict(raw, folder)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], folder: Optional[Path] = None) -> ModelConfig:
        from kobold_backend.engine.architectures import lookup

        where = str(folder) if folder is not None else "config.json"
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        arch = lookup(model_type, archs, where)
        try:
            hidden = int(raw["hidden_size"])
            inter = int(raw["intermediate_size"])
            layers = int(raw["num_hidden_layers"])
            heads = int(raw["num_attention_heads"])
            vocab = int(raw["vocab_size"])
            for key, value in (("hidden_size", hidden), ("intermediate_size", inter), ("num_hidden_layers", layers),
                               ("num_attention_heads", heads), ("vocab_size", vocab)):
                _check_bound(where, key, value)
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            max_pos = int(raw.get("max_position_embeddings", 2048))
        except KeyError as exc:
            raise ModelFormatError(f"{where}: config.json lacks the required key {exc.args[0]!r}.") from None
        except ModelFormatError:
            raise
        except (TypeError, ValueError, OverflowError):
            raise ModelFormatError(f"{where}: config.json holds a size that is not a whole number.") from None
        for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim),
                           ("max_position_embeddings", max_pos)):
            _check_bound(where, key, value)
        if heads % kv_heads:
            raise ModelFormatError(
                f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}."
            )
        if head_dim % 2:
            raise ModelFormatError(f"{where}: head_dim {head_dim} is odd; RoPE needs an even head size.")
        bos, eos = _special_ids(raw, folder)
        config = cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(raw),
            rope_scaling=parse_rope_scaling(raw, rope_settings(raw), head_dim, where),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_ids=eos,
            model_type=str(model_type),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float16"),
            quant=_quant_config(raw, folder, where),
            raw=raw,
            architecture=str(archs[0]) if archs else arch.class_names[0],
            arch=arch,
        )
        config.features = _complete(arch.features(raw, config, where), config)
        return config


def _complete(features: Features, config: ModelConfig) -> Features:
    """Fill the per-layer lists a description left empty: full attention and the config's one RoPE table."""
    from dataclasses import replace

    from kobold_backend.engine.architectures import RopeSpec

    n = config.num_layers
    windows = features.windows or (None,) * n
    ropes = features.ropes or (RopeSpec(config.rope_theta, config.rope_scaling),) * n
    if len(windows) != n or len(ropes) != n:
        raise ModelFormatError(f"{config.model_type}: the description gives per-layer settings for "
                               f"{len(windows)}/{len(ropes)} layers, the config has {n}.")
    return replace(features, windows=tuple(windows), ropes=tuple(ropes))


def _check_bound(where: str, key: str, value: int) -> None:
    if not 1 <= value <= CONFIG_BOUNDS[key]:
        raise ModelFormatError(f"{where}: {key} {value} is outside 1..{CONFIG_BOUNDS[key]}; config.json is not a "
                               "model this engine can load.")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object.")
    return data


def _as_id_tuple(value: Any) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _special_ids(raw: Dict[str, Any], folder: Optional[Path]) -> Tuple[Optional[int], Tuple[int, ...]]:
    bos = raw.get("bos_token_id")
    eos = _as_id_tuple(raw.get("eos_token_id"))
    if folder is not None and (folder / "generation_config.json").is_file():
        gen = _read_json(folder / "generation_config.json")
        if gen.get("bos_token_id") is not None:
            bos = gen["bos_token_id"]
        gen_eos = _as_id_tuple(gen.get("eos_token_id"))
        eos = tuple(dict.fromkeys(eos + gen_eos))
    return (int(bos) if bos is not None else None), eos


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
    raise ModelFormatError(
        f"{where}: rope_scaling type {kind!r} is not supported (supported: linear, llama3, longrope; "
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


def _quant_config(raw: Dict[str, Any], folder: Optional[Path], where: str) -> Optional[QuantConfig]:
    qc: Optional[Dict[str, Any]] = None
    if folder is not None:
        for name in ("quantize_config.json", "quant_config.json"):
            if (folder / name).is_file():
                qc = _read_json(folder / name)
                break
    if qc is None and isinstance(raw.get("quantization_config"), dict):
        qc = raw["quantization_config"]
    if qc is None:
        return None
    method = str(qc.get("quant_method", "awq" if "w_bit" in qc else "gptq")).lower()
    if method == "awq":
        return _awq_config(qc, where)
    if method == "exl2":
        return EXL2_QUANT
    if method != "gptq":
        raise ModelFormatError(
            f"{where}: quantization method {method!r} is not supported; this engine runs 4-bit GPTQ, 4-bit AWQ, "
            "EXL2 and dense fp16/bf16/fp32 checkpoints."
        )
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelFormatError(
            f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)."
        )
    if qc.get("is_marlin_format"):
        raise ModelFormatError(f"{where}: Marlin-format GPTQ checkpoints are not supported.")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in (4, 8):
        raise ModelFormatError(f"{where}: GPTQ with {bits} bits is not supported (supported: 4 and 8 bits).")
    group = int(qc.get("group_size", qc.get("q_group_size", -1)))
    if group == 0 or group < -1:
        raise ModelFormatError(f"{where}: GPTQ group_size {group} is invalid (use -1 or a positive size).")
    return QuantConfig(
        bits=bits,
        group_size=group,
        desc_act=bool(qc.get("desc_act", False)),
        sym=bool(qc.get("sym", True)),
        checkpoint_format=fmt,
    )


def _awq_config(qc: Dict[str, Any], where: str) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelFormatError(f"{where}: AWQ version {version!r} is not supported (supported: gemm).")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ModelFormatError(f"{where}: AWQ with {bits} bits is not supported; only 4-bit AWQ is.")
    if not qc.get("zero_point", True):
        raise ModelFormatError(f"{where}: AWQ without zero points is not supported.")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise ModelFormatError(f"{where}: AWQ group_size {group} is invalid (use -1 or a positive size).")
    return QuantConfig(bits=4, group_size=group, sym=False, checkpoint_format="awq", method="awq")
