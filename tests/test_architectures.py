"""Every non-Llama architecture against transformers (CPU, float32): Qwen2/2.5, Qwen3, Phi-3 (fused projections,
LongRoPE) and sliding-window attention (Mistral, Qwen2), dense and GPTQ.

Fixtures are built by transformers' own model classes (tests/fixtures/arch_checkpoints.py); for GPTQ transformers
loads the packer's dequantized weights, so both sides hold the same numbers and agree to float32 rounding.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.arch_checkpoints import ARCH_SPECS, ArchCheckpointFactory
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, hf_step, prompt_ids, row_rel_err

ALL = [s.name for s in ARCH_SPECS]
SWA = ["mistral_swa", "qwen2_swa"]
LOGITS_RTOL = 1e-4
REUSE_RTOL = 1e-5
GREEDY_TOKENS = 32
MAX_SEQ = 96  # below phi3_longrope's original context (128): the short factors, as transformers uses there



@pytest.fixture(scope="module")
def archs(tmp_path_factory: pytest.TempPathFactory) -> ArchCheckpointFactory:
    return ArchCheckpointFactory(tmp_path_factory.mktemp("arch_fixtures"))


@pytest.fixture(scope="module")
def ours(archs: ArchCheckpointFactory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(archs: ArchCheckpointFactory) -> Callable[[str], torch.nn.Module]:
    return by_name(lambda name: hf_load(archs.get(name).oracle_path))


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name: str, archs, ours, hf, record_property) -> None:
    built = archs.get(name)
    ids = prompt_ids(built, 40, seed=1)
    lm = ours(name)
    logits = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        ref = hf(name)(ids).logits
    err = row_rel_err(logits, ref)
    record_property("max_rel_err", err)
    assert err < LOGITS_RTOL, f"{name}: max relative logit error {err:.3e}"


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_transformers(name: str, archs, ours, hf, record_property) -> None:
    prompt = prompt_ids(archs.get(name), 16, seed=2)
    run = greedy_both(ours(name), hf(name), prompt, GREEDY_TOKENS)
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    assert run.tokens == run.ref_tokens
    err = max(row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits))
    record_property("max_step_rel_err", err)
    assert err < LOGITS_RTOL, f"{name}: decode-step logits differ by {err:.3e}"


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi3"] + SWA)
def test_prefix_reuse_matches_fresh_prefill(name: str, archs, ours) -> None:
    built, lm = archs.get(name), ours(name)
    a, b, c = prompt_ids(built, 20, 3), prompt_ids(built, 12, 4)[:, 1:], prompt_ids(built, 9, 5)[:, 1:]
    fresh = lm.model.forward(torch.cat([a, b], 1), lm.model.new_cache(), last_only=False)[:, 20:]
    cache = lm.model.new_cache()
    lm.model.forward(torch.cat([a, c], 1), cache)
    cache.truncate(20)
    assert row_rel_err(lm.model.forward(b, cache, last_only=False), fresh) < REUSE_RTOL


def test_fused_checkpoint_projections_stay_fused(archs, ours) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused (dense and GPTQ); the loader keeps them as one weight each."""
    for name in ("phi3", "phi3_gptq"):
        lm = ours(name)
        cfg = lm.config
        qkv = cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
        for layer in lm.model.layers:
            assert layer.q_proj is None and layer.gate_proj is None
            width = [w.out_features if isinstance(w, GPTQWeight) else w.shape[0]
                     for w in (layer.qkv_proj, layer.gate_up_proj)]
            assert width == [qkv, 2 * cfg.intermediate_size]
            assert isinstance(layer.qkv_proj, GPTQWeight) == (name == "phi3_gptq")
            assert layer.weight("k_proj") is not None  # the per-projection view still works


def test_qwen2_biases_are_loaded_for_dense_and_gptq(ours) -> None:
    for name in ("qwen2", "qwen2_gptq"):
        layer = ours(name).model.layers[0]
        if name == "qwen2":
            assert set(layer.biases) == {"qkv_proj"}
        else:
            assert isinstance(layer.qkv_proj, GPTQWeight) and layer.qkv_proj.bias is not None


# ---------------------------------------------------------------------------------------------------------------
# Sliding windows: prompts longer than the window, then decoding past it.


def _edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name", SWA)
def test_sliding_window_fixture_is_sensitive(name: str, archs, hf, tmp_path: Path) -> None:
    """Full attention would give other logits: the long-context tests below really test the window."""
    built = archs.get(name)
    ids = prompt_ids(built, 40, seed=1)
    cfg = json.loads((built.oracle_path / "config.json").read_text())
    off = {"layer_types": ["full_attention"] * cfg["num_hidden_layers"]} if "layer_types" in cfg else {}
    full = hf_load(_edited(built.oracle_path, tmp_path / name, sliding_window=None, use_sliding_window=False, **off))
    with torch.no_grad():
        assert row_rel_err(full(ids).logits[:, 10:], hf(name)(ids).logits[:, 10:]) > 1e-2


@pytest.mark.parametrize("name", SWA)
def test_sliding_window_long_prompt_then_decode(name: str, archs, ours, hf) -> None:
    """A 24-token prompt (3 windows) prefilled in uneven chunks, then 48 greedy tokens: ours == transformers."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 24, seed=11), 48, cuts=(5, 17))
    assert row_rel_err(run.last_chunk, run.ref_prompt[:, 17:]) < LOGITS_RTOL
    assert run.tokens == run.ref_tokens
    assert max(row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)) < LOGITS_RTOL


@pytest.mark.parametrize("name", SWA)
def test_sliding_window_graph_step_matches_forward(name: str, archs, ours) -> None:
    """decode_step (what a CUDA graph captures: device position, bucketed length) masks the window on the device."""
    built, lm = archs.get(name), ours(name)
    prompt = prompt_ids(built, 30, seed=12)
    eager, graphy = lm.model.new_cache(), lm.model.new_cache()
    lm.model.forward(prompt, eager)
    lm.model.forward(prompt, graphy)
    token = torch.tensor([[7]])
    for step in range(20):
        pos = graphy.reserve(1)
        ref = lm.model.forward(token, eager)[0, -1]
        got = lm.model.decode_step(token, torch.tensor([pos]), graphy, 64)[0, -1]
        graphy.seq_len = pos + 1
        assert row_rel_err(got, ref) < REUSE_RTOL, step
        token = ref.argmax().view(1, 1)


def test_sliding_window_context_shift_is_exact_on_one_layer(archs) -> None:
    """On a one-layer model the cache after a shift must give the logits of a fresh prefill of the kept tokens,
    window included (positions move; what a query can see moves with them)."""
    lm = load_model(archs.get("mistral_swa").path, device="cpu", dtype="float32", max_seq_len=MAX_SEQ)
    model = lm.model
    del model.layers[1:], model.cos[1:], model.sin[1:]
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :4], ids[:, 4:20], ids[:, 20:50], ids[:, 50:]
    cache = model.new_cache()
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 4, 16)
    shifted = model.forward(new, cache, last_only=False)
    fresh = model.forward(torch.cat([memory, kept, new], 1), model.new_cache(), last_only=False)[:, -10:]
    assert row_rel_err(shifted, fresh) < REUSE_RTOL


# ---------------------------------------------------------------------------------------------------------------
# LongRoPE: short factors below the original context, long factors (and the same attention factor) above it.


def test_longrope_long_factors_match_transformers_past_the_original_context(archs, hf) -> None:
    """A table longer than original_max_position_embeddings (128) uses the long factors from position 0; so does
    transformers for a forward whose positions pass 128. Prefill 140 tokens, then decode 8 greedy tokens."""
    built = archs.get("phi3_longrope")
    lm = load_model(built.path, device="cpu", max_seq_len=256)
    prompt = prompt_ids(built, 140, seed=13)
    run = greedy_both(lm, hf("phi3_longrope"), prompt, 8)
    assert run.tokens == run.ref_tokens
    assert max(row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)) < LOGITS_RTOL
    assert row_rel_err(run.last_chunk, run.ref_prompt) < LOGITS_RTOL


def test_longrope_fixture_is_sensitive(archs, ours, hf, tmp_path: Path) -> None:
    """Short vs long factors and the attention factor each change the logits, so the tests above see them."""
    built = archs.get("phi3_longrope")
    ids = prompt_ids(built, 40, seed=1)
    long_table = load_model(built.path, device="cpu", max_seq_len=256)
    short = ours("phi3_longrope").model.forward(ids, ours("phi3_longrope").model.new_cache(), last_only=False)
    long = long_table.model.forward(ids, long_table.model.new_cache(), last_only=False)
    assert row_rel_err(long, short) > 1e-2
    cfg = json.loads((built.oracle_path / "config.json").read_text())
    no_factor = hf_load(_edited(built.oracle_path, tmp_path / "af1",
                                rope_scaling=dict(cfg["rope_scaling"], attention_factor=1.0)))
    with torch.no_grad():
        assert row_rel_err(no_factor(ids).logits, hf("phi3_longrope")(ids).logits) > 1e-2
    assert abs(ours("phi3_longrope").model.rope_factors[0] - 1.1338934) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# GPU: native kernels in float16. Bound: 5e-3 relative logit error (fp16 activations and weights, as the Llama
# oracle's GPU test), along transformers' greedy path (teacher-forced).

GPU_RTOL = 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_gpu_logits_match_transformers(name: str, archs, hf, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    built = archs.get(name)
    lm = load_model(built.path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ)
    ref_model = hf(name)
    prompt = prompt_ids(built, 24, seed=10)
    cache = lm.model.new_cache()
    got = lm.model.forward(prompt.cuda(), cache, last_only=False)
    ref, past = hf_step(ref_model, prompt, None)
    errs = [row_rel_err(got.cpu(), ref)]
    for _ in range(24):
        token = ref[:, -1:].argmax(-1)
        got = lm.model.forward(token.cuda(), cache)
        ref, past = hf_step(ref_model, token, past)
        errs.append(row_rel_err(got.cpu(), ref[:, -1:]))
    record_property("max_rel_err", max(errs))
    assert max(errs) < GPU_RTOL, f"{name}: max relative logit error {max(errs):.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_gpu_graph_decode_matches_transformers(name: str, archs, hf) -> None:
    """CUDA-graph decode (device position; windows masked on the device) past the sliding window, teacher-forced."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from kobold_backend.engine.decode_graph import GraphDecoder

    built = archs.get(name)
    lm = load_model(built.path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ)
    ref_model = hf(name)
    prompt = prompt_ids(built, 20, seed=14)
    cache = lm.model.new_cache()
    lm.model.forward(prompt.cuda(), cache)
    graphs = GraphDecoder(lm.model, cache)
    ref, past = hf_step(ref_model, prompt, None)
    errs = []
    for _ in range(40):
        token = ref[:, -1:].argmax(-1)
        got = graphs.step(int(token))
        ref, past = hf_step(ref_model, token, past)
        errs.append(row_rel_err(got.float().cpu(), ref[0, -1]))
    assert max(errs) < GPU_RTOL, f"{name}: max relative logit error {max(errs):.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2_gptq", "phi3_gptq", "qwen2_swa"])
def test_gpu_layer_split_matches_transformers(name: str, archs, hf) -> None:
    """Layer 0 on the GPU (fp16), layer 1 and the head's inputs crossing to the CPU (fp32): no per-arch code."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    built = archs.get(name)
    lm = load_model(built.path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ, layer_devices=["cuda", "cpu"])
    prompt = prompt_ids(built, 30, seed=16)
    got = lm.model.forward(prompt.cuda(), lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        ref = hf(name)(prompt).logits
    assert row_rel_err(got.cpu(), ref) < GPU_RTOL


# ---------------------------------------------------------------------------------------------------------------
# Every host runs every architecture with no code of its own: United's folder check, the server's model report,
# the generator, the split planner.


@pytest.mark.parametrize("name", ALL)
def test_united_accepts_the_folder_and_the_planner_counts_it(name: str, archs, ours) -> None:
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import Sizes, checkpoint_shapes, config_shapes, plan_device_map
    from kobold_backend.engine.load_options import requested_parameters
    from kobold_backend.host.backend import check_model_folder

    built, lm = archs.get(name), ours(name)
    assert check_model_folder(built.path) is None
    dialog = {p["id"]: p for p in requested_parameters(built.path, {}, gpus=[])}
    assert dialog["valid_layers"]["label"].endswith(f"/{lm.config.num_layers}") and "CPU_Layers" in dialog
    shapes = checkpoint_shapes(built.path)
    assert config_shapes(ModelConfig.from_dir(built.path)) == shapes
    dm = plan_device_map(built.path, None, MAX_SEQ, layer_counts={"cpu": lm.config.num_layers})
    (usage,) = dm.usage
    assert usage.weight_bytes == lm.model.nbytes
    assert usage.cache_bytes == lm.model.new_cache().nbytes
    sizes = Sizes(lm.config, shapes, MAX_SEQ)
    for i, layer in enumerate(lm.model.layers):
        held = [w for w in layer.tensors()]
        assert sizes.layer(i, 4) == sum(w.nbytes if isinstance(w, GPTQWeight) else w.numel() * w.element_size()
                                        for w in held)


def test_server_names_the_architecture(archs) -> None:
    from tests.server_helpers import make_app

    app = make_app(archs.get("phi3").path)
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/phi3", "architecture": "Phi3ForCausalLM",
                                                     "format": "float16", "bits_per_weight": 16.0}
        assert c.get("/ui/status").get_json()["architecture"] == "Phi3ForCausalLM"
    finally:
        app.extensions["kobold_backend"].close()


@pytest.mark.parametrize("name", ["qwen2_swa", "qwen3_gptq", "phi3_longrope"])
def test_generator_greedy_matches_transformers(name: str, archs, ours, hf) -> None:
    """The engine's Generator (lane, chunked prefill, sampler at temperature 0) gives transformers' greedy tokens."""
    from kobold_backend.engine.generator import GenerationRequest, Generator
    from kobold_backend.engine.sampling import SamplerSettings

    built, lm = archs.get(name), ours(name)
    prompt = prompt_ids(built, 20, seed=15)
    out = Generator(lm.model, lm.tokenizer).generate(
        GenerationRequest(prompt[0].tolist(), 24, SamplerSettings(temperature=0), ban_eos=True))
    assert out.token_ids == greedy_both(lm, hf(name), prompt, 24).ref_tokens


# ---------------------------------------------------------------------------------------------------------------
# Configs this engine cannot run: one precise message each, before any weight is read.

LONG_SHORT = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=160,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
PHI3 = dict(QWEN2, model_type="phi3", architectures=["Phi3ForCausalLM"], max_position_embeddings=512,
            original_max_position_embeddings=128)


@pytest.mark.parametrize("raw, words", [
    (dict(QWEN2, architectures=["LlamaForCausalLM"]), ["LlamaForCausalLM", "qwen2"]),
    (dict(QWEN2, model_type="qwen9"), ["qwen9", "qwen2", "phi3"]),
    (dict(QWEN2, hidden_act="relu"), ["hidden_act", "relu"]),
    (dict(QWEN2, use_sliding_window=True, sliding_window=-4), ["sliding_window", "-4"]),
    (dict(QWEN2, use_sliding_window=True, sliding_window=8, max_window_layers="x"), ["max_window_layers"]),
    (dict(QWEN2, layer_types=["full_attention"]), ["layer_types", "2"]),
    (dict(QWEN2, layer_types=["full_attention", "chunked_attention"]), ["chunked_attention"]),
    (dict(PHI3, partial_rotary_factor=0.75), ["partial_rotary_factor"]),
    (dict(PHI3, rope_scaling=dict(LONG_SHORT, type="longrope", short_factor=[1.0] * 3)), ["short_factor", "8"]),
    (dict(PHI3, rope_scaling={"type": "dynamic", "factor": 4.0}), ["dynamic"]),
])
def test_unsupported_configs_name_their_problem(raw: dict, words: List[str]) -> None:
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.errors import ModelFormatError

    with pytest.raises(ModelFormatError) as info:
        ModelConfig.from_dict(raw)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_longrope_reads_hub_and_transformers5_spellings() -> None:
    """'su' and 'longrope', under rope_scaling (the Hub) or rope_parameters (what transformers 5 writes)."""
    from kobold_backend.engine.config import ModelConfig

    for key, kind in (("rope_scaling", "su"), ("rope_scaling", "longrope"), ("rope_parameters", "longrope")):
        cfg = ModelConfig.from_dict(dict(PHI3, **{key: dict(LONG_SHORT, type=kind, rope_theta=5000.0)}))
        scaling = cfg.rope_scaling
        assert scaling is not None and scaling.rope_type == "longrope"
        assert scaling.original_max_position_embeddings == 128 and scaling.factor == 4.0
        assert abs(scaling.attention_factor - (1 + math.log(4) / math.log(128)) ** 0.5) < 1e-12
        assert cfg.rope_theta == (5000.0 if key == "rope_parameters" else 10000.0)


# ---------------------------------------------------------------------------------------------------------------
# The attention ops' window and soft-cap arguments (Gemma's hooks too) against the formula written out per query.


def _direct_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: List[int], scale: float,
                      window, softcap) -> torch.Tensor:
    """q [Hq, D] rows at `positions`; k, v [Hkv, S, D]; float64, one query and one head at a time."""
    hq, hkv = q.shape[1], k.shape[0]
    out = torch.zeros(len(positions), hq, q.shape[-1], dtype=torch.float64)
    for r, i in enumerate(positions):
        lo = 0 if window is None else max(0, i - window + 1)
        for h in range(hq):
            kv = h // (hq // hkv)
            s = (k[kv, lo : i + 1].double() @ q[r, h].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[r, h] = torch.softmax(s, 0) @ v[kv, lo : i + 1].double()
    return out


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 7.0), (4, 3.0), (64, None)])
def test_attention_ops_window_and_softcap(window, softcap) -> None:
    from kobold_backend import ops

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, s = 4, 2, 16, 40
    k_cache = torch.randn(1, hkv, s, d, generator=g)
    v_cache = torch.randn(1, hkv, s, d, generator=g)
    q = 2.0 * torch.randn(1, 12, hq, d, generator=g)
    scale = d ** -0.5
    for pos in (0, 9):  # a first chunk and a later one
        got = ops.attention(q, k_cache, v_cache, pos, scale, window=window, softcap=softcap)[0]
        want = _direct_attention(q[0], k_cache[0], v_cache[0], list(range(pos, pos + 12)), scale, window, softcap)
        assert (got.double() - want).abs().max() < 1e-5
    for n in (3, 20, 40):
        want = _direct_attention(q[0, :1], k_cache[0], v_cache[0], [n - 1], scale, window, softcap)[0]
        got = ops.decode_attention(q[:, 0], k_cache, v_cache, n, scale, window=window, softcap=softcap)[0]
        assert (got.double() - want).abs().max() < 1e-5
        at = ops.decode_attention_at(q[:, 0], k_cache, v_cache, torch.tensor([n - 1]), s, scale,
                                     window=window, softcap=softcap)[0]
        assert (at.double() - want).abs().max() < 1e-5
