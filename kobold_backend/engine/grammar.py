"""Grammar-constrained generation through llguidance: a GBNF grammar or a JSON schema becomes a token mask per step
(EOS allowed only once the grammar is complete); llguidance is optional and imported only when a grammar is used."""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy as np
import torch

from kobold_backend.engine.tokenizer import Tokenizer
from kobold_backend.errors import RequestError

MISSING_LIBRARY = "grammar needs the llguidance package: pip install 'kobold-backend[grammar]' (Python >= 3.9)"
# llguidance marks special tokens with a leading 0xFF byte (never valid UTF-8), so grammar text cannot produce them.
SPECIAL_MARKER = b"\xff"
# JSON output as json.dumps writes it: one space after ',' and ':' and nowhere else, so a model cannot wander off
# into unbounded whitespace; a schema's own "x-guidance" object overrides these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The longest grammar or JSON schema text compiled (checked before llguidance sees it); llguidance bounds the rest
# (a parser row holds at most 2000 items, lexer and recursion limits), and a grammar that crosses one of those
# while generating ends the request with GrammarFailed instead of a silent stop.
MAX_GRAMMAR_CHARS = 1 << 16

_cache_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


def _llguidance(field: str) -> Any:
    try:
        import llguidance
    except ImportError:
        raise RequestError(MISSING_LIBRARY, field) from None
    return llguidance


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: the bytes of every token, EOS/BOS ids, and a
    callable that tokenizes text found in the middle of a generation (no BOS, no sentencepiece dummy space)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        # A weak reference: llguidance keeps this object, and the cache entry must not keep the tokenizer alive.
        self._tokenizer = weakref.ref(tokenizer)
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self.tokens: List[bytes] = []
        self.special_token_ids: List[int] = []
        for i in range(tokenizer.vocab_size):
            data = tokenizer.token_bytes(i)
            if not data:
                data = SPECIAL_MARKER + f"<[{i}]>".encode()
                self.special_token_ids.append(i)
            self.tokens.append(data)
        # Sentencepiece puts a space in front of a text; encode after a newline and drop the newline's tokens.
        self.prefix = tokenizer.encode("\n") if tokenizer.adds_prefix_space() else []

    def __call__(self, text: Union[str, bytes]) -> List[int]:
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise RuntimeError("the tokenizer of this grammar was released")
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not self.prefix:
            return tokenizer.encode(text)
        ids = tokenizer.encode("\n" + text)
        if ids[: len(self.prefix)] == self.prefix:
            return ids[len(self.prefix):]
        return tokenizer.encode(text)


def ll_tokenizer(tokenizer: Tokenizer, field: str = "grammar") -> Any:
    """llguidance's tokenizer for `tokenizer`, built on first use and kept as long as the tokenizer lives."""
    llg = _llguidance(field)
    with _cache_lock:
        cached = _ll_tokenizers.get(tokenizer)
        if cached is None:
            if not tokenizer.eos_ids:
                raise RequestError("grammar needs a model with an end-of-sequence token", field)
            view = _TokenizerView(tokenizer)
            cached = llg.LLTokenizer(llg.TokenizerWrapper(view), n_vocab=tokenizer.vocab_size,
                                     eos_token=list(tokenizer.eos_ids))
            _ll_tokenizers[tokenizer] = cached
    return cached


class GrammarFailed(RequestError):
    """The grammar crossed one of llguidance's limits while generating (it cannot go on as the grammar says)."""


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(f"{field} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled", field)


def _schema_text(schema: Union[Dict[str, Any], str]) -> str:
    if isinstance(schema, str):
        _check_size(schema, "json_schema")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(f"json_schema is not valid JSON: {e}", "json_schema") from None
        except RecursionError:
            raise RequestError("json_schema nests deeper than it can be read", "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError("json_schema must be a JSON object (or a JSON string of one)", "json_schema")
    try:
        text = json.dumps(schema)
    except RecursionError:
        raise RequestError("json_schema nests deeper than it can be read", "json_schema") from None
    _check_size(text, "json_schema")
    return text


class GrammarConstraint:
    """The grammar state of one generation: which tokens may come next; advanced and rolled back with the output.
    One constraint serves one request (it holds that request's position in the grammar)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Iterable[int], field: str = "grammar") -> None:
        self._matcher = matcher
        self.field = field
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)

    @classmethod
    def build(cls, tokenizer: Tokenizer, *, gbnf: Optional[str] = None,
              json_schema: Optional[Union[Dict[str, Any], str]] = None) -> GrammarConstraint:
        """Compile a GBNF (or Lark) grammar or a JSON schema for `tokenizer`; RequestError names the field when the
        grammar is invalid or llguidance is not installed."""
        if gbnf is not None and json_schema is not None:
            raise RequestError("send either grammar or json_schema, not both", "grammar")
        if gbnf is None and json_schema is None:
            raise RequestError("no grammar given", "grammar")
        field = "grammar" if gbnf is not None else "json_schema"
        llg = _llguidance(field)
        if gbnf is not None:
            _check_size(gbnf, "grammar")
        try:
            if gbnf is not None:
                grammar = llg.grammar_from("gbnf", gbnf)
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(_schema_text(json_schema),  # type: ignore[arg-type]
                                                             defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise RequestError(f"invalid {field}: {e}", field) from None
        lt = ll_tokenizer(tokenizer, field)
        problem = llg.LLMatcher.validate_grammar(grammar, lt)
        if problem:
            raise RequestError(f"invalid {field}: {problem}", field)
        matcher = llg.LLMatcher(lt, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"invalid {field}: {_first_line(matcher.get_error())}", field)
        return cls(matcher, tokenizer.vocab_size, tokenizer.eos_ids, field)

    def copy(self) -> GrammarConstraint:
        """An independent constraint at the same position (for another completion of the same request)."""
        return GrammarConstraint(self._matcher.deep_copy(), self.vocab_size, self.eos_ids, self.field)

    def allowed_mask(self, device: Union[torch.device, str] = "cpu", size: Optional[int] = None) -> torch.Tensor:
        """Bool [size or vocab_size]: True where the token may come next (EOS only when the grammar is complete).
        Ids past the tokenizer's vocabulary (a model's padded vocabulary) are never allowed."""
        size = self.vocab_size if size is None else size
        # llguidance's mask: one bit per token, little-endian 32-bit words (token i is bit i % 8 of byte i // 8)
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(size, dtype=np.bool_)
        n = min(size, self.vocab_size, bits.size)
        mask[:n] = bits[:n]
        return torch.from_numpy(mask).to(device)

    def constrain(self, logits: torch.Tensor, banned: Iterable[int] = ()) -> torch.Tensor:
        """A copy of `logits` [V] with -inf on the tokens the grammar rejects and on `banned`; when the bans would
        leave nothing the grammar allows, the grammar wins and the bans are dropped for this token."""
        mask = self.allowed_mask("cpu", logits.shape[-1])
        banned = [t for t in banned if 0 <= t < mask.numel()]
        if banned:
            kept = mask.clone()
            kept[banned] = False
            if bool(kept.any()):
                mask = kept
        return torch.where(mask.to(logits.device), logits, float("-inf"))

    def accept(self, token_id: int) -> None:
        """Advance the grammar by one generated token; GrammarFailed (one line) when that put the matcher into its
        error state, such as a grammar crossing llguidance's limits."""
        if not self._matcher.consume_token(int(token_id)) or self._matcher.is_error():
            raise GrammarFailed(f"The {self.field} cannot be followed: {_first_line(self._matcher.get_error())}",
                                self.field)

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens (banned-phrase rewinds)."""
        if n > 0:
            self._matcher.rollback(int(n))

    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still go on)."""
        return bool(self._matcher.is_accepting())

    def is_finished(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and cannot be extended, or EOS was accepted)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        """llguidance's message when a rejected token put the grammar into its error state, else ""."""
        return str(self._matcher.get_error())


def _first_line(message: str) -> str:
    """llguidance's errors go on with a dump of the parser state (one line per item): the first line says it."""
    return (str(message).strip().splitlines() or ["unknown error"])[0][:300]
