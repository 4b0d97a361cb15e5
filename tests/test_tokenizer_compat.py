"""engine/tokenizer_compat.py: tokenizer.json files of the newest `tokenizers` layout read by any release from 0.15
(KoboldAI United's), and the Python steps that stand in for what an older release lacks. Under a new release the
Python steps are forced on and compared with the release's own implementation of the same feature; under any
release, a newest-layout file must tokenize as the installed release's own file of the same tokenizer, and the
BPE definition decides the ignore_merges and spaced-merge cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import tokenizers
from packaging.version import Version
from tokenizers import AddedToken, Tokenizer, pre_tokenizers

from kobold_backend.engine import sentencepiece_model as spm
from kobold_backend.engine import tokenizer_compat as compat
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import ModelFormatError
from tests.fixtures.tokenizer_layouts import newest_layout
from tests.fixtures.tokenizers import BPE_SPECIALS, byte_bpe_json, qwen2_bpe_json
from tests.test_tokenizer import TEXTS

INSTALLED = compat.installed_features()
OLD = compat.Features(metaspace_split=False, ignore_merges=False, pair_merges=False, none_components=False,
                      encode_special_tokens=False)
NEW = Version(tokenizers.__version__) >= Version("0.20")
WITH_SPECIALS = TEXTS + ["<s>" + TEXTS[1], TEXTS[0] + "<s> " + TEXTS[2] + "</s>", "<s>", " <s>x"]


def test_features_follow_the_release_notes() -> None:
    version = Version(tokenizers.__version__)
    assert INSTALLED.metaspace_split == INSTALLED.ignore_merges == INSTALLED.none_components == (
        version >= Version("0.19"))
    assert INSTALLED.pair_merges == (version >= Version("0.20"))
    assert INSTALLED.encode_special_tokens == (version >= Version("0.15.1"))


def spm_backend(spm_dir: Path) -> Any:
    backend = spm.bpe_backend(spm.read_model(spm_dir / "tokenizer.model"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    return backend


@pytest.mark.skipif(not INSTALLED.metaspace_split, reason="compares with Metaspace(split=False), tokenizers>=0.19")
@pytest.mark.parametrize("scheme", ["always", "first", "never"])
def test_metaspace_step_equals_the_release_metaspace(spm_dir: Path, scheme: str) -> None:
    ours, native = spm_backend(spm_dir), spm_backend(spm_dir)
    ours.pre_tokenizer = compat.metaspace(scheme, OLD)
    native.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    for text in WITH_SPECIALS:
        assert ours.encode(text, add_special_tokens=False).ids == native.encode(text, add_special_tokens=False).ids


def spm_json(spm_dir: Path, scheme: str) -> Dict[str, Any]:
    """The fixture's sentencepiece BPE as a tokenizer.json, laid out as the newest Llama/Mistral repos have it."""
    spec = json.loads(spm_backend(spm_dir).to_str())
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": False}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return newest_layout(spec, metaspace_split=False)


@pytest.mark.skipif(not NEW, reason="the newest layout is checked against tokenizers>=0.20's own output")
def test_newest_layout_is_what_the_newest_release_writes(spm_dir: Path) -> None:
    for spec in (newest_layout(json.loads(byte_bpe_json()), ignore_merges=True), spm_json(spm_dir, "first")):
        written = json.loads(Tokenizer.from_str(json.dumps(spec)).to_str())
        for key in ("model", "pre_tokenizer", "decoder"):
            assert written[key] == spec[key]


def write_folder(folder: Path, spec: Dict[str, Any], config: Dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_newest_byte_level_files_tokenize_as_the_installed_layout(name: str, tmp_path: Path) -> None:
    spec = json.loads(byte_bpe_json() if name == "llama3" else qwen2_bpe_json())
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    installed = load_tokenizer(write_folder(tmp_path / "installed", spec, config))
    newest = load_tokenizer(write_folder(tmp_path / "newest", newest_layout(spec), config))
    for text in WITH_SPECIALS + ["".join(BPE_SPECIALS) + TEXTS[1]]:
        ids = installed.encode(text, add_bos=True)
        assert newest.encode(text, add_bos=True) == ids
        assert newest.decode(ids) == installed.decode(ids)


def test_newest_metaspace_file_tokenizes_as_the_sentencepiece_model(spm_dir: Path, tmp_path: Path) -> None:
    """tokenizer.json with Metaspace(prepend_scheme=always, split=false) is what transformers builds for the
    legacy Llama tokenizer.model of spm_dir: the two folders must agree."""
    config = json.loads((spm_dir / "tokenizer_config.json").read_text())
    newest = load_tokenizer(write_folder(tmp_path / "newest", spm_json(spm_dir, "always"),
                                         dict(config, tokenizer_class="PreTrainedTokenizerFast")))
    model = load_tokenizer(spm_dir)
    for text in WITH_SPECIALS:
        ids = model.encode(text)
        assert newest.encode(text) == ids
        assert newest.decode(ids) == model.decode(ids)


def without_merge_of(spec: Dict[str, Any], word: str) -> Dict[str, Any]:
    """`spec` (newest layout) without the merge that makes `word`, so BPE alone can no longer reach it."""
    model = spec["model"]
    model["merges"] = [m for m in model["merges"] if m[0] + m[1] != word]
    return spec


@pytest.mark.parametrize("features", ["installed", "python"])
def test_ignore_merges_takes_a_whole_vocabulary_word(features: str) -> None:
    have = INSTALLED if features == "installed" else OLD
    vocab = json.loads(byte_bpe_json())["model"]["vocab"]
    word = max((w for w in vocab if w.startswith("\u0120") and w[1:].isascii() and w[1:].isalpha()), key=len)
    text = " " + word[1:]
    spec = without_merge_of(newest_layout(json.loads(byte_bpe_json()), ignore_merges=True), word)
    kept = compat.from_spec(spec, have)
    assert kept.encode(text, add_special_tokens=False).ids == [vocab[word]]
    spec["model"]["ignore_merges"] = False
    assert len(compat.from_spec(spec, have).encode(text, add_special_tokens=False).ids) > 1


@pytest.mark.skipif(not INSTALLED.ignore_merges, reason="compares with BPE(ignore_merges=True), tokenizers>=0.19")
def test_ignore_merges_step_equals_the_release_bpe() -> None:
    vocab = json.loads(byte_bpe_json())["model"]["vocab"]
    words = sorted((w for w in vocab if w.startswith("\u0120") and w[1:].isascii() and w[1:].isalpha()), key=len)[-20:]
    spec = newest_layout(json.loads(byte_bpe_json()), ignore_merges=True)
    for word in words:
        spec = without_merge_of(spec, word)
    ours, native = compat.from_spec(spec, OLD), compat.from_spec(spec)
    texts: List[str] = WITH_SPECIALS + [" ".join(w[1:] for w in words)]
    for text in texts:
        assert ours.encode(text).ids == native.encode(text).ids


@pytest.mark.parametrize("features", ["installed", "python"])
def test_merges_of_pieces_with_spaces(features: str) -> None:
    """BPE by definition: merges apply in rank order, so "a b a" is "a b", " ", "a"."""
    have = INSTALLED if features == "installed" else OLD
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {"a": 0, " ": 1, "b": 2, "a ": 3, "a b": 4}, "merges": [["a", " "], ["a ", "b"]]}}
    assert compat.from_spec(spec, have).encode("a b a").ids == [4, 1, 0]


def test_split_special_tokens_needs_encode_special_tokens(spm_dir: Path) -> None:
    backend = spm_backend(spm_dir)
    compat.set_encode_special_tokens(backend, False, OLD)
    with pytest.raises(ModelFormatError, match="split_special_tokens, which needs tokenizers>=0.15.1"):
        compat.set_encode_special_tokens(backend, True, OLD)
