"""Model configuration read once from a model folder: config.json, generation_config.json and GPTQ settings.

Anything this engine cannot run is refused here with one sentence naming what was found. The types it fills in
live in engine/config_types.py, below the architecture descriptions, so that a description never imports this
reader (which looks descriptions up).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from kobold_backend.engine.config_types import (  # noqa: F401  (RopeScaling, EXL2_QUANT: imported from here too)
    EXL2_QUANT,
    ConfigData,
    Features,
    QuantConfig,
    RopeScaling,
    RopeSpec,
    parse_rope_scaling,
    rope_settings,
    rope_theta,
)
from kobold_backend.errors import ModelFormatError

if TYPE_CHECKING:
    from kobold_backend.engine.architectures.base import Architecture

# Sanity bounds on config.json sizes, far above any released model (Llama 3.1 405B: 126 layers, hidden 16384,
# 128 heads, vocab 128256), checked before anything is allocated from them.
CONFIG_BOUNDS = {
    "num_hidden_layers": 1024, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
    "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 23,
    "max_position_embeddings": 1 << 24,
}


class ModelConfig(ConfigData):
    """The configuration of one model folder or GGUF file, read by `from_dir` / `from_dict` with its architecture
    description looked up (engine/architectures); the fields are ConfigData's."""

    @property
    def description(self) -> Architecture:
        """The architecture description this config was read with (see engine/architectures)."""
        assert self.arch is not None, "ModelConfig built without from_dict has no architecture"
        return self.arch

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of a model folder, or of a .gguf file (from its metadata; no tensor data is read)."""
        folder = Path(path)
        if folder.suffix == ".gguf" and folder.is_file():
            return cls._from_gguf(folder)
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
    def _from_gguf(cls, path: Path) -> ModelConfig:
        """From a GGUF file's metadata and its small RoPE tables (no tensor data is read; the file is closed)."""
        from kobold_backend.engine.gguf.config import hf_config
        from kobold_backend.engine.gguf.file import GGUFFile

        gguf = GGUFFile(path)
        try:
            return cls.from_dict(hf_config(gguf.metadata, gguf.names(), path.name, gguf.floats))
        finally:
            gguf.close()

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], folder: Optional[Path] = None) -> ModelConfig:
        from kobold_backend.engine.architectures import lookup

        where = str(folder) if folder is not None else "config.json"
        model_type = raw.get("model_type")
        archs = raw.get("architectures") or []
        arch = lookup(model_type, archs, where)
        raw = arch.text_config(raw, where)
        try:
            hidden = int(raw["hidden_size"])
            inter = int(raw.get("intermediate_size") or raw["moe_intermediate_size"])  # MoE-only stacks
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
