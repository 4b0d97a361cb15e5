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
    config_range,
    number,
    parse_rope_scaling,
    rope_settings,
    rope_theta,
    whole,
)
from kobold_backend.engine.model_files import is_gguf_file, is_model_file, model_files, read_model_text
from kobold_backend.errors import ModelFormatError

if TYPE_CHECKING:
    from kobold_backend.engine.architectures.base import Architecture


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
        if is_gguf_file(folder):
            return cls._from_gguf(folder)
        if not folder.is_dir():
            from kobold_backend.engine.model_path import model_path_problem

            raise ModelFormatError(model_path_problem(folder) or f"{folder} is not a folder.")
        cfg_path = folder / "config.json"
        if not is_model_file(cfg_path):
            gguf = model_files(folder, "*.gguf")
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
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ModelFormatError(f"{where}: architectures is {archs!r:.60}; a list of class names is expected.")
        arch = lookup(model_type, archs, where)
        raw = arch.text_config(raw, where)
        try:
            hidden, layers, heads, vocab = (whole(raw[key], key, where) for key in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
            inter_key = "intermediate_size" if raw.get("intermediate_size") else "moe_intermediate_size"  # MoE-only
            inter = whole(raw[inter_key], inter_key, where)
        except KeyError as exc:
            raise ModelFormatError(f"{where}: config.json lacks the required key {exc.args[0]!r}.") from None
        for key, value in (("hidden_size", hidden), ("intermediate_size", inter), ("num_hidden_layers", layers),
                           ("num_attention_heads", heads), ("vocab_size", vocab)):
            _check_bound(where, key, value)
        kv_heads = whole(raw.get("num_key_value_heads") or heads, "num_key_value_heads", where)
        head_dim = whole(raw.get("head_dim") or hidden // heads, "head_dim", where)
        max_pos = whole(raw.get("max_position_embeddings", 2048), "max_position_embeddings", where)
        for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim),
                           ("max_position_embeddings", max_pos)):
            _check_bound(where, key, value)
        if heads % kv_heads:
            raise ModelFormatError(
                f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}."
            )
        if head_dim % 2:
            raise ModelFormatError(f"{where}: head_dim {head_dim} is odd; RoPE needs an even head size.")
        try:
            return cls._build(raw, folder, where, arch, (hidden, inter, layers, heads, kv_heads, head_dim, vocab,
                                                         max_pos))
        except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError) as exc:
            if isinstance(exc, ModelFormatError):
                raise
            # a description reading a value of the wrong type: the file is at fault, not the engine
            raise ModelFormatError(f"{where}: config.json holds a value of the wrong type or size for "
                                   f"{model_type} ({type(exc).__name__}: {exc}).") from None

    @classmethod
    def _build(cls, raw: Dict[str, Any], folder: Optional[Path], where: str, arch: Architecture,
               sizes: Tuple[int, ...]) -> ModelConfig:
        hidden, inter, layers, heads, kv_heads, head_dim, vocab, max_pos = sizes
        model_type, archs = raw.get("model_type"), raw.get("architectures") or []
        bos, eos = _special_ids(raw, folder, where)
        config = cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=number(raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-6)), "rms_norm_eps", where,
                                positive=True),
            rope_theta=rope_theta(raw, where=where),
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
    low, high = config_range(key)
    if not low <= value <= high:
        raise ModelFormatError(f"{where}: {key} {value} is outside {low}..{high}; config.json is not a "
                               "model this engine can load.")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(read_model_text(path))
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    except RecursionError:
        raise ModelFormatError(f"{path} nests its JSON too deeply.") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object.")
    return data


def _as_id_tuple(value: Any, where: str) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(whole(v, "eos_token_id", where) for v in value)
    return (whole(value, "eos_token_id", where),)


def _special_ids(raw: Dict[str, Any], folder: Optional[Path], where: str) -> Tuple[Optional[int], Tuple[int, ...]]:
    bos = raw.get("bos_token_id")
    eos = _as_id_tuple(raw.get("eos_token_id"), where)
    if folder is not None and is_model_file(folder / "generation_config.json"):
        gen = _read_json(folder / "generation_config.json")
        if gen.get("bos_token_id") is not None:
            bos = gen["bos_token_id"]
        gen_eos = _as_id_tuple(gen.get("eos_token_id"), f"{folder / 'generation_config.json'}")
        eos = tuple(dict.fromkeys(eos + gen_eos))
    return (whole(bos, "bos_token_id", where) if bos is not None else None), eos


def _quant_config(raw: Dict[str, Any], folder: Optional[Path], where: str) -> Optional[QuantConfig]:
    qc: Optional[Dict[str, Any]] = None
    if folder is not None:
        for name in ("quantize_config.json", "quant_config.json"):
            if is_model_file(folder / name):
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
    if method == "mxfp4":  # gpt-oss: only the experts are MXFP4, and their description reads them as stored
        return None
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
    bits = whole(qc.get("bits", qc.get("w_bit", 4)), "quantization bits", where)
    if bits not in (4, 8):
        raise ModelFormatError(f"{where}: GPTQ with {bits} bits is not supported (supported: 4 and 8 bits).")
    group = whole(qc.get("group_size", qc.get("q_group_size", -1)), "group_size", where)
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
    bits = whole(qc.get("bits", qc.get("w_bit", 4)), "quantization bits", where)
    if bits != 4:
        raise ModelFormatError(f"{where}: AWQ with {bits} bits is not supported; only 4-bit AWQ is.")
    if not qc.get("zero_point", True):
        raise ModelFormatError(f"{where}: AWQ without zero points is not supported.")
    group = whole(qc.get("group_size", qc.get("q_group_size", 128)), "group_size", where)
    if group == 0 or group < -1:
        raise ModelFormatError(f"{where}: AWQ group_size {group} is invalid (use -1 or a positive size).")
    return QuantConfig(bits=4, group_size=group, sym=False, checkpoint_format="awq", method="awq")
