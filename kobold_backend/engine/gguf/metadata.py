"""The types and ranges of the GGUF metadata the engine reads, checked once when a file is opened, so that the
config and tokenizer builders can take every value they use at its word.

A size (layers, heads, widths, context) must be a whole number inside the engine's config bounds before any list or
table is made from it; a float must be finite; the vocabulary arrays must be strings, numbers and ints of one length
(scores may be infinite: they are only copied into the tokenizer).
Special-token ids outside the vocabulary are dropped with a warning, as llama.cpp does.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Tuple

from kobold_backend.engine.config_types import CONFIG_BOUNDS, config_range
from kobold_backend.errors import ModelFormatError

log = logging.getLogger(__name__)

# `{arch}.` keys that are sizes -> their bound (the config key whose bound applies, or a number).
_SIZES: Dict[str, Any] = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "expert_feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
    "attention.value_length": "head_dim", "rope.dimension_count": "head_dim", "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "rope.scaling.original_context_length": "max_position_embeddings",
}
# `{arch}.` keys that are counts where 0 means none.
_COUNTS: Dict[str, int] = {"expert_count": 1 << 16, "expert_used_count": 1 << 16,
                           "attention.sliding_window": CONFIG_BOUNDS["max_position_embeddings"]}
# `{arch}.` float keys -> whether 0 is allowed (softcapping 0 is "off"; a RoPE base or scale and a norm's epsilon
# must be positive, as config.json's rope_theta and rms_norm_eps are: config_types.number(positive=True)).
_FLOATS: Dict[str, bool] = {
    "attention.layer_norm_rms_epsilon": False, "attention.layer_norm_epsilon": False,
    "rope.freq_base": False, "rope.freq_base_swa": False,
    "rope.scaling.factor": False, "rope.scaling.attn_factor": False, "attention.scale": False,
    "final_logit_softcapping": True, "attn_logit_softcapping": True,
}
_STRINGS = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")
SPECIAL_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def _size_range(spec: Any) -> Tuple[int, int]:
    return config_range(spec) if isinstance(spec, str) else (0, spec)


def check_metadata(meta: Dict[str, Any], where: str) -> None:
    """Refuse metadata of the wrong type or range with one sentence naming the file and the key; drop special
    token ids outside the vocabulary (in place)."""

    def bad(key: str, expected: str) -> ModelFormatError:
        return ModelFormatError(f"{where}: metadata {key} is {_describe(meta[key])}; {expected} is expected.")

    for key in _STRINGS:
        if key in meta and not isinstance(meta[key], str):
            raise bad(key, "a string")
    for key in _FLAGS:
        if key in meta and not isinstance(meta[key], (bool, int)):
            raise bad(key, "a boolean")
    arch = meta.get("general.architecture")
    if isinstance(arch, str):
        ranges = {name: _size_range(spec) for name, spec in _SIZES.items()}
        ranges.update({name: (0, top) for name, top in _COUNTS.items()})
        for name, (low, high) in ranges.items():
            key = f"{arch}.{name}"
            if key not in meta:
                continue
            per_layer = name == "attention.head_count_kv" and isinstance(meta[key], list)
            values = meta[key] if per_layer else [meta[key]]
            if not values or not all(_is_int(v) and low <= v <= high for v in values):
                raise bad(key, f"a whole number from {low} to {high}")
        for name, zero_ok in _FLOATS.items():
            key = f"{arch}.{name}"
            if key in meta and not (_is_number(meta[key]) and (meta[key] > 0 or zero_ok and meta[key] == 0)):
                raise bad(key, "a finite number " + ("of at least 0" if zero_ok else "above 0"))
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if pattern is not None and not (_is_int(pattern) and 0 <= pattern <= CONFIG_BOUNDS["num_hidden_layers"]
                                        or isinstance(pattern, list) and all(isinstance(p, int) for p in pattern)):
            raise bad(f"{arch}.attention.sliding_window_pattern", "a layer count or an array of booleans")
    _check_vocabulary(meta, where, bad)


def _check_vocabulary(meta: Dict[str, Any], where: str, bad: Any) -> None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise bad("tokenizer.ggml.tokens", "an array of strings")
    if len(tokens) > CONFIG_BOUNDS["vocab_size"]:
        raise bad("tokenizer.ggml.tokens", f"at most {CONFIG_BOUNDS['vocab_size']} tokens")
    for key, check, kind in (("tokenizer.ggml.scores", _is_real, "numbers"),
                             ("tokenizer.ggml.token_type", _is_int, "whole numbers")):
        values = meta.get(key)
        if values is not None and not (isinstance(values, list) and len(values) == len(tokens)
                                       and all(check(v) for v in values)):
            raise bad(key, f"an array of {len(tokens)} {kind} (one per token)")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
        raise bad("tokenizer.ggml.merges", "an array of strings")
    for name in SPECIAL_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key not in meta:
            continue
        if not _is_int(meta[key]):
            raise bad(key, "a token id")
        if not 0 <= meta[key] < len(tokens):
            log.warning("%s: %s %s is outside the vocabulary of %d tokens; ignored", where, key, meta[key],
                        len(tokens))
            del meta[key]
