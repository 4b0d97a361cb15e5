"""GGUF vocabulary metadata -> tokenizer files for the engine's one tokenizer loader, built so that the `tokenizers`
package gives the ids llama.cpp gives for the same GGUF file (src/llama-vocab.cpp):

- `tokenizer.ggml.model = "llama"` (SPM), `"gpt2"` and `"gemma4"` (BPE), `"bert"` (WPM): a `tokenizer.json`
  (tokenizer_json.py says how each follows llama.cpp; pretokenizers.py holds the split regexes of every
  `tokenizer.ggml.pre` llama.cpp knows);
- `"t5"` (UGM): a unigram sentencepiece `tokenizer.model` with the file's precompiled normalization map and
  whitespace flags, tokenized by the sentencepiece library, whose Viterbi search llama.cpp's UGM tokenizer copies.

Each comes with a `tokenizer_config.json` carrying what llama.cpp adds around a text (`add_bos_token`,
`add_eos_token`, with llama.cpp's defaults per tokenizer kind where the file says nothing), the special tokens'
texts and `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional

from kobold_backend.engine.gguf import tokenizer_json as tj
from kobold_backend.engine.gguf.pretokenizers import PRE_TOKENIZERS, UNSUPPORTED_PRE
from kobold_backend.errors import ModelFormatError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's special-token ids for a kind when the file names none (llama_vocab::impl::load). Its BPE default
# (BOS = EOS = 11, an ordinary token in most vocabularies) is left out: it would turn that token into a special one.
_DEFAULT_IDS: Dict[str, Dict[str, int]] = {
    "llama": {"bos": 1, "eos": 2, "unknown": 0},
    "gpt2": {},
    "bert": {"bos": 101, "unknown": 100, "seperator": 102, "padding": 0},
    "t5": {"eos": 1, "unknown": 2, "padding": 0},
    "gemma4": {},
}
# Token texts llama.cpp makes control tokens whatever the file's token types say (llama_vocab::impl::load): every
# end-of-generation text, and the fill-in-the-middle texts of each role the file names no id for.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}
_FIM_TEXTS = {
    "fim_pre": {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"},
    "fim_suf": {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"},
    "fim_mid": {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"},
    "fim_pad": {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"},
    "fim_rep": {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"},
    "fim_sep": {"<|file_sep|>"},
}
# gpt-oss's channel markers are always rendered (user-defined), as is <|end|> beside <|return|> and <|call|>.
_RENDERED_TEXTS = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}
_UNSUPPORTED_MODELS = {
    "rwkv": "RWKV's vocabulary of escaped byte strings",
    "plamo2": "PLaMo 2's own suffix-table tokenizer",
    "hybriddna": "its DNA k-mer tokenizer",
    "whitespace": "its whitespace-splitting tokenizer",
}


def _special_id(meta: Dict[str, Any], model: str, name: str, n_tokens: int) -> Optional[int]:
    """The id of `tokenizer.ggml.<name>_token_id`, or llama.cpp's default for the kind (None when out of range)."""
    tid = meta.get(f"tokenizer.ggml.{name}_token_id")
    if tid is not None and 0 <= int(tid) < n_tokens:
        return int(tid)
    default = _DEFAULT_IDS[model].get(name)
    return default if default is not None and default < n_tokens else None


def _flag(meta: Dict[str, Any], key: str, default: bool) -> bool:
    value = meta.get(f"tokenizer.ggml.{key}")
    return default if value is None else bool(value)


def _read_vocab(meta: Dict[str, Any], model: str, where: str) -> tj.GGUFVocab:
    tokens: List[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelFormatError(f"{where}: the GGUF file has no tokenizer.ggml.tokens vocabulary.")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for an empty token
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    _llama_cpp_types(meta, tokens, types)
    vocab = tj.GGUFVocab(tokens, types, scores, _special_id(meta, model, "unknown", len(tokens)))
    _strip_flags(meta, vocab)
    return vocab


def _llama_cpp_types(meta: Dict[str, Any], tokens: List[str], types: List[int]) -> None:
    """The token types llama.cpp overrides by text: end-of-generation and fill-in-the-middle texts become control
    tokens, gpt-oss's markers user-defined ones, and <|end|> (with <|return|> and <|call|>, or <|calls|> and
    <|flush|>) and Gemma 4's </s> (with <|tool_response>) lose their end-of-generation role."""
    texts = set(_EOG_TEXTS)
    for role, names in _FIM_TEXTS.items():
        if meta.get(f"tokenizer.ggml.{role}_token_id") is None:
            texts |= names
    present = set(tokens)
    for i, text in enumerate(tokens):
        if text in _RENDERED_TEXTS:
            types[i] = USER_DEFINED
        elif text in texts and types[i] != UNKNOWN:
            types[i] = CONTROL
    harmony = {"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present
    for i, text in enumerate(tokens):
        if text == "<|end|>" and harmony:
            types[i] = USER_DEFINED
        elif text == "</s>" and "<|tool_response>" in present:
            types[i] = NORMAL


def _strip_flags(meta: Dict[str, Any], vocab: tj.GGUFVocab) -> None:
    """llama.cpp's per-model token attributes: Phi-3's special tokens swallow the spaces after them, and the mask
    token of Jina v2, Nomic-BERT-MoE, Jina-BERT v3 and ModernBERT the spaces before it."""
    ids = vocab.vocab()
    name = str(meta.get("general.name") or "").lower()
    pre = str(meta.get("tokenizer.ggml.pre") or "")
    arch = str(meta.get("general.architecture") or "")
    if "phi-3" in name or "phi3" in name:
        vocab.rstrip = {i for i, t in enumerate(vocab.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)}
        vocab.rstrip |= {ids[t] for t in ("</s>",) if t in ids}
        vocab.rstrip -= {ids[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in ids}
    elif any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        vocab.lstrip = {ids["<mask>"]} if "<mask>" in ids else set()
    elif "modern-bert" in name:
        vocab.lstrip = {ids["[MASK]"]} if "[MASK]" in ids else set()


def tokenizer_files(meta: Dict[str, Any], where: str) -> Dict[str, bytes]:
    """File name -> contents of the tokenizer files that tokenize as llama.cpp does with this GGUF vocabulary."""
    model = str(meta.get("tokenizer.ggml.model"))
    if model in ("no_vocab", "none"):
        raise ModelFormatError(f"{where}: the GGUF file has no vocabulary (tokenizer.ggml.model is {model}, as in "
                               "the bench's synthetic files); it can be timed with `kobold-backend bench --model` "
                               "but not serve text.")
    if model in _UNSUPPORTED_MODELS:
        raise ModelFormatError(f"{where}: GGUF tokenizer model {model!r} ({_UNSUPPORTED_MODELS[model]}) is not "
                               f"supported (supported: {', '.join(sorted(_DEFAULT_IDS))}).")
    if model not in _DEFAULT_IDS:
        raise ModelFormatError(f"{where}: GGUF tokenizer model {model!r} is not supported (supported: "
                               f"{', '.join(sorted(_DEFAULT_IDS))}).")
    vocab = _read_vocab(meta, model, where)
    add_bos, force_bos = True, False
    if model == "llama":
        spec = tj.spm_tokenizer_json(vocab, _flag(meta, "add_space_prefix", True), where)
    elif model in ("gpt2", "gemma4"):
        pre = "gemma4" if model == "gemma4" else str(meta.get("tokenizer.ggml.pre") or "default")
        if pre in UNSUPPORTED_PRE:
            raise ModelFormatError(f"{where}: GGUF pre-tokenizer {pre!r} is not supported ({UNSUPPORTED_PRE[pre]}).")
        if pre not in PRE_TOKENIZERS:
            raise ModelFormatError(f"{where}: GGUF pre-tokenizer {pre!r} is not one llama.cpp knows.")
        kind = PRE_TOKENIZERS[pre]
        spec = tj.bpe_tokenizer_json(vocab, list(meta.get("tokenizer.ggml.merges") or []), kind,
                                     newline_runs=pre == "gemma4")
        add_bos, force_bos = kind.add_bos, pre in ("gemma4", "granite-embed-multi-311m")
    elif model == "bert":
        lowercase = _flag(meta, "normalizer.lowercase", True)
        spec = tj.wordpiece_tokenizer_json(vocab, lowercase, _flag(meta, "normalizer.strip_accents", lowercase))
    else:
        return _unigram_files(meta, vocab)
    config = _tokenizer_config(meta, model, vocab.tokens, add_bos, force_bos)
    return {"tokenizer.json": json.dumps(spec, ensure_ascii=False).encode("utf-8"),
            "tokenizer_config.json": json.dumps(config).encode("utf-8")}


def _tokenizer_config(meta: Dict[str, Any], model: str, tokens: List[str], add_bos: bool, force_bos: bool,
                      add_eos: bool = False) -> Dict[str, Any]:
    """`add_bos`/`add_eos`: llama.cpp's defaults for the kind; `force_bos`: it adds BOS whatever the file says
    (Gemma 4's pre-tokenizer)."""
    def text(name: str) -> Optional[str]:
        tid = _special_id(meta, model, name, len(tokens))
        return tokens[tid] if tid is not None else None

    if model == "bert":  # llama.cpp always wraps a text in [CLS] ... [SEP] when it adds special tokens
        config: Dict[str, Any] = {"add_bos_token": True, "add_eos_token": True, "eos_token": text("seperator")}
    else:
        config = {"add_bos_token": force_bos or _flag(meta, "add_bos_token", add_bos),
                  "add_eos_token": _flag(meta, "add_eos_token", add_eos), "eos_token": text("eos")}
    config.update(bos_token=text("bos"), unk_token=text("unknown"), pad_token=text("padding"))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


# --- UGM: a unigram sentencepiece ModelProto, protobuf wire format --------------------------------------------

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


def _unigram_files(meta: Dict[str, Any], vocab: tj.GGUFVocab) -> Dict[str, bytes]:
    out = bytearray()
    for piece, score, kind in zip(vocab.tokens, vocab.scores, vocab.types):
        entry = _field_bytes(1, piece.encode("utf-8")) + _field_float(2, score) + _field_varint(3, kind)
        out += _field_bytes(1, entry)  # ModelProto.pieces

    def sid(name: str) -> int:
        tid = _special_id(meta, "t5", name, len(vocab.tokens))
        return -1 if tid is None else tid

    trainer = (_field_varint(3, 1)  # model_type = UNIGRAM
               + _field_varint(4, len(vocab.tokens))
               + _field_varint(40, max(sid("unknown"), 0)) + _field_varint(41, sid("bos"))
               + _field_varint(42, sid("eos")) + _field_varint(43, sid("padding")))
    charsmap = bytes(b & 0xFF for b in meta.get("tokenizer.ggml.precompiled_charsmap") or [])
    normalizer = (_field_bytes(1, b"identity") + (_field_bytes(2, charsmap) if charsmap else b"")
                  + _field_varint(3, int(_flag(meta, "add_space_prefix", False)))
                  + _field_varint(4, int(_flag(meta, "remove_extra_whitespaces", False)))
                  + _field_varint(5, 1))  # escape_whitespaces
    out += _field_bytes(2, trainer) + _field_bytes(3, normalizer)
    config = _tokenizer_config(meta, "t5", vocab.tokens, add_bos=False, force_bos=False, add_eos=True)
    return {"tokenizer.model": bytes(out), "tokenizer_config.json": json.dumps(config).encode("utf-8")}
