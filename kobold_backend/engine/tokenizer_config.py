"""What a model folder's tokenizer_config.json, special_tokens_map.json and chat_template.jinja say about
tokenization: the tokenizer class, `legacy`, `add_prefix_space`, `add_bos_token`/`add_eos_token`, the special
tokens' texts, the added tokens (`added_tokens_decoder`) and the chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from kobold_backend.engine.model_files import is_model_file, read_model_text
from kobold_backend.errors import ModelFormatError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class AddedTokenSpec:
    """One entry of `added_tokens_decoder` (or of tokenizer.json's `added_tokens`)."""

    id: Optional[int]
    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False


@dataclass
class TokenizerConfig:
    tokenizer_class: str = ""  # without the "Fast" suffix
    legacy: Optional[bool] = None
    add_prefix_space: Optional[bool] = None
    add_bos_token: Optional[bool] = None
    add_eos_token: Optional[bool] = None
    split_special_tokens: bool = False  # True: special tokens written in text are read as plain text
    special: Dict[str, Optional[str]] = field(default_factory=dict)  # "bos_token" -> "<s>"; None: set to null
    additional_special: List[str] = field(default_factory=list)
    added_tokens: List[AddedTokenSpec] = field(default_factory=list)
    chat_template: Optional[str] = None


def read_json_object(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(read_model_text(path))
    except (json.JSONDecodeError, RecursionError):
        raise ModelFormatError(f"{path} is not valid JSON.") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object.")
    return data


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _flag(data: Dict[str, Any], key: str) -> Optional[bool]:
    value = data.get(key)
    return bool(value) if isinstance(value, bool) else None


def added_token_spec(token_id: Optional[int], entry: Any) -> Optional[AddedTokenSpec]:
    if isinstance(entry, str):
        return AddedTokenSpec(token_id, entry)
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
        return None
    return AddedTokenSpec(token_id, entry["content"], bool(entry.get("special", True)), bool(entry.get("lstrip")),
                          bool(entry.get("rstrip")), bool(entry.get("normalized", False)),
                          bool(entry.get("single_word")))


def _chat_template(value: Any) -> Optional[str]:
    """A template string, or the "default" one of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def read_tokenizer_config(folder: Path) -> TokenizerConfig:
    folder = Path(folder)
    config: Dict[str, Any] = {}
    path = folder / "tokenizer_config.json"
    if is_model_file(path):
        config = read_json_object(path)
    special_map: Dict[str, Any] = {}
    if is_model_file(folder / "special_tokens_map.json"):
        special_map = read_json_object(folder / "special_tokens_map.json")

    out = TokenizerConfig()
    name = config.get("tokenizer_class")
    if isinstance(name, str):
        out.tokenizer_class = name[:-4] if name.endswith("Fast") else name
    out.legacy = _flag(config, "legacy")
    out.add_prefix_space = _flag(config, "add_prefix_space")
    out.add_bos_token = _flag(config, "add_bos_token")
    out.add_eos_token = _flag(config, "add_eos_token")
    out.split_special_tokens = bool(_flag(config, "split_special_tokens"))
    for key in SPECIAL_KEYS:
        if key in config:
            out.special[key] = _token_text(config[key])
        elif key in special_map:
            out.special[key] = _token_text(special_map[key])
    extra = config.get("additional_special_tokens", special_map.get("additional_special_tokens")) or []
    if isinstance(extra, list):
        out.additional_special = [t for t in (_token_text(e) for e in extra) if t is not None]
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for key, entry in decoder.items():
            try:
                token_id = int(key)
            except ValueError:
                continue
            spec = added_token_spec(token_id, entry)
            if spec is not None:
                out.added_tokens.append(spec)
        out.added_tokens.sort(key=lambda s: s.id or 0)
    jinja = folder / "chat_template.jinja"
    if is_model_file(jinja):
        out.chat_template = read_model_text(jinja)
    else:
        out.chat_template = _chat_template(config.get("chat_template"))
    return out
