"""The tokenizer United sees (kobold_backend.host.tokenizer_adapter) against sentencepiece and tokenizers:
continuation-style encoding (no dummy-prefix space), decode keeping leading spaces, every id type United
passes, out-of-vocabulary ids, and __call__. Covered: a Llama sentencepiece model, a Llama-2-style
tokenizer.json built from it, and a Llama-3-style byte-level BPE tokenizer.json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest
import sentencepiece as spm
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.host.tokenizer_adapter import UnitedTokenizer
from tests.fixtures.tokenizers import SPM_SPECIALS, corpus_lines

TEXTS = [
    "Hello world",
    "The GNU General Public License is a free, copyleft license.",
    "naïve café, déjà vu",
    "digits 1234567890 and [bracketed] words",
    "emoji 😀 here",
]


def llama2_tokenizer_json(spm_model: Path, folder: Path) -> Path:
    """A Llama-2-style tokenizer.json (BPE with byte fallback, Prepend("▁") + Replace(" ", "▁") normalizer)
    built from the sentencepiece model, the way transformers' LlamaConverter does."""
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges: List[Tuple[int, int, str, str]] = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((pid, vocab[left], left, right))
    merges.sort(key=lambda m: (m[0], m[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(m[2], m[3]) for m in merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(content, special=True, normalized=False)
                            for _, content in sorted(SPM_SPECIALS.values())])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llama2_json_dir(spm_dir: Path, fixture_root: Path) -> Path:
    return llama2_tokenizer_json(spm_dir / "tokenizer.model", fixture_root / "tokenizer-llama2-json")


@pytest.fixture(scope="module")
def lines() -> List[str]:
    """Corpus lines with single spaces only (so chunks split before spaces are word boundaries)."""
    return [line for line in corpus_lines()[:400] if "  " not in line and len(line) > 3][:150]


def chunks(text: str) -> List[str]:
    """How United builds a context: pieces encoded separately, each after the first starting with a space."""
    return [c for c in re.split(r"(?= )", text) if c]


def sp_reference(spm_dir: Path) -> Callable[[str], List[int]]:
    return spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model")).encode


def test_sentencepiece_encodes_continuations_like_sentencepiece_mid_text(spm_dir: Path, lines: List[str]) -> None:
    sp_encode = sp_reference(spm_dir)
    tok = UnitedTokenizer(load_tokenizer(spm_dir))
    assert tok.prefix_space
    for line in lines:
        # sentencepiece's own encoding of `line` is the encoding of " " + line as it reads inside a text
        assert tok.encode(" " + line) == sp_encode(line), line
        assert sum((tok.encode(c) for c in chunks(" " + line)), []) == sp_encode(line), line
        assert tok.decode(sp_encode(line)) == " " + line
        assert tok.decode(tok.encode(line)) == line


def test_no_leading_space_is_invented_or_lost(spm_dir: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tok = UnitedTokenizer(load_tokenizer(spm_dir))
    hello, spaced = tok.encode("Hello"), tok.encode(" Hello")
    assert hello != spaced
    assert tok.decode(hello) == "Hello" and tok.decode(spaced) == " Hello"
    # " Hello" is what sentencepiece produces for "Hello" at the start of a text
    assert spaced == sp.encode("Hello")
    assert tok.encode("") == [] and tok.decode([]) == ""
    assert tok.decode(tok.encode("a") + tok.encode(" b") + tok.encode("\n\nc")) == "a b\n\nc"


@pytest.mark.parametrize("text", TEXTS)
def test_llama2_tokenizer_json_matches_sentencepiece(text: str, spm_dir: Path, llama2_json_dir: Path) -> None:
    assert not (llama2_json_dir / "tokenizer.model").exists()
    sp_tok = UnitedTokenizer(load_tokenizer(spm_dir))
    json_tok = UnitedTokenizer(load_tokenizer(llama2_json_dir))
    assert json_tok.prefix_space
    raw = Tokenizer.from_file(str(llama2_json_dir / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == sp_reference(spm_dir)(text)  # the fixture is sound
    for piece in (text, " " + text, "\n" + text):
        assert json_tok.encode(piece) == sp_tok.encode(piece)
        assert json_tok.decode(json_tok.encode(piece)) == piece


def test_byte_level_bpe_needs_no_fix(bpe_dir: Path, lines: List[str]) -> None:
    raw = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tok = UnitedTokenizer(load_tokenizer(bpe_dir))
    assert not tok.prefix_space
    for line in lines:
        ids = raw.encode(line, add_special_tokens=False).ids
        assert tok.encode(line) == ids
        assert sum((tok.encode(c) for c in chunks(line)), []) == ids, line
        assert tok.decode(ids) == raw.decode(ids) == line


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_decode_accepts_what_united_passes(kind: str, spm_dir: Path, bpe_dir: Path) -> None:
    tok = UnitedTokenizer(load_tokenizer(spm_dir if kind == "spm" else bpe_dir))
    ids = tok.encode(" The cat sat\non the mat.")
    text = tok.decode(ids)
    assert text == " The cat sat\non the mat."
    forms: Dict[str, object] = {
        "list": ids, "tuple": tuple(ids), "numpy": np.array(ids), "tensor": torch.tensor(ids),
        "2d-row": torch.tensor([ids])[0],
    }
    for name, form in forms.items():
        assert tok.decode(form) == text, name
    newline = tok.encode("\n")
    assert len(newline) == 1
    for single in (newline[0], np.int64(newline[0]), torch.tensor(newline[0])):
        assert tok.decode(single) == "\n"  # never "<0x0A>" or "Ċ"
    # United's warm-up decodes GPT-2 ids; ids past the vocabulary contribute nothing
    assert tok.decode([25678, 559]) == tok.decode([559])
    assert tok.decode([10 ** 9, -1]) == ""
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id]) == text


def test_call_returns_input_ids_like_transformers(spm_dir: Path) -> None:
    tok = UnitedTokenizer(load_tokenizer(spm_dir))
    one = tok("Hello world")
    assert one.input_ids == tok.encode("Hello world") == one["input_ids"]
    assert one.attention_mask == [1] * len(one.input_ids)
    many = tok(["a b", " c"])
    assert many.input_ids == [tok.encode("a b"), tok.encode(" c")]
    assert tok._koboldai_header == []
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1


def test_bracket_tokens_are_every_piece_with_a_bracket(spm_dir: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "tokenizer.model"))
    tok = UnitedTokenizer(load_tokenizer(spm_dir))
    expected = [i for i in range(sp.get_piece_size())
                if not sp.is_control(i) and ("[" in sp.id_to_piece(i) or "]" in sp.id_to_piece(i)
                                             or sp.is_byte(i) and sp.id_to_piece(i) in ("<0x5B>", "<0x5D>"))]
    assert expected and tok.token_ids_containing("[]") == expected
