"""Tokenizers with transformers' ids: tokenizer.json or a BPE sentencepiece tokenizer.model run through the
`tokenizers` package with the pipeline transformers builds for the model's tokenizer class, one interface.

Streaming decodes token bytes, not strings, so a piece's leading space is never dropped and a
UTF-8 character split across byte-fallback tokens is only emitted once it is whole.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from kobold_backend.engine import tokenizer_compat
from kobold_backend.engine.chat_jinja import TemplateCompileError, compile_template
from kobold_backend.engine.model_files import MAX_TOKENIZER_BYTES, is_model_file, read_model_text
from kobold_backend.engine.tokenizer_config import AddedTokenSpec, TokenizerConfig, read_tokenizer_config
from kobold_backend.errors import ModelFormatError, RequestError

log = logging.getLogger(__name__)

# The most characters of request text tokenized in one piece (about 500,000 tokens, more than any context holds).
MAX_TOKENIZE_CHARS = 1 << 21
# Texts longer than this are tokenized with Python's GIL released (encode_batch), so other threads keep running.
GIL_FREE_CHARS = 1 << 14


class TokenizerFailed(RequestError):
    """The model's tokenizer failed on this text (its regex gave up, a panic inside the tokenizers library): the
    model's fault for this input, answered 422."""


def check_tokenize_size(text: str, field: str = "prompt") -> None:
    """RequestError (before any work) when `text` is longer than MAX_TOKENIZE_CHARS."""
    if len(text) > MAX_TOKENIZE_CHARS:
        raise RequestError(f"{field} has {len(text)} characters; at most {MAX_TOKENIZE_CHARS} are tokenized at once.",
                           field)


def _tokenizer_call(func: Any, *args: Any, **kwargs: Any) -> Any:
    """`func(*args)` of the tokenizers library, its Rust panics (pyo3's PanicException is a BaseException, not an
    Exception: an onig regex over its backtracking limit, a bad pre-tokenizer) raised as TokenizerFailed."""
    try:
        return func(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - only PanicException is turned into an error, the rest re-raised
        if type(e).__name__ != "PanicException":
            raise
        first = (str(e).strip().splitlines() or ["a panic"])[0][:200]
        raise TokenizerFailed(f"The model's tokenizer failed on this text ({first}).", "prompt") from None


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte <-> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_piece(piece: str) -> Optional[int]:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


class Tokenizer:
    """Common interface; use `load_tokenizer(folder)`.

    `encode(text)` gives the ids transformers' tokenizer gives with `add_special_tokens=False`: special and added
    tokens written in the text become their single ids (transformers' default `split_special_tokens=False`), and
    the dummy-prefix space follows the model's `legacy`/`add_prefix_space`. `add_bos`/`add_eos` add what the
    tokenizer itself puts around a text (`add_bos_token`/`add_eos_token`, or tokenizer.json's post-processor), so
    `encode(text, add_bos=True, add_eos=True)` equals `AutoTokenizer(text).input_ids`."""

    bos_id: Optional[int]
    eos_ids: Tuple[int, ...]
    vocab_size: int
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    prefix_ids: Tuple[int, ...] = ()  # what the tokenizer puts in front of a text: BOS when it adds one
    suffix_ids: Tuple[int, ...] = ()  # what it puts after a text: EOS with add_eos_token
    chat_template: Optional[str] = None  # the model's own (chat_template.jinja or tokenizer_config.json)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> List[int]:
        ids = self._encode(text)
        return (list(self.prefix_ids) if add_bos else []) + ids + (list(self.suffix_ids) if add_eos else [])

    def _encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token contributes to text in context (b"" for control tokens)."""
        raise NotImplementedError

    def piece_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_strings(self) -> List[str]:
        """piece_text of every id, computed once (used by token bans and DRY)."""
        cached = getattr(self, "_token_strings", None)
        if cached is None:
            cached = [self.piece_text(i) for i in range(self.vocab_size)]
            self._token_strings = cached
        return cached

    def stream_decoder(self, continuation: bool = False) -> StreamDecoder:
        """A decoder for a token stream. From the start of a text it drops the space the tokenizer adds in
        front (as `decode` does); with continuation=True (text after a prompt) every space is kept."""
        return StreamDecoder(self, strip_prefix_space=not continuation and self.decode_strips_prefix_space())

    def decode_strips_prefix_space(self) -> bool:
        """Whether `decode` drops the space the tokenizer put in front of a text (sentencepiece-style tokenizers
        do; byte-level BPE with add_prefix_space keeps it, as transformers does)."""
        return self.adds_prefix_space()

    def adds_prefix_space(self) -> bool:
        """Whether encoding a text puts a space in front of its first word (sentencepiece's dummy prefix)."""
        cached = getattr(self, "_adds_prefix_space", None)
        if cached is None:
            ids = self.encode("a")
            cached = bool(ids) and self.token_bytes(ids[0]).startswith(b" ")
            self._adds_prefix_space = cached
        return cached

    def _valid(self, ids: Iterable[int]) -> List[int]:
        return [int(i) for i in ids if 0 <= int(i) < self.vocab_size]


def complete_utf8_prefix(data: Union[bytes, bytearray]) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character (a lead byte whose
    continuation bytes have not all arrived)."""
    for back in range(1, min(4, len(data)) + 1):  # at most 3 continuation bytes follow a lead byte
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue
        need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


class StreamDecoder:
    """Turns token ids into text pieces, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, strip_prefix_space: bool = False) -> None:
        self.tokenizer = tokenizer
        self.pending = b""
        self.strip_prefix_space = strip_prefix_space

    def feed(self, token_id: int) -> str:
        piece = self.tokenizer.token_bytes(token_id)
        if self.strip_prefix_space and piece:
            self.strip_prefix_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        self.pending += piece
        return self._take(final=False)

    def flush(self) -> str:
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        data = self.pending
        if final:
            self.pending = b""
            return data.decode("utf-8", errors="replace")
        cut = complete_utf8_prefix(data)
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")


LLAMA_CLASSES = ("LlamaTokenizer",)
GEMMA_CLASSES = ("GemmaTokenizer",)


def _prepend_scheme(config: TokenizerConfig) -> str:
    """transformers' LlamaTokenizer: no dummy prefix with add_prefix_space=False; a prefix before every chunk of
    text between added tokens with legacy=True; otherwise (legacy=False, or no `legacy` key) only at the start."""
    if config.add_prefix_space is False:
        return "never"
    return "always" if config.legacy else "first"


def _llama_pipeline(backend: Any, config: TokenizerConfig) -> None:
    """Metaspace pre-tokenizer (spaces become "▁", the dummy prefix per `_prepend_scheme`), byte-fallback decoder."""
    from tokenizers import decoders

    scheme = _prepend_scheme(config)
    backend.normalizer = tokenizer_compat.empty_normalizer()
    backend.pre_tokenizer = tokenizer_compat.metaspace(scheme)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if scheme != "never":
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)


def _gemma_pipeline(backend: Any) -> None:
    """Spaces become "▁" with no dummy prefix; byte-fallback decoder."""
    from tokenizers import decoders, normalizers

    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = tokenizer_compat.empty_pre_tokenizer()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])


def _set_byte_level_prefix(spec: Dict[str, Any], add_prefix_space: bool) -> None:
    """add_prefix_space from tokenizer_config.json wins over the ByteLevel pre-tokenizer's own setting."""
    pre = spec.get("pre_tokenizer")
    stack = [pre] if isinstance(pre, dict) else []
    while stack:
        node = stack.pop()
        if node.get("type") == "ByteLevel":
            node["add_prefix_space"] = add_prefix_space
        stack.extend(n for n in node.get("pretokenizers") or [] if isinstance(n, dict))


def _sentencepiece_like(spec: Dict[str, Any]) -> bool:
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and "ByteLevel" not in json.dumps(
        spec.get("pre_tokenizer") or {})


class FastTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (from tokenizer.json, or built from a BPE tokenizer.model) set up as transformers
    sets it up for the folder's tokenizer_config.json."""

    def __init__(self, backend: Any, config: TokenizerConfig, bos_id: Optional[int], eos_ids: Sequence[int],
                 byte_level: bool, control_ids: Iterable[int] = ()) -> None:
        self.tok = backend
        self.config = config
        self.byte_level = byte_level
        _add_config_tokens(backend, config)
        tokenizer_compat.set_encode_special_tokens(backend, config.split_special_tokens)
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        added = backend.get_added_tokens_decoder()
        self.added: Dict[int, Any] = {int(i): t for i, t in added.items()}
        own_bos = self._token_id(config.special.get("bos_token"))
        own_eos = self._token_id(config.special.get("eos_token"))
        # The tokenizer's own bos_token wins over config.json's bos_token_id, and so does its null (Qwen).
        self.bos_id = own_bos if "bos_token" in config.special else bos_id
        self.eos_ids = tuple(eos_ids) if eos_ids else ((own_eos,) if own_eos is not None else ())
        self.bos_token = self._special_text("bos_token", self.bos_id)
        self.eos_token = self._special_text("eos_token", self.eos_ids[0] if self.eos_ids else None)
        self.special: Set[int] = {i for i, t in self.added.items() if t.special} | set(control_ids)
        self.special |= {i for i in (self._token_id(config.special.get(k)) for k in config.special) if i is not None}
        self.prefix_ids, self.suffix_ids = self._added_around(
            self.bos_id, own_eos if own_eos is not None else (self.eos_ids[0] if self.eos_ids else None))
        self._bytes: List[bytes] = [self._piece_bytes(i) for i in range(self.vocab_size)]

    def _token_id(self, token: Optional[str]) -> Optional[int]:
        if not token:
            return None
        found = self.tok.token_to_id(token)
        return int(found) if found is not None else None

    def _special_text(self, key: str, fallback_id: Optional[int]) -> Optional[str]:
        """The config's text for a special token (None where it sets null), else the vocabulary's for the id."""
        if key in self.config.special:
            return self.config.special[key]
        return self.tok.id_to_token(fallback_id) if fallback_id is not None else None

    def _added_around(self, bos: Optional[int], eos: Optional[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """The ids transformers adds around a text: add_bos_token/add_eos_token when the config sets either (it then
        rebuilds the post-processor), else whatever tokenizer.json's post-processor adds."""
        config = self.config
        if config.add_bos_token is not None or config.add_eos_token is not None:
            prefix = (bos,) if config.add_bos_token and bos is not None else ()
            suffix = (eos,) if config.add_eos_token and eos is not None else ()
            return prefix, suffix
        if self.tok.post_processor is None:
            return (), ()
        probe = "a"
        plain = list(_tokenizer_call(self.tok.encode, probe, add_special_tokens=False).ids)
        full = list(_tokenizer_call(self.tok.encode, probe, add_special_tokens=True).ids)
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain):])
        return (), ()

    def _piece_bytes(self, i: int) -> bytes:
        if i in self.special:
            return b""
        if i in self.added:
            return str(self.added[i].content).encode("utf-8")
        piece = self.tok.id_to_token(i)
        if piece is None:
            return b""
        if self.byte_level:
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        value = _byte_piece(piece)
        if value is not None:
            return bytes([value])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _encode(self, text: str) -> List[int]:
        if len(text) > GIL_FREE_CHARS:
            return list(_tokenizer_call(self.tok.encode_batch, [text], add_special_tokens=False)[0].ids)
        return list(_tokenizer_call(self.tok.encode, text, add_special_tokens=False).ids)

    def decode_strips_prefix_space(self) -> bool:
        return not self.byte_level and self.adds_prefix_space()

    def decode(self, ids: Iterable[int]) -> str:
        return _tokenizer_call(self.tok.decode, [i for i in self._valid(ids) if i not in self.special],
                               skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""


def _add_config_tokens(backend: Any, config: TokenizerConfig) -> None:
    """Make the config's added tokens and special-token texts added tokens of `backend` (matched whole in text),
    as transformers does; tokens the backend already has keep their id and flags."""
    from tokenizers import AddedToken

    known = {str(t.content) for t in backend.get_added_tokens_decoder().values()}
    specs: List[AddedTokenSpec] = list(config.added_tokens)
    texts = [t for t in config.special.values() if t] + config.additional_special
    specs += [AddedTokenSpec(None, text) for text in texts]
    for spec in specs:
        if spec.content in known:
            continue
        known.add(spec.content)
        token = AddedToken(spec.content, single_word=spec.single_word, lstrip=spec.lstrip, rstrip=spec.rstrip,
                           normalized=spec.normalized, special=spec.special)
        if spec.id is None and backend.token_to_id(spec.content) is None:
            continue  # not in the vocabulary: transformers would append a new id past the model's embeddings
        if spec.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        got = backend.token_to_id(spec.content)
        if spec.id is not None and got != spec.id:
            log.warning("added token %r has id %s here, but tokenizer_config.json says %s", spec.content, got,
                        spec.id)


def _from_tokenizer_json(path: Path, config: TokenizerConfig, bos_id: Optional[int],
                         eos_ids: Sequence[int]) -> Tokenizer:
    try:
        spec = json.loads(read_model_text(path, MAX_TOKENIZER_BYTES))
        if config.add_prefix_space is not None:
            _set_byte_level_prefix(spec, config.add_prefix_space)
        backend = _tokenizer_call(tokenizer_compat.from_spec, spec)
    except ModelFormatError:
        raise
    except Exception as exc:
        raise ModelFormatError(f"{path} is not a readable tokenizer.json ({exc}).") from None
    if config.tokenizer_class in LLAMA_CLASSES and _sentencepiece_like(spec):
        _llama_pipeline(backend, config)
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
    return FastTokenizer(backend, config, bos_id, eos_ids, byte_level)


def _from_sentencepiece(path: Path, config: TokenizerConfig, bos_id: Optional[int],
                        eos_ids: Sequence[int]) -> Tokenizer:
    from tokenizers import AddedToken

    from kobold_backend.engine import sentencepiece_model as spm

    model = spm.read_model(path)
    if model.model_type != spm.BPE:
        return SentencePieceTokenizer(path, bos_id, eos_ids, config)
    try:
        backend: Any = spm.bpe_backend(model)
    except Exception as exc:
        raise ModelFormatError(f"{path} is not a usable sentencepiece BPE model ({exc}).") from None
    gemma = config.tokenizer_class in GEMMA_CLASSES or (
        config.tokenizer_class not in LLAMA_CLASSES and not model.add_dummy_prefix)
    if gemma:
        _gemma_pipeline(backend)
    else:
        _llama_pipeline(backend, config)
    # Control pieces (<s>, </s>) are special tokens, user-defined pieces plain added tokens: both matched whole.
    # Those tokenizer_config.json declares are added later with its flags.
    declared = {spec.content for spec in config.added_tokens}
    for kind, special in ((spm.CONTROL, True), (spm.USER_DEFINED, False)):
        tokens = [AddedToken(model.pieces[i][0], normalized=False, special=special) for i in model.ids_of_type(kind)
                  if model.pieces[i][0] not in declared]
        if tokens:
            (backend.add_special_tokens if special else backend.add_tokens)(tokens)
    if model.bos_id >= 0 and "bos_token" not in config.special and bos_id is None:
        bos_id = model.bos_id
    if model.eos_id >= 0 and not eos_ids and "eos_token" not in config.special:
        eos_ids = (model.eos_id,)
    controls = model.ids_of_type(spm.CONTROL) + model.ids_of_type(spm.UNKNOWN)
    return FastTokenizer(backend, config, bos_id, eos_ids, byte_level=False, control_ids=controls)


class SentencePieceTokenizer(Tokenizer):
    """A unigram sentencepiece model (not a Llama/Gemma BPE one) through the sentencepiece library itself."""

    def __init__(self, path: Path, bos_id: Optional[int], eos_ids: Sequence[int],
                 config: Optional[TokenizerConfig] = None) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise ModelFormatError(f"{path} is not a readable sentencepiece model ({exc}).") from None
        self.vocab_size = int(self.sp.GetPieceSize())
        sp_bos, sp_eos = self.sp.bos_id(), self.sp.eos_id()
        self.bos_id = bos_id if bos_id is not None else (sp_bos if sp_bos >= 0 else None)
        self.eos_ids = tuple(eos_ids) if eos_ids else ((sp_eos,) if sp_eos >= 0 else ())
        self.prefix_ids = (self.bos_id,) if self.bos_id is not None else ()
        if config is not None and config.add_bos_token is not None:  # T5: no BOS, EOS after the text
            self.prefix_ids = self.prefix_ids if config.add_bos_token else ()
            self.suffix_ids = self.eos_ids[:1] if config.add_eos_token else ()
        self.bos_token = self.sp.IdToPiece(self.bos_id) if self.bos_id is not None else None
        self.eos_token = self.sp.IdToPiece(self.eos_ids[0]) if self.eos_ids else None
        self._bytes: List[bytes] = [self._piece_bytes(i) for i in range(self.vocab_size)]

    def _piece_bytes(self, i: int) -> bytes:
        if self.sp.IsControl(i) or self.sp.IsUnknown(i):
            return b""
        piece = self.sp.IdToPiece(i)
        if self.sp.IsByte(i):
            value = _byte_piece(piece)
            return bytes([value]) if value is not None else b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def _encode(self, text: str) -> List[int]:
        return list(self.sp.EncodeAsIds(text))

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds(self._valid(ids))

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""


def load_tokenizer(
    folder: Union[str, Path], bos_id: Optional[int] = None, eos_ids: Sequence[int] = ()
) -> Tokenizer:
    """tokenizer.json if present (it is what the model's authors ship), else tokenizer.model; either way set up
    from tokenizer_config.json as transformers sets it up. `bos_id`/`eos_ids` (from config.json and
    generation_config.json) are used where the tokenizer's own files name none."""
    folder = Path(folder)
    config = read_tokenizer_config(folder)
    if is_model_file(folder / "tokenizer.json"):
        tokenizer = _from_tokenizer_json(folder / "tokenizer.json", config, bos_id, eos_ids)
    elif is_model_file(folder / "tokenizer.model"):
        tokenizer = _from_sentencepiece(folder / "tokenizer.model", config, bos_id, eos_ids)
    else:
        raise ModelFormatError(f"{folder} has no tokenizer (expected tokenizer.json or tokenizer.model).")
    if config.chat_template is not None:
        try:
            compile_template(config.chat_template)
        except TemplateCompileError as e:
            raise ModelFormatError(f"{folder}: the chat template does not compile ({e}).") from None
    tokenizer.chat_template = config.chat_template
    return tokenizer


# Special tokens are written as text such as "<|eot_id|>" and count as one token: no such text is longer than this.
SPECIAL_TEXT_BYTES = 64


def surely_longer_than(tokenizer: Tokenizer, text: str, limit: int) -> bool:
    """True when `text` certainly tokenizes to more than `limit` tokens, decided without tokenizing it: no token
    covers more bytes than the longest piece of the vocabulary (or a special token's text)."""
    widest = getattr(tokenizer, "_widest_token", None)
    if widest is None:
        widest = max([SPECIAL_TEXT_BYTES] + [len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)])
        tokenizer._widest_token = widest  # type: ignore[attr-defined]
    return len(text) > limit * widest or len(text.encode("utf-8", "surrogatepass")) > limit * widest


# encode_tail: the first window is this many characters per kept token (text averages about four).
TAIL_CHARS_PER_TOKEN = 8
TAIL_MIN_CHARS = 256


def encode_tail(tokenizer: Tokenizer, text: str, keep: int) -> Tuple[List[int], bool]:
    """(the last `keep` ids of tokenizer.encode(text), whether those are all of its ids), tokenizing only a suffix
    of `text` when it is long: the window doubles until two windows of different start agree on the last `keep`
    ids (a tokenization resynchronises a few tokens after wherever the text is cut), or covers the whole text.
    The work is bounded by the kept part, not by the length of the text."""
    if keep <= 0:
        return [], not text
    size = max(TAIL_MIN_CHARS, TAIL_CHARS_PER_TOKEN * keep)
    previous: Optional[List[int]] = None
    while size < len(text):
        ids = tokenizer.encode(text[len(text) - size:], add_bos=False)
        if len(ids) > keep + 1:  # the window's first token may be a piece cut by the window, never among those kept
            tail = ids[len(ids) - keep:]
            if tail == previous:
                return tail, False
            previous = tail
        size *= 2
    ids = tokenizer.encode(text, add_bos=False)
    return ids[max(0, len(ids) - keep):], len(ids) <= keep
