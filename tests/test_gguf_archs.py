"""GGUF files of the non-Llama families (and Llama 3.1's RoPE table) end to end against transformers.

Each tiny checkpoint of tests/fixtures/arch_checkpoints.py, moe_gemma_checkpoints.py or checkpoints.py is written
as llama.cpp's converter would (tests/fixtures/gguf_files.py: the `gguf` package's writer and name map, Gemma's
norms stored +1, experts stacked into `ffn_*_exps`, RoPE factor tables as tensors) with a mix of block formats;
the oracle is transformers in float32 on the `gguf` package's dequantization of the same blocks, the tokenizer
oracle the checkpoint's own sentencepiece model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import sentencepiece as spm
import torch

from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.moe import RoutedExperts
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.ggml import GGMLWeight
from tests.fixtures import moe_gemma_checkpoints as moe_gemma
from tests.fixtures.arch_checkpoints import ARCH_BY_NAME, build_arch_checkpoint
from tests.fixtures.checkpoints import SPECS, build_checkpoint
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.hf_oracle import greedy_both, hf_load, prompt_ids, row_rel_err
from tests.fixtures.int8_activations import int8_ggml_activations, int8_on_cuda

LOGITS_RTOL = 1e-4
GREEDY_TOKENS = 24
# Block-32 formats only (the fixtures are 64 wide); gate and up experts share a type so they fuse.
PLAN: Dict[str, str] = {
    "attn_q": "Q4_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "attn_qkv": "Q5_0",
    "ffn_gate": "Q4_0", "ffn_up": "Q5_0", "ffn_down": "Q8_0",
    "ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q5_0", "ffn_gate_inp": "F32",
    "token_embd": "F16", "output": "Q8_0", "*": "Q4_0",
}


def _gemma2(root: Path) -> Any:
    # llama.cpp scales q·k by head_dim ** -0.5 for every Gemma 2 but the 27B model; the file has no key for the
    # fixture's query_pre_attn_scalar 24, so the GGUF variant uses head_dim (32)
    spec = dataclasses.replace(moe_gemma.SPEC_BY_NAME["gemma2"], settings=dict(
        moe_gemma.SPEC_BY_NAME["gemma2"].settings, query_pre_attn_scalar=32))
    return moe_gemma.build_arch(spec, root)


def _qwen3_moe(root: Path) -> Any:
    # llama.cpp's qwen3moe has no dense-MLP layers (its tensor list has no ffn_gate/up/down): every layer routed
    spec = dataclasses.replace(moe_gemma.SPEC_BY_NAME["qwen3_moe"], settings=dict(
        moe_gemma.SPEC_BY_NAME["qwen3_moe"].settings, mlp_only_layers=[]))
    return moe_gemma.build_arch(spec, root)


# fixture name -> (builder of the Hugging Face checkpoint, expected model_type)
FIXTURES: Dict[str, Tuple[Callable[[Path], Any], str]] = {
    "gemma2": (_gemma2, "gemma2"),
    "gemma3": (lambda root: moe_gemma.build_arch(moe_gemma.SPEC_BY_NAME["gemma3"], root), "gemma3_text"),
    "mixtral": (lambda root: moe_gemma.build_arch(moe_gemma.SPEC_BY_NAME["mixtral"], root), "mixtral"),
    "qwen3_moe": (_qwen3_moe, "qwen3_moe"),
    "phi3": (lambda root: build_arch_checkpoint(ARCH_BY_NAME["phi3"], root), "phi3"),
    "phi3_longrope": (lambda root: build_arch_checkpoint(ARCH_BY_NAME["phi3_longrope"], root), "phi3"),
    "llama3_rope": (lambda root: build_checkpoint(next(c for c in SPECS if c.name == "llama3_rope"), root),
                    "llama"),
}


@dataclasses.dataclass
class Written:
    built: Any
    gguf: Path
    oracle: Path


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Written]:
    root = tmp_path_factory.mktemp("gguf_archs")
    done: Dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in done:
            built = FIXTURES[name][0](root / "hf" / name)
            oracle = write_gguf(built.path, root / name, PLAN)
            done[name] = Written(built, root / name / "model.gguf", oracle)
        return done[name]

    return get


@pytest.fixture(scope="module")
def loaded(written: Callable[[str], Written]) -> Callable[[str], LoadedModel]:
    cache: Dict[str, LoadedModel] = {}

    def get(name: str) -> LoadedModel:
        if name not in cache:
            cache[name] = load_model(written(name).gguf, device="cpu", max_seq_len=96)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FIXTURES))
def test_gguf_family_matches_transformers(name: str, written, loaded) -> None:
    w = written(name)
    lm = loaded(name)
    assert lm.config.model_type == FIXTURES[name][1]
    hf = hf_load(w.oracle)
    ids = prompt_ids(w.built, 40, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits
    err = row_rel_err(lm.model.forward(ids, lm.model.new_cache(), last_only=False), ref)
    assert err < LOGITS_RTOL, f"{name}: max relative logit error {err:.3e}"
    run = greedy_both(lm, hf, prompt_ids(w.built, 16, seed=2), GREEDY_TOKENS)
    assert len(set(run.ref_tokens)) > 3, f"{name} decodes a loop; it would prove little"
    assert run.tokens == run.ref_tokens
    assert max(row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)) < LOGITS_RTOL


def test_gguf_gemma_config_and_norms(written, loaded) -> None:
    """The norms come back as the checkpoint held them (the converter's +1 taken off); Gemma 3's local layers
    rotate with base 10000 unscaled and its global ones with the file's base and linear factor."""
    lm = loaded("gemma3")
    src = json.loads((written("gemma3").built.path / "config.json").read_text())
    assert lm.config.features.norm_offset == 1.0
    windows = lm.config.features.windows
    assert windows == (8, 8, 8, 8, 8, None, 8)
    ropes = lm.config.features.ropes
    assert ropes[0].theta == 10000.0 and ropes[0].scaling is None
    full = src["rope_parameters"]["full_attention"]
    assert ropes[5].theta == full["rope_theta"] and ropes[5].scaling.factor == full["factor"]
    g2 = loaded("gemma2").config.features
    assert (g2.attn_softcap, g2.final_softcap) == (10.0, 15.0)
    assert g2.windows == (8, None, 8, None)


def test_gguf_experts_stay_in_block_format(loaded) -> None:
    """Stacked `ffn_*_exps` tensors become per-projection GGML expert stacks (gate and up fused); the expert counts
    come from the metadata."""
    for name, layers in (("mixtral", range(2)), ("qwen3_moe", range(3))):
        lm = loaded(name)
        for i in layers:
            mlp = lm.model.layers[i].mlp
            assert isinstance(mlp, RoutedExperts)
            assert mlp.gate_up.blocks is not None and mlp.gate_up.ggml_type == "Q4_1" and mlp.up is None
            assert mlp.down.ggml_type == "Q5_0"
    assert loaded("mixtral").model.layers[0].mlp.num_experts == 4
    assert loaded("qwen3_moe").model.layers[0].mlp.top_k == 3


def test_gguf_phi3_fused_and_longrope(loaded) -> None:
    lm = loaded("phi3")
    assert isinstance(lm.model.layers[0].qkv_proj, GGMLWeight) and lm.model.layers[0].qkv_proj.type_name == "Q5_0"
    scaling = loaded("phi3_longrope").config.rope_scaling
    assert scaling is not None and scaling.rope_type == "longrope"
    assert scaling.long_factor == tuple(float(x) for x in ARCH_BY_NAME["phi3_longrope"].config["rope_scaling"]
                                        ["long_factor"])
    assert scaling.original_max_position_embeddings == 128


def test_gguf_rope_freqs_equal_llama3_scaling(written, loaded) -> None:
    """Llama 3.1's `rope_freqs` table divides the same frequencies rope.py derives from the llama3 config."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.rope import inverse_frequencies

    lm = loaded("llama3_rope")
    folder_config = ModelConfig.from_dir(written("llama3_rope").built.path)
    ours, ref = inverse_frequencies(lm.config), inverse_frequencies(folder_config)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, inverse_frequencies(ModelConfig.from_dict(
        dict(json.loads((written("llama3_rope").built.path / "config.json").read_text()), rope_scaling=None))))


@pytest.mark.parametrize("name", ["gemma2", "phi3", "qwen3_moe"])
def test_gguf_sentencepiece_ids_match_source(name: str, written, loaded) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(written(name).built.path / "tokenizer.model"))
    tok = loaded(name).tokenizer
    for text in ["Hello world", "digits 1234567 and emoji 🙂", "Ünïcödé — 日本語", "line\nbreaks\n\n  spaces"]:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_gguf_per_expert_tensors(written, tmp_path: Path) -> None:
    """Files from before stacked experts (`blk.N.ffn_gate.E.weight`) load to the same model."""
    w = written("mixtral")
    write_gguf(w.built.path, tmp_path, PLAN, split_experts=True)
    names = GGUFFile(tmp_path / "model.gguf").names()
    assert "blk.0.ffn_gate.3.weight" in names and not any("_exps" in n for n in names)
    lm = load_model(tmp_path / "model.gguf", device="cpu", max_seq_len=96)
    assert lm.model.layers[0].mlp.gate_up.ggml_type == "Q4_1"
    ids = prompt_ids(w.built, 20, seed=3)
    with torch.no_grad():
        ref = hf_load(w.oracle)(ids).logits
    assert row_rel_err(lm.model.forward(ids, lm.model.new_cache(), last_only=False), ref) < LOGITS_RTOL


def test_gguf_experts_gathered_path_equals_grouped(loaded) -> None:
    """The decode path (experts gathered by device index, run per (token, slot)) on GGML stacks gives what the
    grouped path gives; it runs on CUDA in serving, here on CPU tensors directly."""
    mlp = loaded("qwen3_moe").model.layers[0].mlp
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    weights, experts = mlp.route(rows)
    grouped = mlp._grouped(rows, weights, experts)
    gathered = mlp._gathered(rows, weights, experts)
    assert torch.allclose(gathered, grouped, rtol=1e-5, atol=1e-5)


def test_gguf_unknown_architecture_is_one_sentence(written, tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    raw = bytearray(written("phi3").gguf.read_bytes())
    key = b"general.architecture"
    at = raw.index(key) + len(key) + 4 + 8  # the value: type (4 bytes), string length (8), then "phi3"
    assert raw[at:at + 4] == b"phi3"
    raw[at:at + 4] = b"phi9"
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=r"other\.gguf: GGUF architecture 'phi9' is not supported yet "
                                               r"\(supported: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, "
                                               r"gpt-oss, deepseek2, command-r, cohere2, glm4, glm4moe, mistral3, "
                                               r"qwen35, qwen35moe\)"):
        load_model(path, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FIXTURES))
def test_gpu_gguf_family_matches_cpu(name: str, written, loaded) -> None:
    """On CUDA in float16 (block formats as stored, MoE decode through the gathered path): prompt logits and 8
    decode steps on the float32 CPU run's tokens within 1e-2 relative of that run; Gemma 3 within 2e-2, the bound
    tests/test_architectures_moe_gemma.py measured for its seven layers of (1 + w) norms in fp16. Few-row GGML
    linears (decode) run the integer GEMV, which rounds its activations to int8 per 16 values as llama.cpp does: that
    error is the model's under the rounding rule, measured here by a second float32 CPU run that rounds the same way
    (tests/fixtures/int8_activations.py), and allowed 1.5 times over (the GPU rounds float16 activations, which land
    on the other side of a rounding step now and then: about sqrt(2) times the noise) on top of the float16 bound.
    On the H200 (2026-12-03), Gemma 3: 9.5e-2 with the int8 GEMV, 1.2e-2 with the float16-activation one; the
    rounding rule alone 6.5e-2."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    tol = 2e-2 if name.startswith("gemma3") else 1e-2
    runs = {"cpu": loaded(name), "gpu": load_model(written(name).gguf, device="cuda", dtype="float16", max_seq_len=96)}
    if int8_on_cuda():
        runs["int8"] = load_model(written(name).gguf, device="cpu", max_seq_len=96)
    caches = {k: lm.model.new_cache() for k, lm in runs.items()}
    errs: Dict[str, list] = {"gpu": [], "int8": []}

    def step(ids: torch.Tensor) -> torch.Tensor:
        ref = runs["cpu"].model.forward(ids, caches["cpu"], last_only=False)
        ours = runs["gpu"].model.forward(ids.cuda(), caches["gpu"], last_only=False).float().cpu()
        errs["gpu"].append(row_rel_err(ours, ref))
        if "int8" in runs:
            with int8_ggml_activations():
                errs["int8"].append(row_rel_err(runs["int8"].model.forward(ids, caches["int8"], last_only=False), ref))
        return ref

    ref = step(prompt_ids(written(name).built, 16, seed=4))
    for _ in range(8):
        ref = step(torch.tensor([[int(ref[0, -1].argmax())]]))
    runs["gpu"].unload()
    bound = tol + 1.5 * max(errs["int8"], default=0.0)
    assert max(errs["gpu"]) < bound, (errs, bound)


def _meta(arch: str, layers: int, **extra: Any) -> Dict[str, Any]:
    base = {"general.architecture": arch, f"{arch}.embedding_length": 4608, f"{arch}.attention.head_count": 32,
            f"{arch}.attention.head_count_kv": 16, f"{arch}.attention.key_length": 128,
            f"{arch}.feed_forward_length": 36864, f"{arch}.block_count": layers,
            "tokenizer.ggml.tokens": ["a"] * 8}
    base.update({f"{arch}.{k}": v for k, v in extra.items()})
    return base


def test_gguf_gemma_rules_llama_cpp_fixes_in_code() -> None:
    """What llama.cpp decides from the layer count or the absence of a key, restated: the 27B models scale q·k by
    (hidden / heads) ** -0.5, the others by head_dim ** -0.5; Gemma 3 without a window is global everywhere."""
    from kobold_backend.engine.gguf.config import hf_config

    g2_27b = hf_config(_meta("gemma2", 46, **{"attention.sliding_window": 4096}), [], "x.gguf")
    assert g2_27b["query_pre_attn_scalar"] == 4608 / 32 == 144
    g2_9b = hf_config(_meta("gemma2", 42, **{"attention.sliding_window": 4096}), [], "x.gguf")
    assert g2_9b["query_pre_attn_scalar"] == 128
    g3_27b = hf_config(_meta("gemma3", 62, **{"attention.sliding_window": 1024}), [], "x.gguf")
    assert g3_27b["query_pre_attn_scalar"] == 144 and g3_27b["sliding_window_pattern"] == 6
    g3_global = hf_config(_meta("gemma3", 26), [], "x.gguf")
    assert g3_global["layer_types"] == ["full_attention"] * 26 and g3_global["sliding_window"] is None
