"""GGUF models (llama.cpp's files) end to end: metadata, vocabulary and block-format weights.

Each fixture is a tiny Llama checkpoint written as llama.cpp's converter would (tests/fixtures/gguf_files.py); the
oracle is transformers in float32 on the `gguf` package's dequantization of the same blocks, and the Hugging Face
tokenizer of the checkpoint the file was made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import pytest
import sentencepiece as spm
import torch
import transformers
from sentencepiece import sentencepiece_model_pb2

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.tokenizer import load_tokenizer
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGMLWeight
from tests.fixtures.arch_checkpoints import ARCH_BY_NAME, build_arch_checkpoint
from tests.fixtures.checkpoints import CheckpointSpec, build_checkpoint
from tests.fixtures.gguf_files import Q4_K_M, write_gguf
from tests.fixtures.hf_oracle import hf_load, hf_step, row_rel_err
from tests.fixtures.llamacpp_tokenize import partition, spm_tokenize

# Sizes that fill whole 256-element super-blocks, so every K-quant can be used.
SPM_SPEC = CheckpointSpec("gguf_llama_spm", seed=31, hidden_size=256, intermediate_size=512, num_heads=4,
                          num_kv_heads=2, head_dim=64, dtype="float32")
BPE_SPEC = CheckpointSpec("gguf_llama_bpe", seed=32, hidden_size=256, intermediate_size=512, num_heads=4,
                          num_kv_heads=4, head_dim=64, dtype="float32", tokenizer="bpe", rope_theta=500000.0)
PLANS: Dict[str, Dict[str, str]] = {
    "Q4_K_M": Q4_K_M,
    "legacy": {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1", "ffn_gate": "Q4_0",
               "ffn_up": "Q8_0", "ffn_down": "Q5_0", "token_embd": "F16", "output": "Q8_0", "*": "Q4_0"},
    "float": {"token_embd": "BF16", "output": "F32", "*": "F16"},
}
TEXTS = ["Hello world", " leading space and <s> inside", "digits 1234567 and emoji 🙂", "Ünïcödé — 日本語のテキスト",
         "line\nbreaks\n\n  and   spaces"]


@pytest.fixture(scope="module")
def spm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(SPM_SPEC, tmp_path_factory.mktemp("hf")).path


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(BPE_SPEC, tmp_path_factory.mktemp("hf")).path


def _check_against_transformers(gguf_path: Path, oracle: Path) -> None:
    lm = load_model(gguf_path, device="cpu")
    hf = hf_load(oracle)
    ids = torch.tensor([[1, 15, 300, 7, 42, 99, 5, 250, 17, 3]])
    ours = lm.model.forward(ids, lm.model.new_cache(64), last_only=False)
    ref, past = hf_step(hf, ids, None)
    assert row_rel_err(ours, ref) < 1e-4
    # 32 greedy tokens, each step fed back through both caches.
    cache = lm.model.new_cache(64)
    logits = lm.model.forward(ids, cache)
    ref_logits, past = hf_step(hf, ids, None)
    ours_tokens, ref_tokens = [], []
    for _ in range(32):
        a, b = int(logits[0, -1].argmax()), int(ref_logits[0, -1].argmax())
        ours_tokens.append(a)
        ref_tokens.append(b)
        logits = lm.model.forward(torch.tensor([[a]]), cache)
        ref_logits, past = hf_step(hf, torch.tensor([[b]]), past)
    assert ours_tokens == ref_tokens


# Q5_K's whole-model run adds little to its bit-exact block test and costs a minute on the CI machine (the torch
# path dequantizes every linear on every call); Q8_0 runs whole in the vocabulary test below.
@pytest.mark.parametrize("plan", ["Q4_K_M", "legacy", "float"])
def test_gguf_logits_match_transformers(plan: str, spm_checkpoint: Path, tmp_path: Path) -> None:
    oracle = write_gguf(spm_checkpoint, tmp_path, PLANS[plan])
    _check_against_transformers(tmp_path / "model.gguf", oracle)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_architectures_match_transformers(arch: str, tmp_path: Path) -> None:
    """llama.cpp's qwen2 (q/k/v biases, tied embeddings) and qwen3 (q/k norms, head_dim 32) files: no Q/K
    permutation, biases and norms stored as F32."""
    hf = build_arch_checkpoint(ARCH_BY_NAME[arch], tmp_path / "hf").path
    oracle = write_gguf(hf, tmp_path / "gguf", {"attn_v": "Q5_1", "ffn_down": "Q8_0", "*": "Q4_0"})
    lm = load_model(tmp_path / "gguf" / "model.gguf", device="cpu")
    assert lm.config.model_type == arch
    _check_against_transformers(tmp_path / "gguf" / "model.gguf", oracle)


def test_gguf_keeps_block_formats_and_config(spm_checkpoint: Path, tmp_path: Path) -> None:
    write_gguf(spm_checkpoint, tmp_path, Q4_K_M)
    lm = load_model(tmp_path / "model.gguf", device="cpu")
    hf_cfg = ModelConfig.from_dir(spm_checkpoint)
    for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "rope_theta", "bos_token_id", "eos_token_ids", "max_position_embeddings"):
        assert getattr(lm.config, field) == getattr(hf_cfg, field), field
    assert lm.config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)
    layer = lm.model.layers[0]
    # Q4_K q/k and Q6_K v do not share a format, so they stay apart; gate and up fuse into one Q4_K weight.
    assert layer.qkv_proj is None
    assert isinstance(layer.q_proj, GGMLWeight) and layer.q_proj.type_name == "Q4_K"
    assert isinstance(layer.v_proj, GGMLWeight) and layer.v_proj.type_name == "Q6_K"
    assert isinstance(layer.gate_up_proj, GGMLWeight) and layer.gate_up_proj.type_name == "Q4_K"
    assert layer.gate_up_proj.out_features == 2 * SPM_SPEC.intermediate_size
    assert isinstance(layer.down_proj, GGMLWeight) and layer.down_proj.type_name == "Q6_K"
    assert isinstance(lm.model.lm_head, GGMLWeight) and lm.model.lm_head.type_name == "Q6_K"


def test_gguf_bpe_vocabulary(bpe_checkpoint: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    oracle = write_gguf(bpe_checkpoint, tmp_path, {"*": "Q8_0"}, chat_template=template)
    lm = load_model(tmp_path / "model.gguf", device="cpu")
    assert lm.tokenizer.chat_template == template
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(bpe_checkpoint))
    for text in TEXTS + ["<|begin_of_text|>after a special token", "x<|eot_id|>y"]:
        ids = lm.tokenizer.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert lm.tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert lm.config.eos_token_ids == tuple(ModelConfig.from_dir(bpe_checkpoint).eos_token_ids)
    _check_against_transformers(tmp_path / "model.gguf", oracle)


def test_gguf_sentencepiece_vocabulary(spm_checkpoint: Path, tmp_path: Path) -> None:
    write_gguf(spm_checkpoint, tmp_path, {"*": "Q8_0"})
    lm = load_model(tmp_path / "model.gguf", device="cpu")
    folder_tok = load_tokenizer(spm_checkpoint, 1, (2,))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(spm_checkpoint), use_fast=False)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((spm_checkpoint / "tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    raw = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    for text in TEXTS:
        ids = lm.tokenizer.encode(text, add_bos=True)
        # llama.cpp: one "▁" before each fragment at the start or after <s>, sentencepiece's merges on each.
        fragments = partition(text, {"<s>": 1, "</s>": 2, "<unk>": 0})
        assert ids == [1] + spm_tokenize(fragments, lambda p: raw.encode(p.replace("\u2581", " ")), True), text
        assert lm.tokenizer.decode(ids) == folder_tok.decode(ids)
        if "<s>" not in text and not text.startswith(" "):
            assert ids == folder_tok.encode(text, add_bos=True) == hf_tok.encode(text), text


def test_unsupported_tensor_type_is_one_sentence(spm_checkpoint: Path, tmp_path: Path) -> None:
    import gguf

    write_gguf(spm_checkpoint, tmp_path, {"*": "Q8_0"})
    path = tmp_path / "model.gguf"
    reader = gguf.GGUFReader(str(path))
    target = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    del reader
    raw = bytearray(path.read_bytes())
    # The tensor-info record stores the type id right after the dims; rewrite Q8_0 (8) as Q2_K (10).
    name = b"blk.0.ffn_up.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == int(target.tensor_type)
    raw[type_at : type_at + 4] = (10).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ffn_up\.weight.*Q2_K.*supported: .*Q4_K"):
        load_model(path, device="cpu")


def test_weight_format_names_types_and_bits(spm_checkpoint: Path, tmp_path: Path) -> None:
    write_gguf(spm_checkpoint, tmp_path, Q4_K_M)
    lm = load_model(tmp_path / "model.gguf", device="cpu")
    fmt = lm.weight_format
    assert fmt is not None and fmt.name == "GGUF"
    assert set(fmt.detail.split("+")) == {"Q4_K", "Q6_K"}
    # Q4_K is 4.5 bits a weight, Q6_K 6.5625; v (128 of 1024 qkv rows) and down (1/3 of the MLP) are Q6_K.
    h, kv, inter = SPM_SPEC.hidden_size, SPM_SPEC.num_kv_heads * SPM_SPEC.head_dim, SPM_SPEC.intermediate_size
    q6 = kv * h + inter * h
    q4 = (h * h + kv * h + h * h) + 2 * inter * h
    assert fmt.bits_per_weight == pytest.approx((4.5 * q4 + 6.5625 * q6) / (q4 + q6))
    assert str(fmt).startswith("GGUF Q4_K+Q6_K, ") and str(fmt).endswith(" bpw")
    dense = load_model(spm_checkpoint, device="cpu")
    assert dense.weight_format is not None and str(dense.weight_format) == "float32, 32.00 bpw"


def test_load_log_and_doctor_give_one_figure_for_float16_layers(spm_checkpoint: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """float16 layer tensors of a GGUF file are float32 on the CPU: the load log once counted them at 32 bits (11.55
    bpw) where doctor read 7.47 from the file. One computation now: the file's bits."""
    from kobold_backend.doctor import model_line

    write_gguf(spm_checkpoint, tmp_path, {"attn_q": "F16", "attn_k": "F16", "*": "Q8_0"})
    path = tmp_path / "model.gguf"
    with caplog.at_level("INFO", logger="kobold_backend.engine.loader"):
        fmt = load_model(path, device="cpu").weight_format
    h, kv, inter = SPM_SPEC.hidden_size, SPM_SPEC.num_kv_heads * SPM_SPEC.head_dim, SPM_SPEC.intermediate_size
    f16, q8 = h * h + kv * h, kv * h + h * h + 3 * inter * h
    assert fmt is not None and fmt.bits_per_weight == pytest.approx((16 * f16 + 8.5 * q8) / (f16 + q8))
    assert model_line(str(path)) == f"model: model.gguf: LlamaForCausalLM, {fmt} as stored"
    assert f"GGUF Q8_0, {fmt.bits_per_weight:.2f} bpw" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["Q4_K_M", "legacy"])
def test_gpu_gguf_logits_match_cpu(plan: str, spm_checkpoint: Path, tmp_path: Path) -> None:
    """On CUDA in fp16 the block formats dequantize to the same weights; activations in fp16 keep the logits
    within 1e-2 relative of the float32 CPU run (measured ~1e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    write_gguf(spm_checkpoint, tmp_path, PLANS[plan])
    ids = torch.tensor([[1, 15, 300, 7, 42, 99, 5, 250, 17, 3]])
    cpu = load_model(tmp_path / "model.gguf", device="cpu")
    ref = cpu.model.forward(ids, cpu.model.new_cache(64), last_only=False)
    gpu = load_model(tmp_path / "model.gguf", device="cuda", dtype="float16")
    assert isinstance(gpu.model.layers[0].down_proj, GGMLWeight)
    assert gpu.model.layers[0].down_proj.data.is_cuda
    ours = gpu.model.forward(ids.cuda(), gpu.model.new_cache(64), last_only=False).cpu()
    assert row_rel_err(ours, ref) < 1e-2
