"""Model configuration read once from a model folder: config.json, generation_config.json and GPTQ settings.

Anything this engine cannot run is refused here with one sentence naming what was found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from kobold_backend.errors import ModelFormatError

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
# Sanity bounds on config.json sizes, far above any released Llama-family model (Llama 3.1 405B: 126 layers,
# hidden 16384, 128 heads, vocab 128256), checked before anything is allocated from them.
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: "linear" (positions divided by factor) or "llama3" (frequency-dependent)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class QuantConfig:
    """GPTQ settings; only 4-bit GPTQ is supported."""

    bits: int = 4
    group_size: int = -1
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"


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

    @property
    def is_gptq(self) -> bool:
        return self.quant is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelFormatError(f"Model folder {folder} does not exist or is not a folder.")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            gguf = sorted(folder.glob("*.gguf"))
            if gguf:
                raise ModelFormatError(
                    f"{folder} holds a GGUF file ({gguf[0].name}) but no config.json; GGUF models are not "
                    "supported: use a safetensors (dense or GPTQ) checkpoint, or KoboldCpp for GGUF."
                )
            raise ModelFormatError(f"{folder} has no config.json; it is not a Hugging Face model folder.")
        raw = _read_json(cfg_path)
        return cls.from_dict(raw, folder)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], folder: Optional[Path] = None) -> ModelConfig:
        where = str(folder) if folder is not None else "config.json"
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"{where}: model_type {model_type!r} is not supported; this engine runs Llama-family models "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})."
            )
        bad_archs = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad_archs:
            raise ModelFormatError(
                f"{where}: architecture {bad_archs[0]!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
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
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ModelFormatError(f"{where}: attention_bias/mlp_bias models are not supported.")
        bos, eos = _special_ids(raw, folder)
        return cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(raw.get("rope_scaling"), where),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=bos,
            eos_token_ids=eos,
            model_type=str(model_type),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float16"),
            quant=_quant_config(raw, folder, where),
            raw=raw,
        )


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


def _rope_scaling(value: Any, where: str) -> Optional[RopeScaling]:
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
    raise ModelFormatError(
        f"{where}: rope_scaling type {kind!r} is not supported (supported: linear, llama3; "
        "NTK alpha is a load option)."
    )


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
    method = str(qc.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise ModelFormatError(
            f"{where}: quantization method {method!r} is not supported; this engine runs 4-bit GPTQ "
            "and dense fp16/bf16/fp32 checkpoints."
        )
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelFormatError(
            f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)."
        )
    if qc.get("is_marlin_format"):
        raise ModelFormatError(f"{where}: Marlin-format GPTQ checkpoints are not supported.")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ModelFormatError(f"{where}: GPTQ with {bits} bits is not supported; only 4-bit GPTQ is.")
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
