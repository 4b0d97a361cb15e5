"""The malformed model files the fuzz suite found or the GGUF/safetensors format definitions name, one by one:
each is refused with one sentence naming the file and the field (or, for chat templates, the bound it crossed),
quickly and without allocating by an unchecked header value. GGUF bytes are written field by field here from the
format definition (llama.cpp's docs/gguf.md), independently of the engine's reader."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kobold_backend.engine.chat_template import ChatFormatter, TemplateCompileError, TemplateRenderError
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.exl2 import load_exl2_linear
from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.sentencepiece_model import bpe_merges
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from tests.fixtures import fuzz_files as ff

U8, U32, I32, F32, STRING, ARRAY, U64 = 0, 4, 5, 6, 8, 9, 10


def s(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def tensor(name: str, dims: Sequence[int], kind: int = 0, offset: int = 0) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", kind, offset)


def gguf_bytes(kvs: Sequence[bytes] = (), tensors: Sequence[bytes] = (), data: bytes = b"", version: int = 3,
               counts: Optional[Tuple[int, int]] = None, alignment: int = 32) -> bytes:
    n_tensors, n_kv = counts if counts is not None else (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % alignment) + data


ARCH = kv("general.architecture", STRING, s("llama"))

GGUF_CASES: List[Tuple[str, bytes, str]] = [
    ("empty", b"", "it is empty"),
    ("not gguf", b"GGML" + b"\0" * 20, "does not start with the bytes GGUF"),
    ("version 1", gguf_bytes(version=1), "GGUF version 1"),
    ("big-endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    ("metadata count", gguf_bytes(counts=(0, 2**63)), "claims 9223372036854775808 metadata entries"),
    ("tensor count", gguf_bytes([ARCH], counts=(2**40, 1)), "claims 1099511627776 tensors"),
    ("key length", b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**64 - 1) + b"\0" * 16,
     "metadata key 0 runs past the end"),
    ("string length", gguf_bytes([kv("general.name", STRING, struct.pack("<Q", 2**62))]),
     "metadata general.name runs past the end"),
    ("string array", gguf_bytes([kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2**61))]),
     "tokenizer.ggml.tokens claims 2305843009213693952 strings"),
    ("number array", gguf_bytes([kv("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", F32, 2**62))]),
     "tokenizer.ggml.scores claims 4611686018427387904 values"),
    ("nested array", gguf_bytes([kv("x", ARRAY, struct.pack("<IQ", ARRAY, 1))]), "arrays of numbers or strings"),
    ("value type", gguf_bytes([kv("general.name", 99, b"")]), "value type 99, which is not a GGUF type"),
    ("duplicate key", gguf_bytes([ARCH, ARCH]), "general.architecture appears twice"),
    ("alignment type", gguf_bytes([kv("general.alignment", STRING, s("32"))]), "general.alignment has value type"),
    ("alignment", gguf_bytes([kv("general.alignment", U32, struct.pack("<I", 3))]), "alignment is 3"),
    ("dimensions", gguf_bytes([ARCH], [tensor("t", [1, 1, 1, 1, 1])]), "tensor t has 5 dimensions"),
    ("zero dim", gguf_bytes([ARCH], [tensor("t", [4, 0])]), "tensor t has dimensions [4, 0]"),
    ("dims past 64 bits", gguf_bytes([ARCH], [tensor("t", [2**32, 2**32])]), "tensor t (73786976294838206464 "
     "bytes at data offset 0) runs past the end"),
    ("ggml type", gguf_bytes([ARCH], [tensor("t", [4], kind=99)]), "tensor t has GGML type 99"),
    ("block rows", gguf_bytes([ARCH], [tensor("t", [16, 2], kind=8)]), "rows of 16 values, not a whole number "
     "of Q8_0 blocks of 32"),
    ("past the end", gguf_bytes([ARCH], [tensor("t", [8])], data=b"\0" * 16), "tensor t (32 bytes at data "
     "offset 0) runs past the end"),
    ("offset", gguf_bytes([ARCH], [tensor("t", [4], offset=2**64 - 32)], data=b"\0" * 16), "runs past the end"),
    ("misaligned", gguf_bytes([ARCH], [tensor("t", [4], offset=4)], data=b"\0" * 64), "offset 4, not a "
     "multiple of the alignment 32"),
    ("duplicate tensor", gguf_bytes([ARCH], [tensor("t", [4]), tensor("t", [4], offset=32)], data=b"\0" * 64),
     "tensor t appears twice"),
    ("truncated record", gguf_bytes([ARCH], [tensor("t", [4])])[:-20], "runs past the end"),
]


@pytest.mark.parametrize("name,data,message", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_malformed_gguf_containers_are_one_sentence(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    start = time.process_time()
    with pytest.raises(ModelFormatError, match="^bad.gguf: ") as err:
        GGUFFile(path)
    assert message in str(err.value)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")
    assert time.process_time() - start < 0.5


def test_a_valid_container_reads_as_the_gguf_package_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "seed.gguf"
    path.write_bytes(ff.gguf_seed("llama"))
    reference = gguf.GGUFReader(str(path))
    ours = GGUFFile(path)
    try:
        assert sorted(ours.names()) == sorted(t.name for t in reference.tensors)
        for t in reference.tensors:
            assert ours.shape(t.name) == tuple(int(d) for d in reversed(t.shape.tolist()))
            assert np.array_equal(ours.raw(t.name).reshape(-1), t.data.view(np.uint8).reshape(-1))
        assert ours.metadata["tokenizer.ggml.tokens"] == ff.LLAMA_TOKENS
        assert ours.metadata["llama.embedding_length"] == 32
        assert ours.metadata["llama.rope.freq_base"] == 10000.0
    finally:
        ours.close()


def _metadata_file(tmp_path: Path, change: Dict[str, Any]) -> Path:
    """The valid llama seed with metadata values replaced."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(ff.gguf_seed("llama", change))
    return path


V = gguf.GGUFValueType
METADATA_CASES = [
    ({"llama.attention.head_count": (0, V.UINT32)}, "llama.attention.head_count is int '0'; a whole number from 1"),
    ({"llama.block_count": (2**40, V.UINT64)}, "llama.block_count is int '1099511627776'"),
    ({"llama.embedding_length": ("32", V.STRING)}, "llama.embedding_length is str '32'"),
    ({"llama.rope.freq_base": (float("inf"), V.FLOAT32)}, "llama.rope.freq_base is float 'inf'"),
    ({"tokenizer.ggml.tokens": ([1, 2], V.ARRAY)}, "tokenizer.ggml.tokens is an array of 2 values; an array of "
     "strings"),
    ({"tokenizer.ggml.scores": ([0.5], V.ARRAY)}, "tokenizer.ggml.scores is an array of 1 values; an array of 265"),
    ({"tokenizer.ggml.bos_token_id": ("1", V.STRING)}, "tokenizer.ggml.bos_token_id is str '1'; a token id"),
    ({"general.architecture": (7, V.UINT32)}, "general.architecture is int '7'; a string"),
    ({"llama.rope.scaling.type": ("linear", V.STRING)}, "rope.scaling.factor is missing"),
]


@pytest.mark.parametrize("change,message", METADATA_CASES, ids=[next(iter(c[0])) for c in METADATA_CASES])
def test_metadata_of_the_wrong_type_or_range_is_one_sentence(tmp_path: Path, change: Dict[str, Any],
                                                             message: str) -> None:
    path = _metadata_file(tmp_path, dict(change))
    with pytest.raises(ModelFormatError) as err:
        ModelConfig.from_dir(path)
    assert str(err.value).startswith("bad.gguf: ") and message in str(err.value), str(err.value)


def test_special_token_ids_outside_the_vocabulary_are_dropped_as_llama_cpp_does(tmp_path: Path) -> None:
    path = _metadata_file(tmp_path, {"tokenizer.ggml.bos_token_id": (10**6, V.UINT32)})
    assert ModelConfig.from_dir(path).bos_token_id is None


def test_a_rope_table_is_read_only_when_small(tmp_path: Path) -> None:
    data = gguf_bytes([ARCH], [tensor("rope_freqs.weight", [2, 2**16])], data=b"\0" * (2**19))
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="a table of at most 65536 values"):
        GGUFFile(path).floats("rope_freqs.weight")


CONFIG_CASES = [
    ({"eos_token_id": [None]}, "eos_token_id is None; a whole number"),
    ({"bos_token_id": {"id": 1}}, "bos_token_id is {'id': 1}"),
    ({"rope_theta": [1]}, "rope_theta is [1]; a finite number above 0"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps is 'x'"),
    ({"hidden_size": 64.5}, "hidden_size is 64.5; a whole number"),
    ({"architectures": 5}, "architectures is 5; a list of class names"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": None}}, "rope_scaling.factor is None"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
      "original_max_position_embeddings": 1}, "original_max_position_embeddings 1 is below 2"),
    ({"quantization_config": {"quant_method": "gptq", "bits": "four"}}, "quantization bits is 'four'"),
]


@pytest.mark.parametrize("change,message", CONFIG_CASES, ids=[next(iter(c[0])) for c in CONFIG_CASES])
def test_config_values_of_the_wrong_type_are_one_sentence(tmp_path: Path, change: Dict[str, Any],
                                                          message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(ff.config_seed(), **change)))
    with pytest.raises(ModelFormatError) as err:
        ModelConfig.from_dir(tmp_path)
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("data,message", [(b'{"model_type": "ll\xb9ama"}', "is not UTF-8 text"),
                                          (b"[" * 100_000 + b"]" * 100_000, "nests its JSON too deeply")])
def test_config_files_that_are_not_json_text_are_one_sentence(tmp_path: Path, data: bytes, message: str) -> None:
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ModelFormatError, match=message):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("entry,message", [
    ({"dtype": "F16", "shape": [4, 8], "data_offsets": [0, 2**40]}, "a.weight has no valid dtype, shape and "
     "data_offsets inside the file's"),
    ({"dtype": "F16", "shape": [2**62, 2**62], "data_offsets": [0, 64]}, "a.weight has shape [4611686018427387904, "
     "4611686018427387904] of F16"),
    ({"dtype": "F16", "shape": [4, -8], "data_offsets": [0, 64]}, "a.weight has no valid dtype"),
    ("F16", "a.weight has no valid dtype"),
])
def test_the_folder_checks_read_safetensors_headers_checked(tmp_path: Path, entry: Any, message: str) -> None:
    """United's folder browser and doctor read headers through engine/weights.safetensors_header."""
    from kobold_backend.engine.weights import safetensors_header

    header, body = ff.split_safetensors(ff.safetensors_seed())
    path = tmp_path / "model.safetensors"
    path.write_bytes(ff.join_safetensors(dict(header, **{"a.weight": entry}), body))
    with pytest.raises(ModelFormatError, match="^model.safetensors: ") as err:
        safetensors_header(path)
    assert message in str(err.value)
    for data in (b"\x01\x02", ff.join_safetensors(header, body, declared=2**63), ff.join_safetensors([1], body)):
        path.write_bytes(data)
        with pytest.raises(ModelFormatError, match="^model.safetensors: "):
            safetensors_header(path)


def test_safetensors_header_lengths_and_offsets_are_refused(tmp_path: Path) -> None:
    header, body = ff.split_safetensors(ff.safetensors_seed())
    for data in (ff.join_safetensors(header, body, declared=2**63),
                 ff.join_safetensors(dict(header, **{"a.weight": {"dtype": "F16", "shape": [4, 8],
                                                                  "data_offsets": [0, 2**40]}}), body),
                 ff.join_safetensors(dict(header, **{"a.weight": {"dtype": "F16", "shape": [2**62, 2**62],
                                                                  "data_offsets": [0, 64]}}), body)):
        (tmp_path / "model.safetensors").write_bytes(data)
        with pytest.raises(ModelFormatError, match="model.safetensors is not a readable safetensors file"):
            WeightReader(tmp_path)


def test_spm_merges_cost_what_the_pieces_weigh(monkeypatch: pytest.MonkeyPatch) -> None:
    """700 pieces of 20,000 characters (issue 35: 64 s) convert at once and give the same merges as every cut would;
    a vocabulary whose splits exceed the work bound is one sentence naming tokenizer.ggml.tokens."""
    from kobold_backend.engine.gguf import tokenizer_json as tj

    long = [chr(0x4E00 + n) * 20_000 for n in range(700)]
    short = ["a", "b", "ab", "ba", "aba", "\u2581", "\u2581a"]
    vocab = tj.GGUFVocab(short + long, [tj.NORMAL] * 707, [-float(i) for i in range(707)])
    start = time.process_time()
    assert tj.spm_merges(vocab) == ["a b", "b a", "a ba", "ab a", "\u2581 a"]
    assert time.process_time() - start < 0.5
    runs = ["a" * n for n in range(1, 200)]
    monkeypatch.setattr(tj, "MAX_MERGE_WORK", 1 << 16)
    with pytest.raises(ModelFormatError, match="^x.gguf: tokenizer.ggml.tokens holds pieces whose splits would take "
                       "more than 65536 steps"):
        tj.spm_merges(tj.GGUFVocab(runs, [tj.NORMAL] * 199, [0.0] * 199), "x.gguf")


def test_a_shard_index_reads_shards_inside_the_folder_or_its_hub_snapshot_blobs(tmp_path: Path) -> None:
    """Hugging Face's cache links a snapshot's files to the repository's blobs (`../../blobs/<hash>`): those load;
    a link to another repository's blobs, or anywhere else, is the sentence of any shard outside the folder."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_bytes(ff.safetensors_seed())
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/f00d")
    index = {"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    with WeightReader(snapshot) as reader:
        assert sorted(reader.names()) == ["a.weight", "b.bias", "c"]
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "beef").write_bytes(ff.safetensors_seed())
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(other / "beef")
    with pytest.raises(ModelFormatError, match="^model.safetensors.index.json names shard "
                       "'model-00001-of-00001.safetensors' outside the model folder; shards must be files inside it.$"):
        WeightReader(snapshot)


@pytest.mark.parametrize("name,index,value,message", [
    ("q_invperm", 5, ff.EXL2_K, "q_invperm is not a permutation of its 128 input rows"),
    ("q_invperm", 5, -1, "q_invperm is not a permutation"),
    ("q_groups", 1, 1000, "q_groups' first word rows"),
    ("q_groups", 2, -3, "q_groups holds bit widths [-3]"),
])
def test_exl2_tables_out_of_range_are_one_sentence(tmp_path: Path, name: str, index: int, value: int,
                                                   message: str) -> None:
    tensors = ff.exl2_seed()
    tensors[name].reshape(-1)[index] = value
    save_file({f"lin.{k}": v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with WeightReader(tmp_path) as reader, pytest.raises(ModelFormatError) as err:
        load_exl2_linear(reader, "lin", ff.EXL2_K, ff.EXL2_N, torch.float32, "cpu")
    assert message in str(err.value)


class _Tokens:
    bos_token, eos_token = "<s>", "</s>"


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("source,message", [
    # the step bound or the CPU-time bound, whichever this machine reaches first
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran (longer than 1.0 s|more than 1000000 steps)"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "made a joined sequence"),
    ("{% for i in range(100000) %}" + "x" * 1000 + "{% endfor %}", "output passed"),
    ("{{ (range(100000) | list) * 100000 }}", "made a repeated sequence"),
    ("{{ 'a' | center(1000000000) }}", "passed 1000000000 to a call"),
    ("{{ '{:>999999999}'.format(1) }}", "formats with a width of 999999999"),
    ("{{ '%999999999d' % 1 }}", "formats with a width of 999999999"),
    ("{{ 'aaaa' | replace('', 'x' * 1000000) }}", "made a replaced string"),
    ("{{ 7 ** 1000000 }}", "an integer of about"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
    # issue 35: each of these built its value (1.5 to 8 GB, or 39 s of lipsum) before any check looked at it
    ("{% set ns=namespace(s='a') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "joined string"),
    ("{{ (['x'*99999]*10000) }}", "made a written value"),
    ("{{ lipsum(n=200, min=99998, max=99999)|length }}", "at most 10000 words"),
    ("{{ (['x'*9999]*100) | tojson(indent=20000) }}", "indent of 20000"),
    ("{{ '{0:{1}}'.format('x','999999999') }}", "takes a format width from its arguments"),
    ("{{ ('\n' * 99999) | indent(99999) }}", "the result of the indent filter"),
    ("{{ ('a ' * 99999) | wordwrap(1, wrapstring='x' * 99999) }}", "the result of the wordwrap filter"),
    ("{{ (['x'*99999]*10000) | string }}", "the input of the string filter"),
    ("{{ ('\t' * 99999).expandtabs(99999) }}", "an expanded string"),
    ("{{ ('x' * 99999).join(['a'] * 10000) }}", "a joined string"),
    ("{% set ns = namespace(l=[]) %}{% set ns.l = ['x' * 99999] * 11 %}", "a namespace value"),
])
def test_chat_templates_are_bounded(source: str, message: str) -> None:
    start = time.process_time()
    with pytest.raises(TemplateRenderError, match=message):
        ChatFormatter(source, _Tokens()).render(MESSAGES)  # type: ignore[arg-type]
    assert time.process_time() - start < 2.0


@pytest.mark.parametrize("source", ["{% for a in b %}" * 25 + "{% endfor %}" * 25,
                                    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"])
def test_templates_nested_past_pythons_limits_are_compile_errors(source: str) -> None:
    """Found by atheris: Python's compiler refuses 20+ nested blocks (SyntaxError) and Jinja's recursive parser
    overflows on deep parentheses (RecursionError); both were uncaught."""
    with pytest.raises(TemplateCompileError, match="the template nests too deeply"):
        ChatFormatter(source, _Tokens())  # type: ignore[arg-type]


def test_bounded_templates_still_render_what_templates_write() -> None:
    source = ("{{ bos_token }}{% for m in messages %}{{ '%-6s|%5.2f' % (m.role, 1.5) }}{{ '{:>4}'.format(m.content) }}"
              "{{ m.content | replace('h', 'H') | center(8) }}{{ [m.role, 'x'] | join('/') }}{% endfor %}"
              "{{ 'Tel 1234567' }}{{ 2 ** 10 }}")
    assert ChatFormatter(source, _Tokens()).render(MESSAGES) == (  # type: ignore[arg-type]
        "<s>user  | 1.50  hi   Hi   user/xTel 12345671024")
    long = [{"role": "user", "content": "y" * 3_000_000}]
    assert len(ChatFormatter("{% for m in messages %}{{ m.content + '!' }}{% endfor %}",
                             _Tokens()).render(long)) == 3_000_001  # type: ignore[arg-type]


def _merges_by_definition(vocab: Dict[str, int]) -> List[Tuple[str, str]]:
    """Every split of every piece into two pieces, by merged id then left length (the written-down rule)."""
    return [(left, right) for _, _, left, right in sorted((i, c, p[:c], p[c:]) for p, i in vocab.items()
                                            for c in range(1, len(p)) if p[:c] in vocab and p[c:] in vocab)]


def test_sentencepiece_merges_are_bounded_by_the_file_and_unchanged() -> None:
    rng = np.random.default_rng(0)
    vocab: Dict[str, int] = {}
    for _ in range(3000):
        vocab.setdefault("".join(rng.choice(list("abc▁"), rng.integers(1, 7))), len(vocab))
    assert bpe_merges(vocab) == _merges_by_definition(vocab)
    vocab["a" * 300_000] = len(vocab)  # one piece as long as a whole vocabulary file
    start = time.process_time()
    bpe_merges(vocab)
    assert time.process_time() - start < 1.0


def test_metadata_real_files_write_is_still_accepted(tmp_path: Path) -> None:
    """Gemma 3's per-layer pattern as booleans and infinite scores (only copied into the tokenizer) are valid."""
    scores = [-float("inf")] + [-float(i) for i in range(1, len(ff.LLAMA_TOKENS))]
    path = _metadata_file(tmp_path, {"llama.attention.sliding_window_pattern": ([True, False], V.ARRAY),
                                     "tokenizer.ggml.scores": (scores, V.ARRAY)})
    gguf_file = GGUFFile(path)
    assert gguf_file.metadata["llama.attention.sliding_window_pattern"] == [True, False]
    gguf_file.close()
    assert ModelConfig.from_dir(path).hidden_size == 32


def test_permuted_rows_that_do_not_split_into_heads_are_one_sentence(tmp_path: Path) -> None:
    """Found by hypothesis: a Q weight whose rows are not a whole number per head reached llama.cpp's un-permutation
    and failed in torch's reshape."""
    from kobold_backend.engine.gguf.config import ARCHITECTURES
    from kobold_backend.engine.gguf.weights import GGUFWeights

    data = ff.gguf_seed("llama")
    record = tensor("blk.0.attn_q.weight", [32, 32], kind=8)  # Q8_0 rows of 32 values
    offset = data.index(record[:-12])  # the record's name and dims, then its type and offset
    path = tmp_path / "bad.gguf"
    path.write_bytes(data[:offset] + tensor("blk.0.attn_q.weight", [32, 30], kind=8)[:-12] + data[offset +
                                                                                                 len(record) - 12:])
    weights = GGUFWeights(GGUFFile(path), ARCHITECTURES["llama"], 4, 4)
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.weight in bad.gguf has 30 rows, not an even number "
                                               "per head for its 4 heads"):
        weights.get("model.layers.0.self_attn.q_proj.weight")
