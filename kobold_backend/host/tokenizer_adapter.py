"""The tokenizer object KoboldAI United uses: encode/decode/__call__/_koboldai_header over the engine tokenizer,
with text encoded as a continuation (no sentencepiece dummy-prefix space) and decoded with leading spaces kept.

United builds a context by encoding memory, world info and story chunks separately and concatenating the ids,
and it decodes generated ids on their own, so encode must not invent a leading space and decode must not drop
one. The engine's token bytes already keep spaces; for tokenizers that prepend a "▁" to every text
(sentencepiece and Llama-2-style tokenizer.json) encode puts a sentinel before the text and drops the
sentinel's ids, with the sentinel chosen and checked from the vocabulary itself (no hard-coded ids).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kobold_backend.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SENTINELS = ("\n", "\u00a7", "|", "~", "#")
PROBES = ("a", " a", "Hello world", " [x]", "\u00e9t\u00e9", "1", " \n ", "\n\nb")


class Encoding(dict):
    """What `tokenizer(text)` returns: a dict with attribute access, like transformers' BatchEncoding."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_id_list(tokens: Any) -> List[int]:
    """int, numpy scalar, list/tuple, numpy array or torch tensor (0-d or 1-d) -> list of ints."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if isinstance(tokens, (list, tuple)):
        return [int(t) for t in tokens]
    return [int(tokens)]


class UnitedTokenizer:
    """Wraps an engine Tokenizer for United (and anything else expecting a transformers-like tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._koboldai_header: List[int] = []
        self.add_bos_token = False
        self.vocab_size = tokenizer.vocab_size
        self.bos_token_id: Optional[int] = tokenizer.bos_id
        self.eos_token_ids: Tuple[int, ...] = tuple(tokenizer.eos_ids)
        self.eos_token_id: Optional[int] = self.eos_token_ids[0] if self.eos_token_ids else None
        self.pad_token_id: Optional[int] = self.eos_token_id
        self.prefix_space = self._text(self.tokenizer.encode("a")).startswith(" ")
        self._sentinel: Optional[Tuple[str, List[int]]] = self._pick_sentinel() if self.prefix_space else None

    def __len__(self) -> int:
        return self.vocab_size

    def _text(self, ids: Sequence[int]) -> str:
        data = b"".join(self.tokenizer.token_bytes(i) for i in ids if 0 <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def _pick_sentinel(self) -> Optional[Tuple[str, List[int]]]:
        for sentinel in SENTINELS:
            head = self.tokenizer.encode(sentinel)
            if head and all(self._text(self._split(sentinel, head, p) or []) == p for p in PROBES):
                return sentinel, head
        log.warning("no sentinel keeps this tokenizer's texts apart; encode() will add a leading space")
        return None

    def _split(self, sentinel: str, head: List[int], text: str) -> Optional[List[int]]:
        ids = self.tokenizer.encode(sentinel + text)
        return ids[len(head):] if ids[: len(head)] == head else None

    def encode(self, text: str, *args: Any, **kwargs: Any) -> List[int]:
        """Ids of `text` as it reads inside a longer text: "Hello" and " Hello" stay different."""
        if not text:
            return []
        if self._sentinel is not None:
            ids = self._split(self._sentinel[0], self._sentinel[1], text)
            if ids is not None:
                return ids
        return self.tokenizer.encode(text)

    def decode(self, tokens: Any, *args: Any, **kwargs: Any) -> str:
        """Text of the ids with every leading space kept; ids outside the vocabulary and control tokens
        (BOS/EOS) contribute nothing."""
        return self._text(_as_id_list(tokens))

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Encoding:
        """`tokenizer(str).input_ids` is a list of ids, `tokenizer([str, ...]).input_ids` a list of lists."""
        if isinstance(text, str):
            ids: Any = self.encode(text)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t) for t in text]
            mask = [[1] * len(row) for row in ids]
        return Encoding(input_ids=ids, attention_mask=mask)

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        """Token texts (leading spaces as " "); an int gives a str, a sequence a list."""
        if isinstance(ids, int):
            return self.tokenizer.piece_text(ids)
        return [self.tokenizer.piece_text(i) for i in _as_id_list(ids)]

    def get_vocab(self) -> Dict[str, int]:
        vocab: Dict[str, int] = {}
        for i, text in enumerate(self.tokenizer.token_strings()):
            vocab.setdefault(text, i)
        return vocab

    def token_ids_containing(self, chars: str) -> List[int]:
        """Ids whose text contains any of `chars` (United bans tokens with "[" or "]" this way)."""
        return [i for i, text in enumerate(self.tokenizer.token_strings()) if any(c in text for c in chars)]
