"""tokenizer.json specs that make the `tokenizers` package tokenize a GGUF vocabulary the way llama.cpp does
(src/llama-vocab.cpp, `llama_vocab::impl::tokenize`), one builder per llama.cpp tokenizer kind.

- SPM (`tokenizer.ggml.model = "llama"`): llama.cpp puts ONE " " in front of every piece of raw text that starts
  the text or follows a special or user-defined token ("prefix with space if previous is special", only when
  `add_space_prefix`), writes every space as "▁", and merges the adjacent pair whose merged piece has the highest
  score, leftmost first (`llm_tokenizer_spm_session`, sentencepiece's own BPE); characters that form no piece
  become <0xXX> byte pieces. There is no `legacy` switch and no exception for text that already starts with a
  space, so " Hello" is "▁▁Hello" -> [▁, ▁Hello] ([29871, 15043] with Llama 2's vocabulary), as sentencepiece
  itself, transformers' slow LlamaTokenizer (legacy=True) and Llama 2's own tokenizer.json (normalizer
  Prepend("▁") + Replace) give. transformers' LlamaTokenizerFast built from a tokenizer.model (Metaspace
  pre-tokenizer) gives [▁Hello] instead: Metaspace adds no prefix to text that starts with "▁". Hence the
  normalizer here is Prepend + Replace, applied by `tokenizers` to each piece of text between added tokens.
  `remove_extra_whitespaces` is ignored, as llama.cpp's SPM tokenizer ignores it (only UGM reads it).
- BPE (`gpt2`, `gemma4`): the regexes of `tokenizer.ggml.pre` (pretokenizers.py) as a sequence of isolating
  splits, then GPT-2's byte-level mapping, or for SPM-style BPE (Gemma 4) spaces as "▁" and <0xXX> byte fallback.
  No normalizer: llama.cpp normalizes nothing before BPE, so Qwen2's NFC (in its tokenizer.json) is not applied.
- WPM (`bert`): BERT's normalizer and pre-tokenizer with a WordPiece model; llama.cpp writes word-initial pieces
  with a "▁" and continuations bare, Hugging Face continuations with "##".

Merges are written as "left right" strings and the newer BPE options only as JSON keys, so the files load with
tokenizers 0.15 as well as later releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from kobold_backend.engine.gguf.pretokenizers import PreTokenizer
from kobold_backend.errors import ModelFormatError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


@dataclass
class GGUFVocab:
    """A GGUF vocabulary: tokens, their llama.cpp types and scores, and per-token strip flags llama.cpp sets."""

    tokens: List[str]
    types: List[int]
    scores: List[float]
    unk_id: Optional[int] = None
    lstrip: Set[int] = field(default_factory=set)
    rstrip: Set[int] = field(default_factory=set)
    _ids: Optional[Dict[str, int]] = field(default=None, repr=False)

    def added_tokens(self) -> List[Dict[str, Any]]:
        """Control, unknown and user-defined tokens, matched whole in raw text before anything else (llama.cpp's
        `tokenizer_st_partition`): control and unknown ones as special tokens, user-defined ones as plain text."""
        return [{"id": i, "content": tok, "single_word": False, "lstrip": i in self.lstrip,
                 "rstrip": i in self.rstrip,
                 "normalized": False, "special": kind != USER_DEFINED}
                for i, (tok, kind) in enumerate(zip(self.tokens, self.types))
                if kind in (CONTROL, UNKNOWN, USER_DEFINED)]

    def vocab(self) -> Dict[str, int]:
        """Text -> id (the first id of a repeated text); built once."""
        if self._ids is None:
            self._ids = {}
            for i, tok in enumerate(self.tokens):
                self._ids.setdefault(tok, i)
        return self._ids


def _spec(vocab: GGUFVocab, normalizer: Any, pre_tokenizer: Any, decoder: Any, model: Dict[str, Any]) -> Dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": vocab.added_tokens(),
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": decoder,
            "model": model}


def _bpe_model(vocab: GGUFVocab, merges: List[str], byte_fallback: bool, ignore_merges: bool) -> Dict[str, Any]:
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None and 0 <= vocab.unk_id < len(vocab.tokens) else None
    model: Dict[str, Any] = {"type": "BPE", "dropout": None, "unk_token": unk if byte_fallback else None,
                             "continuing_subword_prefix": None, "end_of_word_suffix": None,
                             "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
                             "vocab": vocab.vocab(), "merges": merges}
    if ignore_merges:
        model["ignore_merges"] = True  # read by tokenizers >= 0.19 only
    return model


def _replace(old: str, new: str) -> Dict[str, Any]:
    return {"type": "Replace", "pattern": {"String": old}, "content": new}


def _spm_decoder(strip_prefix: bool) -> Dict[str, Any]:
    steps = [_replace(SPACE, " "), {"type": "ByteFallback"}, {"type": "Fuse"}]
    if strip_prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps}


# What turning an SPM vocabulary into merges may cost: each candidate split of a piece counts its length plus a
# fixed cost. Real vocabularies (Llama 2's 32k pieces, Gemma's 256k) stay below a fifth of it; a crafted one that
# would take minutes is refused in a few seconds at most.
MAX_MERGE_WORK = 1 << 28
_SPLIT_COST = 16


def spm_merges(vocab: GGUFVocab, where: str = "the GGUF file") -> List[str]:
    """Every split of a piece into two pieces, highest merged score first (llama.cpp's and sentencepiece's merge
    order); equal scores by the merged piece's id, then the shorter left part. Pieces holding a plain space cannot
    be written as a "left right" merge and are left out (llama.cpp's SPM vocabularies write spaces as "▁").

    Only cuts where both sides have the length of some piece are tried, so a vocabulary of few long pieces costs
    what its pieces weigh, not the square of their lengths."""
    ids = vocab.vocab()
    scores = vocab.scores
    lengths = sorted({len(piece) for piece in ids})
    known = set(lengths)
    work = 0
    ranked: List[Tuple[float, int, int, str]] = []
    for piece, piece_id in ids.items():
        if " " in piece:
            continue
        size = len(piece)
        for cut in lengths:
            if cut >= size:
                break
            if size - cut not in known:
                continue
            work += size + _SPLIT_COST
            if work > MAX_MERGE_WORK:
                raise ModelFormatError(f"{where}: tokenizer.ggml.tokens holds pieces whose splits would take more "
                                       f"than {MAX_MERGE_WORK} steps to turn into merges; it is not a "
                                       "vocabulary this engine converts.")
            if piece[:cut] in ids and piece[cut:] in ids:
                ranked.append((-scores[piece_id], piece_id, cut, piece[:cut] + " " + piece[cut:]))
    ranked.sort()
    return [merge for *_, merge in ranked]


def spm_tokenizer_json(vocab: GGUFVocab, add_space_prefix: bool, where: str = "the GGUF file") -> Dict[str, Any]:
    escape = _replace(" ", SPACE)
    normalizer = ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, escape]}
                  if add_space_prefix else escape)
    return _spec(vocab, normalizer, None, _spm_decoder(add_space_prefix),
                 _bpe_model(vocab, spm_merges(vocab, where), byte_fallback=True, ignore_merges=False))


def _newline_merges(vocab: GGUFVocab) -> List[str]:
    """Merges that build every run of newlines the vocabulary has as one token, shortest first: llama.cpp takes a
    word made only of newlines whole when it is a token (Gemma 4, llama.cpp PR 21343) without `ignore_merges`."""
    runs = {len(t) for t in vocab.tokens if t and set(t) == {"\n"}}
    return [f"{chr(10) * cut} {chr(10) * (k - cut)}" for k in sorted(runs) if k > 1
            for cut in range(1, k) if cut in runs and k - cut in runs]


def bpe_tokenizer_json(vocab: GGUFVocab, merges: Sequence[str], pre: PreTokenizer, newline_runs: bool
                       ) -> Dict[str, Any]:
    """`merges` as the GGUF file gives them; pairs that do not split in two at a space are dropped (llama.cpp
    splits at the first space after the first character, tokenizers at every space)."""
    usable = [m for m in merges if len(m.split(" ")) == 2]
    if newline_runs:
        extra = _newline_merges(vocab)
        seen = set(extra)
        usable = extra + [m for m in usable if m not in seen]
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
              for r in pre.regexes]
    if pre.byte_encode:
        splits.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False})
        normalizer = None
        decoder: Dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                   "use_regex": True}
    else:
        normalizer = _replace(" ", SPACE)
        decoder = _spm_decoder(strip_prefix=False)
    return _spec(vocab, normalizer, {"type": "Sequence", "pretokenizers": splits}, decoder,
                 _bpe_model(vocab, usable, byte_fallback=not pre.byte_encode, ignore_merges=pre.ignore_merges))


def wordpiece_tokenizer_json(vocab: GGUFVocab, lowercase: bool, strip_accents: bool) -> Dict[str, Any]:
    """convert_hf_to_gguf.py writes BERT's "word" as "▁word", "##piece" as "piece" and "[CLS]"-style tokens as
    they are; this undoes that for Hugging Face's WordPiece."""
    def hf_text(token: str, kind: int) -> str:
        if kind in (CONTROL, UNKNOWN, USER_DEFINED) or (token.startswith("[") and token.endswith("]")):
            return token
        return token[1:] if token.startswith(SPACE) else "##" + token

    words: Dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(vocab.tokens, vocab.types)):
        words.setdefault(hf_text(tok, kind), i)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else "[UNK]"
    normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                  "strip_accents": strip_accents, "lowercase": lowercase}
    model = {"type": "WordPiece", "unk_token": unk, "continuing_subword_prefix": "##",
             "max_input_chars_per_word": 100, "vocab": words}
    return _spec(vocab, normalizer, {"type": "BertPreTokenizer"}, {"type": "WordPiece", "prefix": "##",
                                                                   "cleanup": True}, model)
