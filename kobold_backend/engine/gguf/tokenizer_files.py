"""GGUF vocabulary metadata -> the tokenizer files it was converted from, so the engine's one tokenizer loader
reads GGUF models too.

- `tokenizer.ggml.model = "llama"` (sentencepiece BPE with byte fallback): a sentencepiece `tokenizer.model`
  rebuilt from tokens, scores and token types (sentencepiece's ModelProto, written field by field below).
- `tokenizer.ggml.model = "gpt2"` (byte-level BPE): a `tokenizer.json` for the `tokenizers` package from tokens and
  merges, with the pre-tokenizer regex named by `tokenizer.ggml.pre`.
Both come with a `tokenizer_config.json` carrying `add_bos_token`, `add_eos_token`, the special tokens and
`tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List

from kobold_backend.errors import ModelFormatError

# llama.cpp's token types (the same numbers as sentencepiece's SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as the original models' tokenizer.json files give them.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_PATTERNS: Dict[str, str] = {
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "gpt-2": _GPT2, "gpt2": _GPT2, "default": _GPT2,
}


def tokenizer_files(meta: Dict[str, Any], where: str) -> Dict[str, bytes]:
    """File name -> contents of the Hugging Face tokenizer files equivalent to the GGUF vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    tokens: List[str] = meta.get("tokenizer.ggml.tokens") or []
    if model == "no_vocab":
        raise ModelFormatError(f"{where}: the GGUF file has no vocabulary (tokenizer.ggml.model is no_vocab, as in "
                               "the bench's synthetic files); it can be timed with `kobold-backend bench --model` "
                               "but not serve text.")
    if not tokens:
        raise ModelFormatError(f"{where}: the GGUF file has no tokenizer.ggml.tokens vocabulary.")
    types: List[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if model == "llama":
        files = {"tokenizer.model": _sentencepiece_model(meta, tokens, types)}
    elif model == "gpt2":
        files = {"tokenizer.json": _bpe_tokenizer_json(meta, tokens, types, where)}
    else:
        raise ModelFormatError(
            f"{where}: GGUF tokenizer model {model!r} is not supported (supported: llama, gpt2)."
        )
    files["tokenizer_config.json"] = json.dumps(_tokenizer_config(meta, tokens, model)).encode("utf-8")
    return files


def _tokenizer_config(meta: Dict[str, Any], tokens: List[str], model: str) -> Dict[str, Any]:
    def token(name: str) -> Any:
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else None

    config: Dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
    }
    if model == "llama":
        config["legacy"] = True  # what llama.cpp's sentencepiece tokenizer does after special tokens
        config["add_prefix_space"] = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


# --- sentencepiece ModelProto, protobuf wire format -------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field_bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _field_float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def _sentencepiece_model(meta: Dict[str, Any], tokens: List[str], types: List[int]) -> bytes:
    scores: List[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    out = bytearray()
    for piece, score, kind in zip(tokens, scores, types):
        entry = _field_bytes(1, piece.encode("utf-8")) + _field_float(2, float(score)) + _field_varint(3, int(kind))
        out += _field_bytes(1, entry)  # ModelProto.pieces

    def special(name: str) -> int:
        tid = meta.get(f"tokenizer.ggml.{name}_token_id")
        return -1 if tid is None else int(tid)

    trainer = (_field_varint(3, 2)  # model_type = BPE
               + _field_varint(4, len(tokens))  # vocab_size
               + _field_varint(35, 1)  # byte_fallback
               + _field_varint(40, max(special("unknown"), 0))  # unk_id
               + _field_varint(41, special("bos"))
               + _field_varint(42, special("eos"))
               + _field_varint(43, special("padding")))
    normalizer = (_field_bytes(1, b"identity")
                  + _field_varint(3, int(bool(meta.get("tokenizer.ggml.add_space_prefix", True))))
                  + _field_varint(4, 0)  # remove_extra_whitespaces
                  + _field_varint(5, 1))  # escape_whitespaces
    out += _field_bytes(2, trainer) + _field_bytes(3, normalizer)
    return bytes(out)


# --- byte-level BPE tokenizer.json ------------------------------------------------------------------------------

def _bpe_tokenizer_json(meta: Dict[str, Any], tokens: List[str], types: List[int], where: str) -> bytes:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZER_PATTERNS:
        raise ModelFormatError(
            f"{where}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_PATTERNS))})."
        )
    merges: List[str] = meta.get("tokenizer.ggml.merges") or []
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind != CONTROL, "special": kind == CONTROL}
        for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZER_PATTERNS[pre]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": PRE_TOKENIZER_PATTERNS[pre] == _LLAMA3,  # llama.cpp sets it for Llama 3's vocab
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": merges},
    }
    return json.dumps(spec, ensure_ascii=False).encode("utf-8")
