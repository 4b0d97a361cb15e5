"""Tokenizers against transformers' AutoTokenizer on the same folder: encode/decode, special ids, streaming decode
across byte-fallback pieces, and out-of-vocabulary ids. (Per-family fidelity: test_tokenizer_fidelity.py.)"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, List

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer

from kobold_backend.engine.loader import load_model
from kobold_backend.engine.tokenizer import Tokenizer, load_tokenizer
from tests.fixtures.checkpoints import CheckpointFactory

TEXTS = [
    "Hello world",
    "The GNU General Public License is a free, copyleft license.",
    "  two leading spaces and   three inside",
    " one leading space",
    "\nstarts with a newline\n\nand has blank lines\n",
    "tabs\tand trailing spaces   ",
    "naïve café, déjà vu",
    "漢字かな交じり文",
    "emoji 😀 and a family 👨‍👩‍👧 and a flag 🇫🇷!",
    "mixed: é\n漢 😀 x",
    "digits 1234567890 and symbols <>&%$#@",
]


@functools.lru_cache(maxsize=None)
def auto_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def reference(kind: str, folder: Path) -> Callable[[str], List[int]]:
    return lambda text: auto_tokenizer(folder)(text, add_special_tokens=False).input_ids


def reference_decode(kind: str, folder: Path) -> Callable[[List[int]], str]:
    return lambda ids: auto_tokenizer(folder).decode(ids, skip_special_tokens=True)


def round_trips(kind: str, text: str) -> bool:
    """A text that starts with a space gets no dummy prefix (its own space is the "▁"), and decoding drops the
    first space of a sentencepiece text: so such a text comes back without its first space, as in transformers."""
    return not (kind == "spm" and text.startswith(" "))


@pytest.fixture(params=["spm", "bpe"])
def tok(request: pytest.FixtureRequest, spm_dir: Path, bpe_dir: Path):
    folder = spm_dir if request.param == "spm" else bpe_dir
    return request.param, folder, load_tokenizer(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_the_library(text: str, tok) -> None:
    kind, folder, ours = tok
    ids = reference(kind, folder)(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == reference_decode(kind, folder)(ids)
    assert ours.decode(ids) == (text if round_trips(kind, text) else text[1:])


def test_special_ids_come_from_the_model_folder(checkpoints: CheckpointFactory) -> None:
    spm_model = load_model(checkpoints.get("dense_fp16").path, device="cpu").tokenizer
    assert (spm_model.bos_id, tuple(spm_model.eos_ids), spm_model.vocab_size) == (1, (2,), 1000)
    assert spm_model.encode("Hello", add_bos=True) == [1] + spm_model.encode("Hello")

    built = checkpoints.get("llama3_rope")
    bpe_model = load_model(built.path, device="cpu").tokenizer
    ref = HFTokenizer.from_file(str(built.path / "tokenizer.json"))
    bos, eos, eot = (ref.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    assert (bpe_model.bos_id, set(bpe_model.eos_ids)) == (bos, {eos, eot})
    assert bpe_model.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert bpe_model.encode("Hello there", add_bos=True) == ref.encode("Hello there").ids
    assert ref.encode("Hello there").ids[0] == bos


def test_fixture_texts_split_characters_across_tokens(tok) -> None:
    """The streaming tests below only prove something if multi-byte characters span several tokens."""
    kind, folder, _ = tok
    ids = reference(kind, folder)("é 漢 😀")
    if kind == "spm":
        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        assert sum(sp.is_byte(i) for i in ids) >= 2 + 3 + 4
    else:
        assert len(ids) >= 2 + 3 + 4


def stream(ours: Tokenizer, ids: List[int]) -> List[str]:
    decoder = ours.stream_decoder()
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decode_equals_decode(text: str, tok) -> None:
    kind, _, ours = tok
    ids = ours.encode(text)
    chunks = stream(ours, ids)
    assert "".join(chunks) == ours.decode(ids) == (text if round_trips(kind, text) else text[1:])
    # never a partial character: no replacement character, and nothing held back once the text is complete
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[-1] == ""


def test_stream_emits_each_character_as_soon_as_it_is_complete(tok) -> None:
    _, _, ours = tok
    text = "a 漢字 😀 b"
    ids = ours.encode(text)
    decoder = ours.stream_decoder()
    emitted = ""
    for n, i in enumerate(ids):
        emitted += decoder.feed(i)
        # after each token: exactly the whole characters among the bytes fed so far, never a partial one
        fed = len(b"".join(ours.token_bytes(t) for t in ids[: n + 1])) - int(ours.decode_strips_prefix_space())
        whole = max(k for k in range(len(text) + 1) if len(text[:k].encode("utf-8")) <= fed)
        assert emitted == text[:whole]
    assert emitted == text


def test_out_of_vocabulary_ids_are_skipped(tok) -> None:
    _, _, ours = tok
    ids = ours.encode("skip the bad ids 😀")
    bad = [ours.vocab_size, ours.vocab_size + 7, 10**6, -1]
    mixed = [bad[0]] + ids[:3] + bad + ids[3:] + [bad[1]]
    assert ours.decode(mixed) == ours.decode(ids)
    assert "".join(stream(ours, mixed)) == "".join(stream(ours, ids))


def test_piece_text_keeps_the_leading_space(tok) -> None:
    kind, folder, ours = tok
    (the,) = reference(kind, folder)(" the")[-1:]
    assert ours.piece_text(the) == " the"


def test_continuation_stream_keeps_the_space_after_a_prompt(tok) -> None:
    _, _, ours = tok
    prompt, reply = ours.encode("Once upon"), ours.encode(" a time there was")
    decoder = ours.stream_decoder(continuation=True)
    streamed = "".join(decoder.feed(i) for i in reply) + decoder.flush()
    whole = ours.decode(prompt + reply)
    assert streamed == whole[len(ours.decode(prompt)):]
    assert streamed.startswith(" ")
