"""Tokenizers: sentencepiece `tokenizer.model` and `tokenizer.json` (tokenizers package), one interface.

Streaming decodes token bytes, not strings, so a piece's leading space is never dropped and a
UTF-8 character split across byte-fallback tokens is only emitted once it is whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from kobold_backend.errors import ModelFormatError


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
    """Common interface; use `load_tokenizer(folder)`."""

    bos_id: Optional[int]
    eos_ids: Tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
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
        return StreamDecoder(self, strip_prefix_space=not continuation and self.adds_prefix_space())

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


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path, bos_id: Optional[int], eos_ids: Sequence[int]) -> None:
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
        self._bytes: List[bytes] = [self._piece_bytes(i) for i in range(self.vocab_size)]

    def _piece_bytes(self, i: int) -> bytes:
        if self.sp.IsControl(i) or self.sp.IsUnknown(i):
            return b""
        piece = self.sp.IdToPiece(i)
        if self.sp.IsByte(i):
            value = _byte_piece(piece)
            return bytes([value]) if value is not None else b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        ids = list(self.sp.EncodeAsIds(text))
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds(self._valid(ids))

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""


class HFTokenizer(Tokenizer):
    """tokenizer.json through the `tokenizers` package: byte-level BPE (Llama 3) or metaspace (Llama 2)."""

    def __init__(self, path: Path, bos_id: Optional[int], eos_ids: Sequence[int]) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.tok = RustTokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as exc:
            raise ModelFormatError(f"{path} is not a readable tokenizer.json ({exc}).") from None
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        self.special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        config = _read_tokenizer_config(path.parent)
        self.bos_id = bos_id if bos_id is not None else self._token_id(config.get("bos_token"))
        eos = self._token_id(config.get("eos_token"))
        self.eos_ids = tuple(eos_ids) if eos_ids else ((eos,) if eos is not None else ())
        self._bytes: List[bytes] = [self._piece_bytes(i) for i in range(self.vocab_size)]

    def _token_id(self, token: object) -> Optional[int]:
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        return self.tok.token_to_id(token)

    def _piece_bytes(self, i: int) -> bytes:
        if i in self.special:
            return b""
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

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False).ids)
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(self._valid(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return b""


def _read_tokenizer_config(folder: Path) -> Dict[str, object]:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise ModelFormatError(f"{path} is not valid JSON.") from None
    return data if isinstance(data, dict) else {}


def load_tokenizer(
    folder: str | Path, bos_id: Optional[int] = None, eos_ids: Sequence[int] = ()
) -> Tokenizer:
    """tokenizer.json if present (it is what the model's authors ship), else tokenizer.model."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder / "tokenizer.json", bos_id, eos_ids)
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model", bos_id, eos_ids)
    raise ModelFormatError(f"{folder} has no tokenizer (expected tokenizer.json or tokenizer.model).")


def chat_template(folder: str | Path) -> Optional[str]:
    """The model's own chat template from tokenizer_config.json, if it has one."""
    template = _read_tokenizer_config(Path(folder)).get("chat_template")
    return template if isinstance(template, str) else None


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
