"""GGUF vocabularies of the families whose tokenizers differ (Gemma's sentencepiece without a dummy prefix, Qwen2's
byte-level BPE with its own split regex and no BOS, Llama-2/Phi-3's legacy sentencepiece with control pieces)
written the way convert_hf_to_gguf.py writes them, read back by the engine, and compared id for id with the
Hugging Face tokenizer of the folder they came from (tests/fixtures/tokenizer_families.py), or for Llama 2 with
sentencepiece itself, which llama.cpp follows where transformers' LlamaTokenizer differs (text that starts with a
space)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable, Dict

import gguf
import pytest
import sentencepiece as spm
import transformers

from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.gguf.tokenizer_files import tokenizer_files
from kobold_backend.engine.tokenizer import Tokenizer, load_tokenizer
from tests.fixtures.gguf_files import sentencepiece_token_type
from tests.fixtures.tokenizer_families import write_gemma, write_llama2, write_qwen2

TEXTS = ["Hello world", "  two leading spaces", "digits 1234567 and emoji 🙂", "Ünïcödé — 日本語のテキスト",
         "line\nbreaks\n\n  and   spaces", "it's we'll THEY'RE", "tabs\tand\r\ncarriage"]


def _spm_vocab(writer: gguf.GGUFWriter, folder: Path, add_space_prefix: bool) -> None:
    """_set_vocab_sentencepiece: every piece with its score and type, then the special ids of tokenizer_config."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    types = [sentencepiece_token_type(sp, i) for i in range(sp.get_piece_size())]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for tid, entry in config.get("added_tokens_decoder", {}).items():
        if int(tid) < len(types) and entry.get("special"):
            types[int(tid)] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(types)
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    for name in ("bos", "eos", "unk", "pad"):
        token = config.get(f"{name}_token")
        if token in pieces:
            getattr(writer, f"add_{'unk' if name == 'unk' else name}_token_id")(pieces[token])
    writer.add_add_bos_token(bool(config.get("add_bos_token", True)))
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)


def _bpe_vocab(writer: gguf.GGUFWriter, folder: Path, pre: str) -> None:
    """_set_vocab_gpt2: the vocabulary with added tokens (special: CONTROL, else USER_DEFINED), merges, `pre`."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(spec["model"]["vocab"])
    kinds: Dict[int, int] = {}
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([kinds.get(i, gguf.TokenType.NORMAL) for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))


def _gguf_tokenizer(tmp: Path, arch: str, write_vocab: Callable[[gguf.GGUFWriter], None]) -> Tokenizer:
    path = tmp / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    write_vocab(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = GGUFFile(path).metadata
    with tempfile.TemporaryDirectory(dir=tmp) as folder:
        for name, data in tokenizer_files(meta, path.name).items():
            (Path(folder) / name).write_bytes(data)
        return load_tokenizer(folder, meta.get("tokenizer.ggml.bos_token_id"),
                              (meta["tokenizer.ggml.eos_token_id"],))


@pytest.mark.parametrize("family", ["gemma", "qwen2", "llama2"])
def test_gguf_vocabulary_matches_source_tokenizer(family: str, tmp_path: Path) -> None:
    source = tmp_path / family
    if family == "gemma":
        write_gemma(source)
        tok = _gguf_tokenizer(tmp_path, "gemma2", lambda w: _spm_vocab(w, source, add_space_prefix=False))
    elif family == "qwen2":
        write_qwen2(source)
        tok = _gguf_tokenizer(tmp_path, "qwen2", lambda w: _bpe_vocab(w, source, "qwen2"))
    else:
        write_llama2(source, legacy=True)
        tok = _gguf_tokenizer(tmp_path, "phi3", lambda w: _spm_vocab(w, source, add_space_prefix=True))
    hf = transformers.AutoTokenizer.from_pretrained(str(source))
    turns = {"gemma": ["<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"],
             "qwen2": ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"], "llama2": []}
    # Llama 2 / Phi-3: llama.cpp, like sentencepiece itself, puts one "▁" before text that already starts with a
    # space; transformers' LlamaTokenizer (Metaspace) does not (tests/test_gguf_tokenizers_llamacpp.py).
    sp = spm.SentencePieceProcessor(model_file=str(source / "tokenizer.model")) if family == "llama2" else None
    for text in TEXTS + turns[family]:
        expected = sp.encode(text) if sp is not None else hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == expected, (family, text)
        assert tok.decode(expected) == hf.decode(expected, skip_special_tokens=True), (family, text)
    with_bos = hf.encode("Hello world")
    assert tok.encode("Hello world", add_bos=family != "qwen2") == with_bos
