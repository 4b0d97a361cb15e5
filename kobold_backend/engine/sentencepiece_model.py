"""A sentencepiece `tokenizer.model` read without protobuf, and its BPE pieces turned into a `tokenizers` model.

transformers encodes with a `tokenizers` BPE built from the sentencepiece pieces (not with sentencepiece itself):
the vocabulary is the piece list, and the merges are every split of a piece into two pieces of the vocabulary,
ranked by the id of the merged piece and then by the length of its left part. Building the same model here gives
the same ids as `AutoTokenizer`, and the pipeline around it (dummy prefix, added tokens) is chosen by the caller.

Only the fields used are read: ModelProto.pieces (1), .trainer_spec (2), .normalizer_spec (3); a piece's text (1),
score (2) and type (3); the trainer's model_type (3), byte_fallback (35) and unk/bos/eos ids (40-42); the
normalizer's add_dummy_prefix (3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Tuple, Union

from kobold_backend.engine.model_files import MAX_TOKENIZER_BYTES, read_model_bytes
from kobold_backend.errors import ModelFormatError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


@dataclass
class SentencePieceModel:
    """What a tokenizer.model says about its pieces and how it encodes."""

    pieces: List[Tuple[str, float, int]] = field(default_factory=list)  # (text, score, type) by id
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    add_dummy_prefix: bool = True
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def ids_of_type(self, kind: int) -> List[int]:
        return [i for i, (_, _, t) in enumerate(self.pieces) if t == kind]


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[Tuple[int, Union[int, bytes]]]:
    """(field number, value) of each field of one protobuf message: ints for varints, bytes otherwise."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: Union[int, bytes]
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated field")
        yield number, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def parse_model(data: bytes) -> SentencePieceModel:
    model = SentencePieceModel()
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            text, score, kind = "", 0.0, NORMAL
            for n, v in _fields(value):
                if n == 1 and isinstance(v, bytes):
                    text = v.decode("utf-8")
                elif n == 2 and isinstance(v, bytes):
                    score = struct.unpack("<f", v)[0]
                elif n == 3 and isinstance(v, int):
                    kind = v
            model.pieces.append((text, score, kind))
        elif number == 2 and isinstance(value, bytes):
            for n, v in _fields(value):
                if not isinstance(v, int):
                    continue
                if n == 3:
                    model.model_type = v
                elif n == 35:
                    model.byte_fallback = bool(v)
                elif n == 40:
                    model.unk_id = _signed(v)
                elif n == 41:
                    model.bos_id = _signed(v)
                elif n == 42:
                    model.eos_id = _signed(v)
        elif number == 3 and isinstance(value, bytes):
            for n, v in _fields(value):
                if n == 3 and isinstance(v, int):
                    model.add_dummy_prefix = bool(v)
    return model


def read_model(path: Path) -> SentencePieceModel:
    try:
        model = parse_model(read_model_bytes(path, MAX_TOKENIZER_BYTES))
    except ModelFormatError:
        raise
    except (OSError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ModelFormatError(f"{path} is not a readable sentencepiece model ({exc}).") from None
    if not model.pieces:
        raise ModelFormatError(f"{path} is not a readable sentencepiece model (it has no pieces).")
    return model


def bpe_merges(vocab: Dict[str, int]) -> List[Tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, in the order BPE applies them: by the merged piece's
    id (sentencepiece BPE ids follow merge order), then the shorter left part first."""
    # Only cuts whose two lengths are lengths of pieces are tried, so the work is bounded by the file's size: a
    # single very long piece is not split at every character.
    present = {len(piece) for piece in vocab}
    lengths = sorted(present)
    ranked = []
    for piece, piece_id in vocab.items():
        n = len(piece)
        for cut in lengths:
            if cut >= n:
                break
            if n - cut not in present:
                continue
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((piece_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def bpe_backend(model: SentencePieceModel) -> object:
    """A `tokenizers.Tokenizer` with this model's BPE pieces and merges; no normalizer, pre-tokenizer or decoder."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE as BPEModel

    vocab: Dict[str, int] = {}
    for i, (text, _, _) in enumerate(model.pieces):
        vocab.setdefault(text, i)
    unk = model.pieces[model.unk_id][0] if 0 <= model.unk_id < len(model.pieces) else None
    bpe = BPEModel(vocab=vocab, merges=bpe_merges(vocab), unk_token=unk, fuse_unk=True,
                   byte_fallback=model.byte_fallback)
    return Tokenizer(bpe)
