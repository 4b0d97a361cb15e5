"""GGUF vocabularies of every llama.cpp tokenizer kind, written with the `gguf` package the way convert_hf_to_gguf.py
writes them, read back by the engine and compared id for id with llama.cpp's algorithms written down in
tests/fixtures/llamacpp_tokenize.py (sentencepiece itself for SPM), on the test strings of llama.cpp's tokenizer
tests, and with the Hugging Face tokenizer built from the same vocabulary where transformers has one that follows
the same rules (GPT-2, Qwen2, BERT)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

import gguf
import pytest
import sentencepiece as spm
import tokenizers
import transformers
from sentencepiece import sentencepiece_model_pb2

from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.gguf.pretokenizers import PRE_TOKENIZERS, UNSUPPORTED_PRE
from kobold_backend.engine.gguf.tokenizer_files import tokenizer_files
from kobold_backend.engine.tokenizer import Tokenizer, load_tokenizer
from kobold_backend.errors import ModelFormatError
from tests.fixtures.llamacpp_tokenize import LLAMA_CPP_TESTS, bpe_tokenize, partition, spm_tokenize
from tests.fixtures.tokenizers import byte_bpe_json, corpus_lines, sentencepiece_model_bytes

SPACE = "\u2581"
# Text that starts with spaces, as KoboldAI frontends send it (issue #28), and whitespace of every kind.
LEADING_SPACE = [" the", "  the", " ", "  ", "   ", "\n", " \n", "\t", " \t", "\n the", "\t the\n  and",
                 "  \n\t mixed \t\n ", "    the\n    the", "a\n\n  b", "         y", "the  ", "x" + " " * 20 + "y"]
SPECIAL_TEXTS = ["<s> the", "</s>the", "a</s>  b", "a</s>\nb", "</s> XML", " <s>  <s> x </s>", "<s>"]


def _write(tmp: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None], name: str = "") -> Dict[str, Any]:
    path = tmp / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path).metadata


def _engine(tmp: Path, meta: Dict[str, Any]) -> Tokenizer:
    folder = tmp / "tok"
    folder.mkdir(exist_ok=True)
    for name, data in tokenizer_files(meta, "vocab.gguf").items():
        (folder / name).write_bytes(data)
    return load_tokenizer(folder)


# --- SPM (tokenizer.ggml.model = "llama") ------------------------------------------------------------------------

def llama2_like_model(family: str = "llama") -> bytes:
    """The trained sentencepiece model with its whitespace-run pieces ("▁▁", "▁▁▁▁", ...) scored -1e9 so they merge
    last, as Llama 2's do: there " Hello" ("▁▁Hello") gives [29871 ▁, 15043 ▁Hello] although "▁▁" is piece 259."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sentencepiece_model_bytes(family))
    for piece in proto.pieces:
        if len(piece.piece) > 1 and set(piece.piece) == {SPACE}:
            piece.score = -1e9
    return proto.SerializeToString()


def _spm_fill(sp: spm.SentencePieceProcessor, add_space_prefix: bool) -> Callable[[gguf.GGUFWriter], None]:
    def fill(writer: gguf.GGUFWriter) -> None:
        n = sp.get_piece_size()
        writer.add_tokenizer_model("llama")
        writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
        writer.add_token_scores([sp.get_score(i) for i in range(n)])
        writer.add_token_types(_piece_types(sp))  # sentencepiece's piece types are llama.cpp's token types
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        writer.add_add_space_prefix(add_space_prefix)
    return fill


def _without_dummy_prefix(sp: spm.SentencePieceProcessor) -> spm.SentencePieceProcessor:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _spm_oracle(sp: spm.SentencePieceProcessor, text: str, add_space_prefix: bool, rstrip=frozenset()) -> List[int]:
    """llama.cpp's SPM tokenize: control pieces cut out, then sentencepiece's encoder (without a dummy prefix of
    its own) on each fragment as llama.cpp prefixes it."""
    specials = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    raw = _without_dummy_prefix(sp)
    return spm_tokenize(partition(text, specials, rstrip=rstrip), lambda piece: raw.encode(piece.replace(
        SPACE, " ")), add_space_prefix)


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("llama2")
    data = llama2_like_model()
    sp = spm.SentencePieceProcessor(model_proto=data)
    return sp, _engine(tmp, _write(tmp, "llama", _spm_fill(sp, True)))


def test_spm_leading_spaces_are_one_dummy_prefix_like_llama_cpp(llama2) -> None:
    """Issue #28's cases on a Llama-2-like vocabulary: " the" is [▁, ▁the] (Llama 2: " Hello" -> [29871, 15043]),
    "  the" [▁▁, ▁the] ([259, 15043]), " " [▁▁] ([259]) — the text after one added "▁", merged by score."""
    sp, tok = llama2
    piece = sp.piece_to_id
    assert tok.encode(" the") == [piece(SPACE), piece(SPACE + "the")]
    assert tok.encode("  the") == [piece(SPACE * 2), piece(SPACE + "the")]
    assert tok.encode(" ") == [piece(SPACE * 2)]
    assert tok.encode("the") == [piece(SPACE + "the")]


@pytest.mark.parametrize("text", LLAMA_CPP_TESTS + LEADING_SPACE)
def test_spm_matches_sentencepiece(llama2, text: str) -> None:
    """sentencepiece's encode with its dummy prefix is llama.cpp's SPM tokenizer on text without special tokens."""
    sp, tok = llama2
    assert tok.encode(text) == sp.encode(text), text
    assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


@pytest.mark.parametrize("text", SPECIAL_TEXTS)
def test_spm_prefixes_text_after_special_tokens(llama2, text: str) -> None:
    """After <s> or </s> llama.cpp adds the "▁" again (like transformers' legacy=True), never merging it away."""
    sp, tok = llama2
    assert tok.encode(text) == _spm_oracle(sp, text, True), text
    assert tok.encode(text, add_bos=True) == [sp.bos_id()] + _spm_oracle(sp, text, True)


def test_spm_without_space_prefix(tmp_path: Path) -> None:
    """add_space_prefix=false (Gemma 1-3 GGUF files): no "▁" in front, user-defined pieces cut out as they are."""
    sp = spm.SentencePieceProcessor(model_proto=sentencepiece_model_bytes("gemma"))
    tok = _engine(tmp_path, _write(tmp_path, "gemma2", _spm_fill(sp, False)))
    types = _piece_types(sp)
    user = {sp.id_to_piece(i): i for i, kind in enumerate(types) if kind in (2, 3, 4)}  # unknown, control, user
    for text in LLAMA_CPP_TESTS + LEADING_SPACE + ["<start_of_turn>user\n Hi<end_of_turn>\n"]:
        expected = spm_tokenize(partition(text, user), lambda p: sp.encode(p.replace(SPACE, " ")), False)
        assert tok.encode(text) == expected, text


def _piece_types(sp: spm.SentencePieceProcessor) -> List[int]:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    return [int(piece.type) for piece in proto.pieces]


def test_phi3_special_tokens_swallow_following_spaces(tmp_path: Path) -> None:
    """llama.cpp gives Phi-3's control tokens (not <s>, <unk>) the rstrip attribute: "</s>  b" loses its spaces."""
    sp = spm.SentencePieceProcessor(model_proto=llama2_like_model())
    tok = _engine(tmp_path, _write(tmp_path, "phi3", _spm_fill(sp, True), name="Phi3 Mini"))
    for text in SPECIAL_TEXTS:
        expected = _spm_oracle(sp, text, True, rstrip={sp.eos_id()})
        assert tok.encode(text) == expected, text


# --- BPE (tokenizer.ggml.model = "gpt2" / "gemma4") ----------------------------------------------------------------

def _bpe_source() -> Dict[str, Any]:
    spec = json.loads(byte_bpe_json())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    vocab = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges, "vocab": vocab}


def _bpe_fill(src: Dict[str, Any], model: str, pre: str) -> Callable[[gguf.GGUFWriter], None]:
    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(model)
        if pre:
            writer.add_tokenizer_pre(pre)
        writer.add_token_list(src["tokens"])
        writer.add_token_types(src["types"])
        writer.add_token_merges(src["merges"])
        bos, eos = ("<|begin_of_text|>", "<|end_of_text|>") if "<|end_of_text|>" in src["vocab"] else ("<s>", "</s>")
        writer.add_bos_token_id(src["vocab"][bos])
        writer.add_eos_token_id(src["vocab"][eos])
    return fill


# One name per distinct llama.cpp pre-tokenizer (every other name maps to one of these).
_DISTINCT = sorted({kind: name for name, kind in sorted(PRE_TOKENIZERS.items(), reverse=True)
                    if kind.byte_encode}.values())
BPE_TEXTS = LLAMA_CPP_TESTS + LEADING_SPACE + ["Hello<|eot_id|> world", "<|begin_of_text|>Hi", "ÉCOLE Ünïcödé",
                                               "ab\r\ncd", "x = 1234567;\n\tif(y)", "IMGIMGABZ <sentinel:12>"]


@pytest.fixture(scope="module")
def bpe_source() -> Dict[str, Any]:
    return _bpe_source()


@pytest.mark.parametrize("pre", _DISTINCT)
def test_bpe_pre_tokenizer_matches_llama_cpp(pre: str, bpe_source, tmp_path: Path) -> None:
    tok = _engine(tmp_path, _write(tmp_path, "llama", _bpe_fill(bpe_source, "gpt2", pre)))
    kind = PRE_TOKENIZERS[pre]
    specials = {t: i for i, t in enumerate(bpe_source["tokens"]) if t.startswith("<|")}
    for text in BPE_TEXTS:
        expected = bpe_tokenize(partition(text, specials), bpe_source["vocab"], bpe_source["merges"], kind.regexes,
                                True, kind.ignore_merges, False)
        assert tok.encode(text) == expected, (pre, text)
        assert tok.decode(expected) == text.replace("<|eot_id|>", "").replace("<|begin_of_text|>", ""), (pre, text)
    bos = [bpe_source["vocab"]["<|begin_of_text|>"]] if kind.add_bos else []  # llama.cpp's default per pre
    assert tok.encode("a", add_bos=True) == bos + tok.encode("a")


@pytest.mark.skipif(tuple(int(x) for x in tokenizers.__version__.split(".")[:2]) < (0, 19),
                    reason="tokenizers < 0.19 cannot take a whole-vocabulary word without merges (ignore_merges)")
def test_ignore_merges_takes_whole_vocabulary_words(bpe_source, tmp_path: Path) -> None:
    """llama-bpe (Llama 3) and tekken take a pre-tokenized word that is a token whole, even when no merge builds
    it; qwen2 does not."""
    src = dict(bpe_source, tokens=bpe_source["tokens"] + ["\u0120zqxv"],
               types=bpe_source["types"] + [gguf.TokenType.NORMAL])
    src["vocab"] = {t: i for i, t in enumerate(src["tokens"])}
    for pre, whole in (("llama-bpe", True), ("tekken", True), ("qwen2", False)):
        tok = _engine(tmp_path, _write(tmp_path, "llama", _bpe_fill(src, "gpt2", pre)))
        assert (tok.encode("a zqxv") == [src["vocab"]["a"], src["vocab"]["\u0120zqxv"]]) is whole, pre


def test_token_types_llama_cpp_overrides_by_text(bpe_source, tmp_path: Path) -> None:
    """End-of-generation and fill-in-the-middle texts written as normal tokens are still cut out of the text as
    control tokens, gpt-oss's <|channel|> is matched as a user-defined token (rendered), as llama.cpp does."""
    extra = {"<|im_end|>": gguf.TokenType.NORMAL, "<|fim_prefix|>": gguf.TokenType.NORMAL,
             "<|channel|>": gguf.TokenType.CONTROL}
    src = dict(bpe_source, tokens=bpe_source["tokens"] + list(extra),
               types=bpe_source["types"] + list(extra.values()))
    src["vocab"] = {t: i for i, t in enumerate(src["tokens"])}
    tok = _engine(tmp_path, _write(tmp_path, "llama", _bpe_fill(src, "gpt2", "qwen2")))
    ids = src["vocab"]
    assert tok.encode("a<|im_end|>b<|fim_prefix|>c<|channel|>d")[1::2] == [
        ids["<|im_end|>"], ids["<|fim_prefix|>"], ids["<|channel|>"]]
    assert tok.decode([ids["<|im_end|>"], ids["<|channel|>"]]) == "<|channel|>"


# Every `tokenizer.ggml.pre` name llama.cpp's loader (llama_vocab::impl::load, 2026) maps to a pre-tokenizer type.
LLAMA_CPP_PRE_NAMES = """default minicpm5 llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano
deepseek-llm deepseek-coder deepseek-v3 spark2_5 youtu falcon mpt starcoder gpt-2 phi-2 jina-es jina-de gigachat
jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jais-2 gemma4 granite-embed-multi-311m sarvam-moe jina-v1-en
jina-v2-code roberta-bpe whitespace refact command-r qwen2 deepseek-r1-qwen kormo f2llmv2 qwen35 stablelm2 olmo dbrx
smaug-bpe poro-chat glm4 chatglm-bpe viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4 exaone-moe
chameleon minerva-7b megrez gpt-4o llama4 kanana2 talkie granite-embed-multi-97m tiny_aya cohere2moe superbpe trillion
granite-docling bailingmoe bailingmoe2 llada-moe seed-coder hunyuan hunyuan-dense hy_v4 joyai-llm kimi-k2 ufakzeka
grok-2 afmoe laguna minimax-m2 solar-open mellum2""".split()


def test_pre_table_covers_llama_cpp() -> None:
    assert set(PRE_TOKENIZERS) | set(UNSUPPORTED_PRE) == set(LLAMA_CPP_PRE_NAMES)
    assert not set(PRE_TOKENIZERS) & set(UNSUPPORTED_PRE)


def test_every_llama_cpp_pre_name_is_accepted(bpe_source, tmp_path: Path) -> None:
    """The names of issue #28 and every other name llama.cpp's loader maps to a pre-tokenizer type."""
    names = ["qwen35", "command-r", "deepseek-llm", "deepseek-coder", "falcon", "mpt", "starcoder", "refact",
             "llama-bpe", "qwen2", "gpt-2", "tekken", "gpt-4o", "deepseek-v3", "chameleon", "default"]
    assert set(names) <= set(PRE_TOKENIZERS)
    for pre in names:
        meta = _write(tmp_path, "llama", _bpe_fill(bpe_source, "gpt2", pre))
        assert _engine(tmp_path, meta).encode("Hello world")


@pytest.mark.parametrize("pre, cls", [("gpt-2", "GPT2Tokenizer"), ("qwen2", "Qwen2Tokenizer")])
def test_bpe_matches_transformers_class(pre: str, cls: str, bpe_source, tmp_path: Path) -> None:
    """transformers' GPT2Tokenizer and Qwen2Tokenizer carry their split regex themselves: built from the same
    vocabulary and merges they are an oracle independent of pretokenizers.py."""
    folder = tmp_path / "hf"
    folder.mkdir()
    plain = {t: i for t, i in bpe_source["vocab"].items() if not t.startswith("<|")}
    (folder / "vocab.json").write_text(json.dumps(plain), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(bpe_source["merges"]) + "\n", encoding="utf-8")
    hf = getattr(transformers, cls)(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=None,
                                    bos_token=None, eos_token=None, pad_token=None)
    tok = _engine(tmp_path, _write(tmp_path, "llama", _bpe_fill(bpe_source, "gpt2", pre)))
    for text in LLAMA_CPP_TESTS + LEADING_SPACE:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), (pre, text)


def _gemma4_source() -> Dict[str, Any]:
    """An SPM-style BPE vocabulary (Gemma 4's shape): the sentencepiece pieces with their merges by score, and
    runs of one to four newlines as whole tokens that no merge builds (Gemma's vocabularies hold every run up to
    their longest)."""
    sp = spm.SentencePieceProcessor(model_proto=llama2_like_model())
    runs = ["\n" * k for k in range(1, 5)]
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())] + runs
    types = _piece_types(sp) + [gguf.TokenType.NORMAL] * len(runs)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-sp.get_score(vocab[p]), vocab[p], cut, f"{p[:cut]} {p[cut:]}") for p in vocab
                    for cut in range(1, len(p)) if p[:cut] in vocab and p[cut:] in vocab and "\n" not in p)
    return {"tokens": tokens, "types": types, "merges": [m for *_, m in ranked], "vocab": vocab}


def test_gemma4_bpe_matches_llama_cpp(tmp_path: Path) -> None:
    src = _gemma4_source()
    tok = _engine(tmp_path, _write(tmp_path, "gemma4", _bpe_fill(src, "gemma4", "")))
    specials = {t: i for i, (t, k) in enumerate(zip(src["tokens"], src["types"])) if k == gguf.TokenType.CONTROL}
    for text in LLAMA_CPP_TESTS + LEADING_SPACE + ["a\n\n\n\nb", "<s>x\n\n"]:
        expected = bpe_tokenize(partition(text, specials), src["vocab"], src["merges"], ["[^\\n]+|[\\n]+"],
                                False, False, True)
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == text.replace("<s>", ""), text
    assert tok.encode("x", add_bos=True)[0] == src["vocab"]["<s>"]  # llama.cpp always adds Gemma 4's BOS


# --- WPM (tokenizer.ggml.model = "bert") ----------------------------------------------------------------------------

def test_bert_wordpiece_matches_transformers(tmp_path: Path) -> None:
    """A WordPiece vocabulary trained here, written with convert_hf_to_gguf.py's phantom-space spelling, against
    transformers' BertTokenizer on the vocab.txt it came from ([CLS] ... [SEP] around the text)."""
    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(corpus_lines(), vocab_size=800, show_progress=False)
    words = [w for w, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    hf = transformers.BertTokenizer(str(tmp_path / "vocab.txt"))

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("bert")
        writer.add_token_list([w if w.startswith("[") and w.endswith("]") else w[2:] if w.startswith("##")
                               else SPACE + w for w in words])
        writer.add_token_types([gguf.TokenType.CONTROL if w.startswith("[") else gguf.TokenType.NORMAL
                                for w in words])
        for name, token in (("bos", "[CLS]"), ("sep", "[SEP]"), ("unk", "[UNK]"), ("pad", "[PAD]")):
            getattr(writer, f"add_{name}_token_id")(words.index(token))

    tok = _engine(tmp_path, _write(tmp_path, "bert", fill))
    for text in LLAMA_CPP_TESTS + LEADING_SPACE + ["Ünïcödé ÉCOLE, naïve résumé!", "[CLS] x [SEP]"]:
        assert tok.encode(text, add_bos=True, add_eos=True) == hf.encode(text), text


# --- UGM (tokenizer.ggml.model = "t5") -------------------------------------------------------------------------------

def test_t5_unigram_matches_sentencepiece(tmp_path: Path) -> None:
    """A unigram model trained here with a precompiled normalization map (a few NFKC rules: T5's full nmt_nfkc map
    takes the `gguf` package's reader seconds to parse) and extra whitespace removed: llama.cpp's UGM tokenizer
    copies sentencepiece's Viterbi search and normalizer, and adds EOS after the text."""
    import io

    rules = tmp_path / "rules.tsv"
    rules.write_text("FB01\t66 69\nFF26\t46\nFF35\t55\nFF2C\t4C\n2460\t31\n", encoding="utf-8")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()[:1500]), model_writer=buf,
                                   model_type="unigram", vocab_size=500, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   normalization_rule_tsv=str(rules), num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    assert proto.normalizer_spec.precompiled_charsmap and proto.normalizer_spec.remove_extra_whitespaces

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("t5")
        writer.add_token_list([p.piece for p in proto.pieces])
        writer.add_token_scores([p.score for p in proto.pieces])
        writer.add_token_types([int(p.type) for p in proto.pieces])
        writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
        writer.add_remove_extra_whitespaces(proto.normalizer_spec.remove_extra_whitespaces)
        writer.add_precompiled_charsmap(proto.normalizer_spec.precompiled_charsmap)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(2)
        writer.add_pad_token_id(0)

    tok = _engine(tmp_path, _write(tmp_path, "t5", fill))
    for text in LLAMA_CPP_TESTS + LEADING_SPACE + ["ﬁve ＦＵＬＬ ① "]:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.encode(text, add_bos=True, add_eos=True) == sp.encode(text) + [1], text


# --- kinds llama.cpp tokenizes with code no tokenizer.json reproduces -----------------------------------------------

@pytest.mark.parametrize("model, pre", [("rwkv", ""), ("plamo2", ""), ("gpt2", "kimi-k2"), ("gpt2", "nonsense")])
def test_unsupported_kinds_are_refused_by_name(model: str, pre: str, bpe_source, tmp_path: Path) -> None:
    meta = _write(tmp_path, "llama", _bpe_fill(bpe_source, model, pre))
    with pytest.raises(ModelFormatError, match=pre or model):
        tokenizer_files(meta, "vocab.gguf")
