"""Gemma 4 and Gemma 3n (text) against transformers (CPU, float32): logits, greedy decoding, the cache features,
the hosts and refusals.

Fixtures are built by transformers' own config and model classes (tests/fixtures/gemma4_checkpoints.py):
`gemma4_e` has per-layer embeddings, KV sharing, a double-wide MLP on the sharing layers and wide global heads with
partial RoPE; `gemma4_dense` has global layers whose values are their keys' projection (attention_k_eq_v) and a
config.json in the Hub's spelling; `gemma4_wide` the released head sizes; `gemma4_moe` the 26B-A4B block;
`gemma4_wide_shared` KV sharing over 512-wide global heads; `gemma3n` AltUp, Laurel, activation sparsity and a
short per-layer table; `*_mm` the multimodal folder layouts.
All have a sliding window of 8, shorter than every prompt here.
"""

from __future__ import annotations

import json
from typing import Callable, List

import pytest
import torch

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.model import Model
from kobold_backend.errors import ModelFormatError
from tests.fixtures.gemma4_checkpoints import SPECS, Gemma4Factory
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, prompt_ids, row_rel_err

ALL = [s.name for s in SPECS]
GEMMA4 = [s.name for s in SPECS if s.family == "gemma4"]
LOGITS_RTOL = 1e-4
REUSE_RTOL = 1e-5
GREEDY_TOKENS = 32
MAX_SEQ = 96


@pytest.fixture(scope="module")
def archs(tmp_path_factory: pytest.TempPathFactory) -> Gemma4Factory:
    return Gemma4Factory(tmp_path_factory.mktemp("gemma4_fixtures"))


@pytest.fixture(scope="module")
def ours(archs: Gemma4Factory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(archs: Gemma4Factory) -> Callable[[str], torch.nn.Module]:
    return by_name(lambda name: hf_load(archs.get(name).oracle_path))


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name: str, archs, ours, hf, record_property) -> None:
    built = archs.get(name)
    ids = prompt_ids(built, 40, seed=1)
    lm = ours(name)
    logits = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        ref = hf(name)(ids).logits
    err, diff = row_rel_err(logits, ref), float((logits - ref).abs().max())
    record_property("max_rel_err", err)
    record_property("max_abs_diff", diff)
    # logits reach ~8: 2e-4 absolute is float32 rounding through Gemma 3n's sparsity cutoffs (Gemma 4: < 1e-4)
    assert err < LOGITS_RTOL and diff < 2e-4, f"{name}: relative {err:.3e}, absolute {diff:.3e}"


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_transformers(name: str, archs, ours, hf, record_property) -> None:
    """A 16-token prompt in uneven chunks then 32 greedy tokens through each side's KV cache (4 windows of 8)."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 16, seed=2), GREEDY_TOKENS, cuts=(3, 10))
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    errs = [row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    assert len(set(run.ref_tokens)) > 3, f"fixture {name} decodes a loop; it would prove little"
    record_property("max_step_rel_err", max(errs))
    assert row_rel_err(run.last_chunk, run.ref_prompt[:, 10:]) < LOGITS_RTOL
    assert run.tokens == run.ref_tokens
    assert max(errs) < LOGITS_RTOL, f"{name}: decode-step logits differ by {max(errs):.3e}"


@pytest.mark.parametrize("name", ALL)
def test_generator_greedy_matches_transformers(name: str, archs, ours, hf) -> None:
    """The engine's Generator (lane, chunked prefill, sampler at temperature 0) gives transformers' greedy tokens."""
    from kobold_backend.engine.generator import GenerationRequest, Generator
    from kobold_backend.engine.sampling import SamplerSettings

    built, lm = archs.get(name), ours(name)
    prompt = prompt_ids(built, 20, seed=15)
    out = Generator(lm.model, lm.tokenizer).generate(
        GenerationRequest(prompt[0].tolist(), GREEDY_TOKENS, SamplerSettings(temperature=0), ban_eos=True))
    assert out.token_ids == greedy_both(lm, hf(name), prompt, GREEDY_TOKENS).ref_tokens


@pytest.mark.parametrize("name", ALL)
def test_prefix_reuse_and_rewind_match_fresh_prefill(name: str, archs, ours) -> None:
    built, lm = archs.get(name), ours(name)
    a, b, c = prompt_ids(built, 20, 3), prompt_ids(built, 12, 4)[:, 1:], prompt_ids(built, 9, 5)[:, 1:]
    fresh = lm.model.forward(torch.cat([a, b], 1), lm.model.new_cache(), last_only=False)[:, 20:]
    cache = lm.model.new_cache()
    lm.model.forward(torch.cat([a, c], 1), cache)
    cache.rewind(c.shape[1])
    # a chunk after a rewind runs other matrix shapes than one prefill: float32 rounding, which Gemma 3n's sparsity
    # cutoffs (mean + k * std of a row) can carry across the cutoff (1.5e-5 / 2.8e-5 with torch 2.13, here 2026-12-03),
    # as in test_logits_match_transformers
    tol = LOGITS_RTOL if archs.get(name).spec.family == "gemma3n" else REUSE_RTOL
    assert row_rel_err(lm.model.forward(b, cache, last_only=False), fresh) < tol
    twin = cache.clone()
    for i, src in enumerate(twin.sources):
        assert twin.k[i] is not cache.k[i] and (src is None or twin.k[i] is twin.k[src])
    assert row_rel_err(lm.model.forward(c, twin, last_only=False), lm.model.forward(c, cache, last_only=False)) == 0


@pytest.mark.parametrize("name", ALL)
def test_graph_step_matches_forward(name: str, archs, ours) -> None:
    """decode_step (what a CUDA graph captures: device position, bucketed length) equals forward, past the window."""
    built, lm = archs.get(name), ours(name)
    prompt = prompt_ids(built, 12, seed=12)
    eager, graphy = lm.model.new_cache(), lm.model.new_cache()
    lm.model.forward(prompt, eager)
    lm.model.forward(prompt, graphy)
    token = torch.tensor([[7]])
    for step in range(16):
        pos = graphy.reserve(1)
        ref = lm.model.forward(token, eager)[0, -1]
        got = lm.model.decode_step(token, torch.tensor([pos]), graphy, 64)[0, -1]
        graphy.seq_len = pos + 1
        assert row_rel_err(got, ref) < REUSE_RTOL, step
        token = ref.argmax().view(1, 1)


def test_multi_row_decode_step_with_shared_kv_and_wide_heads(archs, hf) -> None:
    """Five rows fed at a device position in one decode_step (a speculative verification): KV-sharing layers (their
    queries rotated for T device positions, no cache write) over 512-wide global and 256-wide local caches, past the
    window, give the prompt forward's logits, which match transformers'."""
    name = "gemma4_wide_shared"
    built = archs.get(name)
    model = load_model(built.path, device="cpu", max_seq_len=MAX_SEQ).model
    wide = [i for i, d in enumerate(model.head_dims) if d == 512]
    shared = [i for i, src in enumerate(model.kv_sources) if src is not None]
    assert wide and shared and any(model.kv_sources[i] in wide for i in shared)
    ids = prompt_ids(built, 45, seed=13)
    eager, rows = model.new_cache(), model.new_cache()
    for cache in (eager, rows):
        model.forward(ids[:, :40], cache)
    want = model.forward(ids[:, 40:], eager, last_only=False)
    got = model.decode_step(ids[:, 40:], torch.tensor([40]), rows, MAX_SEQ)
    assert row_rel_err(got, want) < REUSE_RTOL
    with torch.no_grad():
        ref = hf(name)(ids).logits[:, 40:]
    assert row_rel_err(want, ref) < LOGITS_RTOL


def _keep_layers(model: Model, keep: List[int]) -> None:
    """Cut the model down to the layers `keep` (a sharing layer's source renumbered)."""
    where = {old: new for new, old in enumerate(keep)}
    model.kv_sources = [None if model.kv_sources[i] is None else where[model.kv_sources[i]] for i in keep]
    for name in ("layers", "cos", "sin", "rope_factors", "rope_perms", "head_dims", "kv_heads", "intermediates",
                 "sparsity", "sparse_cut"):
        setattr(model, name, [getattr(model, name)[i] for i in keep])
    model.windows = tuple(model.windows[i] for i in keep)


@pytest.mark.parametrize("keep", [[3, 4], [2, 5]], ids=["local", "global"])
def test_context_shift_with_shared_kv(keep: List[int], archs) -> None:
    """Context shifting on a source layer and the layer that reads its cache (local: window 8, full RoPE; global:
    head 64, partial RoPE): the shifted cache gives the logits of a fresh prefill of the kept tokens (the source
    layer is first, so its keys depend on the tokens alone)."""
    model = load_model(archs.get("gemma4_e").path, device="cpu", max_seq_len=MAX_SEQ).model
    assert model.kv_sources[keep[1]] == keep[0]
    _keep_layers(model, keep)
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :4], ids[:, 4:20], ids[:, 20:50], ids[:, 50:]
    cache = model.new_cache()
    assert cache.k[1] is cache.k[0] and cache.v[1] is cache.v[0]
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 4, 16)
    shifted = model.forward(new, cache, last_only=False)
    fresh = model.forward(torch.cat([memory, kept, new], 1), model.new_cache(), last_only=False)[:, -10:]
    assert row_rel_err(shifted, fresh) < REUSE_RTOL


@pytest.mark.parametrize("keep", [[3, 4], [2, 5]], ids=["local", "global"])
@pytest.mark.parametrize("cache_dtype, once_bound", [("q8", 0.006), ("q4", 0.12)])
def test_quantized_shared_cache_shifts(keep: List[int], cache_dtype: str, once_bound: float, archs) -> None:
    """A quantized cache shared by two layers: its keys are one rounding from the exact keys, the shifted ones
    (re-quantized once after the re-rotation, not once per layer that reads them) about sqrt(2) roundings, and the
    values move exactly (as tests/test_kv_quant.py checks for a layer of its own)."""
    model = load_model(archs.get("gemma4_e").path, device="cpu", max_seq_len=MAX_SEQ).model
    _keep_layers(model, keep)
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept = ids[:, :4], ids[:, 4:20], ids[:, 20:50]
    cache = model.new_cache(cache_dtype=cache_dtype)
    assert cache.k[1] is cache.k[0]
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    v_before = cache.v[0].data[:, :, 20:50].clone()
    model.shift_cache(cache, 4, 16)
    assert torch.equal(cache.v[0].data[:, :, 4:34], v_before)
    exact, fresh = model.new_cache(), model.new_cache(cache_dtype=cache_dtype)
    model.forward(torch.cat([memory, kept], 1), exact)
    model.forward(torch.cat([memory, kept], 1), fresh)
    k_exact = exact.k[0][:, :, :34].float()
    once = ((fresh.k[0][:, :, :34].float() - k_exact).norm() / k_exact.norm()).item()
    twice = ((cache.k[0][:, :, :34].float() - k_exact).norm() / k_exact.norm()).item()
    assert once < once_bound and twice < 1.6 * once, (once, twice)


@pytest.mark.parametrize("name", [n for n in GEMMA4 if n != "gemma4_moe"])  # 4-bit values flip its routing
@pytest.mark.parametrize("cache_dtype, bound", [("q8", 0.1), ("k8v4", 0.6)])
def test_quantized_cache_runs_every_layer(name: str, cache_dtype: str, bound: float, archs, ours) -> None:
    """Every layer's quantized buffers have its own head count and size (sharing layers none of their own); the
    logits stay near the fp16 cache's (these fixtures are chaotic: Gemma 3's moves 11% at q8)."""
    built, base = archs.get(name), ours(name)
    lm = load_model(built.path, device="cpu", max_seq_len=MAX_SEQ, cache_dtype=cache_dtype)
    ids = prompt_ids(built, 24, seed=6)
    cache = lm.model.new_cache()
    for i in range(len(lm.model.layers)):
        src = lm.model.kv_sources[i]
        assert cache.k[i].shape == (1, lm.model.kv_heads[i], MAX_SEQ, lm.model.head_dims[i])
        assert src is None or cache.k[i] is cache.k[src]
    assert cache.nbytes < base.model.new_cache().nbytes
    got = lm.model.forward(ids, cache, last_only=False)
    ref = base.model.forward(ids, base.model.new_cache(), last_only=False)
    assert row_rel_err(got, ref) < bound


def test_gemma4_features_are_read(ours) -> None:
    e, d = ours("gemma4_e").model, ours("gemma4_dense").model
    assert e.windows == (8, 8, None, 8, 8, None) and e.kv_sources == [None, None, None, None, 3, 2]
    assert e.head_dims == [32, 32, 64, 32, 32, 64] and e.intermediates == [96] * 4 + [192] * 2
    assert e.scale == 1.0 and e.features.norm_offset == 0.0 and e.features.final_softcap == 30.0
    full = e.features.ropes[2]
    assert (full.theta, full.dim, full.scaling.rope_type, full.scaling.partial_rotary_factor) == \
        (1e6, 64, "proportional", 0.25)
    # proportional RoPE: only the first 8 of 32 frequency pairs rotate
    assert torch.all(e.cos[2][:, 8:32] == 1) and not torch.all(e.cos[2][:, :8] == 1)
    assert e.per_layer_embedding is not None and all(layer.per_layer_gate is not None for layer in e.layers)
    assert e.layers[4].k_proj is None and e.layers[4].k_norm is None and e.layers[4].v_norm is None
    assert d.per_layer_embedding is None and d.kv_heads == [2, 1, 2, 1] and d.head_dims == [32, 64, 32, 64]
    assert d.layers[1].v_proj is None and d.layers[1].qkv_proj is None and d.layers[0].qkv_proj is not None
    cache = e.new_cache()
    assert cache.k[4] is cache.k[3] and cache.v[5] is cache.v[2] and tuple(cache.k[2].shape) == (1, 2, MAX_SEQ, 64)


@pytest.mark.parametrize("name, field, value", [
    ("gemma4_e", "v_norm", None),
    ("gemma4_e", "per_layer_gate", None),
    ("gemma4_e", "out_scale", None),
])
def test_fixture_is_sensitive(name: str, field: str, value, archs, ours) -> None:
    """Without the piece the logits move by more than 1%, so the tests above do test it."""
    built, lm = archs.get(name), ours(name)
    ids = prompt_ids(built, 40, seed=1)
    base = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    model = load_model(built.path, device="cpu", max_seq_len=MAX_SEQ).model
    for layer in model.layers:
        setattr(layer, field, value)
    assert row_rel_err(model.forward(ids, model.new_cache(), last_only=False), base) > 1e-2


def test_gemma3n_features_are_read(archs, ours) -> None:
    m = ours("gemma3n").model
    assert m.windows == (8, 8, None, 8, 8, None) and m.kv_sources == [None, None, None, None, 3, 2]
    assert m.intermediates == [96, 128, 96, 128, 96, 128] and m.sparsity == [0.95, 0.95, 0.0, 0.0, 0.0, 0.0]
    assert m.scale == 1.0 and m.features.final_softcap == 30.0 and m.streams is not None
    assert len(m.streams.projections) == 3 and all(layer.wrap is not None and layer.laurel is not None
                                                   for layer in m.layers)
    assert m.features.ropes[0].theta == 10000.0 and m.features.ropes[2].theta == 1e6
    assert m.per_layer_embedding.embed.shape[0] == archs.get("gemma3n").vocab_size - 40
    mm = ours("gemma3n_mm")
    assert mm.config.architecture == "Gemma3nForConditionalGeneration"
    assert all(torch.isfinite(t).all() for layer in mm.model.layers for t in layer.tensors()
               if isinstance(t, torch.Tensor))


def _gemma3n_without(model: Model, piece: str) -> None:
    if piece == "laurel":
        for layer in model.layers:
            layer.laurel = None
    elif piece == "sparsity":
        model.sparsity = [0.0] * len(model.layers)
    elif piece == "altup":
        for layer in model.layers:  # the layer's innovation reaches no other stream
            layer.wrap.correction = torch.full_like(layer.wrap.correction, -1.0)
    elif piece == "ple_vocab":  # ids past the per-layer table read their own (wrapped) row instead of row 0
        e = model.per_layer_embedding
        e.embed = torch.cat([e.embed, e.embed[1:41]])


@pytest.mark.parametrize("piece", ["laurel", "sparsity", "altup", "ple_vocab"])
def test_gemma3n_fixture_is_sensitive(piece: str, archs, ours) -> None:
    """Without each Gemma 3n piece the logits move by more than 1%, so the oracle tests above do test it (the
    prompt holds ids past the per-layer table)."""
    built, lm = archs.get("gemma3n"), ours("gemma3n")
    ids = prompt_ids(built, 40, seed=1)
    ids[0, 5:9] = torch.tensor([built.vocab_size - 1, built.vocab_size - 2, built.vocab_size - 3, built.vocab_size - 4])
    base = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    model = load_model(built.path, device="cpu", max_seq_len=MAX_SEQ).model
    _gemma3n_without(model, piece)
    assert row_rel_err(model.forward(ids, model.new_cache(), last_only=False), base) > 1e-2


def test_gemma3n_ids_past_the_per_layer_table_match_transformers(archs, ours, hf) -> None:
    built, lm = archs.get("gemma3n"), ours("gemma3n")
    ids = prompt_ids(built, 20, seed=3)
    ids[0, 4:8] = torch.arange(built.vocab_size - 4, built.vocab_size)
    got = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        assert row_rel_err(got, hf("gemma3n")(ids).logits) < LOGITS_RTOL


def test_gemma4_moe_paths_agree_and_read_only_chosen_experts(ours) -> None:
    """The grouped (prefill) and gathered (decode, graph-capturable) expert paths agree, and with every expert a
    token was not routed to poisoned with NaN its output is unchanged on both."""
    from kobold_backend.engine.gemma4_moe import Gemma4MoE

    block = ours("gemma4_moe").model.layers[0].mlp
    assert isinstance(block, Gemma4MoE) and block.top_k == 2 and block.gate_up.shape == (6, 64, 64)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    weights, experts = block.route(x)
    # renormalised top-k weights, then times each chosen expert's scale
    assert torch.allclose((weights / block.expert_scale[experts]).sum(-1), torch.ones(5), atol=1e-6)
    grouped, gathered = block._grouped(x, weights, experts), block._gathered(x, weights, experts)
    assert row_rel_err(gathered, grouped) < 1e-6
    one, chosen = x[:1], experts[0].tolist()
    clean = block._gathered(one, weights[:1], experts[:1])
    from dataclasses import replace

    unchosen = [e for e in range(6) if e not in chosen]
    poisoned = replace(block, gate_up=block.gate_up.clone(), experts_down=block.experts_down.clone())
    poisoned.gate_up[unchosen] = float("nan")
    poisoned.experts_down[unchosen] = float("nan")
    for run in (poisoned._gathered, poisoned._grouped):
        assert torch.equal(run(one, weights[:1], experts[:1]), clean) or \
            row_rel_err(run(one, weights[:1], experts[:1]), clean) < 1e-6


def test_partial_rope_and_k_eq_v_matter(archs, hf) -> None:
    """transformers itself moves by more than 1% with full RoPE on the global layers, or with a v_proj of their own
    in place of the keys' projection."""
    built = archs.get("gemma4_dense")
    ids = prompt_ids(built, 40, seed=1)
    with torch.no_grad():
        base = hf("gemma4_dense")(ids).logits
        for edit in ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},):
            cfg = dict(built.config, **edit)
            folder = built.path.parent / "gemma4_dense-full-rope"
            if not folder.exists():
                import shutil

                shutil.copytree(built.path, folder)
                (folder / "config.json").write_text(json.dumps(cfg))
            assert row_rel_err(hf_load(folder)(ids).logits, base) > 1e-2


@pytest.mark.parametrize("name", ALL)
def test_united_accepts_the_folder_and_the_planner_counts_it(name: str, archs, ours) -> None:
    """United's folder check reads a multimodal folder's text model; the split planner counts the per-layer
    embeddings and AltUp projections beside the embedding and no cache for KV-sharing layers (the loaded model
    holds a few hundred bytes more: value norms of ones, layer scalars, AltUp output scales)."""
    from kobold_backend.engine.device_map import checkpoint_shapes, config_shapes, plan_device_map
    from kobold_backend.host.backend import check_model_folder

    built, lm = archs.get(name), ours(name)
    assert check_model_folder(built.path) is None
    if name != "gemma3n_mm":  # its folder also holds (NaN) tower tensors the engine never reads
        assert config_shapes(ModelConfig.from_dir(built.path)) == checkpoint_shapes(built.path)
    dm = plan_device_map(built.path, None, MAX_SEQ, layer_counts={"cpu": lm.config.num_layers})
    (usage,) = dm.usage
    assert 0 <= lm.model.nbytes - usage.weight_bytes < 0.002 * lm.model.nbytes
    assert usage.cache_bytes == lm.model.new_cache().nbytes


@pytest.mark.parametrize("name", ["gemma4_mm", "gemma3n_mm"])
def test_server_runs_the_text_model_and_refuses_images_and_audio(name: str, archs) -> None:
    """A multimodal Gemma folder served: /api/v1/model names the class, text completes, a chat asking for an image
    or audio is refused in one sentence (the engine loads no vision or audio tower)."""
    from kobold_backend.server import ServerConfig, create_app
    from tests.server_helpers import make_holder

    app = create_app(ServerConfig(), make_holder(archs.get(name).path, context=MAX_SEQ))
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json()["architecture"].endswith("ForConditionalGeneration")
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.get_json()["usage"]["completion_tokens"] == 2
        for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                     {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):
            out = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, part]}], "max_tokens": 2})
            message = out.get_json()["error"]["message"]
            assert out.status_code == 400 and "supported" in message and "\n" not in message, message
    finally:
        app.extensions["kobold_backend"].close()


def _config(**changes) -> dict:
    return dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                **changes)


@pytest.mark.parametrize("changes, words", [
    (dict(enable_moe_block=True, num_experts=4), ["enable_moe_block", "top_k_experts"]),
    (dict(use_bidirectional_attention="all"), ["bidirectional"]),
    (dict(num_kv_shared_layers=2), ["num_kv_shared_layers"]),
    (dict(layer_types=["full_attention"]), ["layer_types"]),
    (dict(hidden_activation="relu"), ["relu"]),
])
def test_refused_in_one_sentence(changes, words) -> None:
    with pytest.raises(ModelFormatError) as err:
        ModelConfig.from_dict(_config(**changes))
    assert all(w in str(err.value) for w in words), str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# GPU: native kernels (head sizes 32/64 and, in gemma4_wide, the released 256/512), eager prefill and 8 decode steps
# then CUDA-graph decode, teacher-forced along the engine's CPU float32 run (which the tests above hold to
# transformers; the device's transformers 5.17 itself raises IndexError on Gemma 3n ids past the per-layer table):
# float32 at the CPU bound, float16 within 2e-2 (the bound the Gemma 3 GPU tests measured for (1 + w) norms in fp16;
# on the H200, 2026-12-03, Gemma 4's float16 steps reached 1.75e-2), the MoE fixture on its median and 80% of steps
# (a router's top-k may flip at an fp16 near-tie, as for the other MoE families).
# Gemma 3n's activation sparsity keeps the values above mean + k * std of each row: a value near that cutoff falls on
# either side of it under float16 rounding, so single positions jump. Transformers' own float16 run of the same
# sequence does the same (HF_FLOAT16_ERR, measured from its float32 run by test_transformers_float16_error_below),
# and so did the engine with torch's ops in place of the kernels on the H200 (5.4e-2 at the same prompt position as
# the kernels): its float16 steps are held to a median of 2e-2 and to twice transformers' largest float16 error.

GPU_RTOL = {"float32": 1e-4, "float16": 2e-2}
HF_FLOAT16_ERR = {"gemma3n": 5.86e-2, "gemma3n_mm": 5.54e-2}


def _teacher_forced_rows(lm: LoadedModel, built, steps: int) -> tuple:
    """The engine's float32 CPU run: prompt then `steps` greedy tokens, every position's logits [T, V]."""
    prompt = prompt_ids(built, 20, seed=10)
    cache = lm.model.new_cache()
    ref = lm.model.forward(prompt, cache, last_only=False)
    rows, seq = [ref[0]], [prompt]
    for _ in range(steps):
        token = ref[:, -1:].argmax(-1)
        seq.append(token)
        ref = lm.model.forward(token, cache)
        rows.append(ref[0])
    return torch.cat(seq, dim=1), torch.cat(rows, dim=0)


@pytest.mark.parametrize("name", sorted(HF_FLOAT16_ERR))
def test_transformers_float16_error_below(name: str, archs, ours) -> None:
    """The reference the Gemma 3n GPU bound rests on: transformers in float16 (CPU) on the GPU test's sequence, against
    the engine's float32 run (itself within 1e-4 of transformers' float32), is HF_FLOAT16_ERR within 10 %."""
    ids, want = _teacher_forced_rows(ours(name), archs.get(name), 40)
    with torch.no_grad():
        got = hf_load(archs.get(name).oracle_path).to(torch.float16)(ids).logits[0].float()
    err = max(row_rel_err(got[i], want[i]) for i in range(want.shape[0]))
    assert abs(err - HF_FLOAT16_ERR[name]) < 0.1 * HF_FLOAT16_ERR[name], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_matches_the_cpu_run(name: str, dtype: str, archs, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from kobold_backend.engine.decode_graph import GraphDecoder

    built = archs.get(name)
    lm = load_model(built.path, device="cuda", dtype=dtype, max_seq_len=MAX_SEQ)
    cpu = load_model(built.path, device="cpu", dtype="float32", max_seq_len=MAX_SEQ)
    prompt = prompt_ids(built, 20, seed=10)
    cache, cpu_cache = lm.model.new_cache(), cpu.model.new_cache()
    got = lm.model.forward(prompt.cuda(), cache, last_only=False)
    ref = cpu.model.forward(prompt, cpu_cache, last_only=False)
    errs = [row_rel_err(got.float().cpu(), ref)]
    graphs = GraphDecoder(lm.model, cache)
    for step in range(40):
        token = ref[:, -1:].argmax(-1)
        got = lm.model.forward(token.cuda(), cache)[0, -1] if step < 8 else graphs.step(int(token))
        ref = cpu.model.forward(token, cpu_cache)
        errs.append(row_rel_err(got.float().cpu(), ref[0, -1]))
    record_property("max_rel_err", max(errs))
    ordered = sorted(errs)
    median, tol = ordered[len(ordered) // 2], GPU_RTOL[dtype]
    if dtype == "float16" and "moe" in name:
        assert median < tol and ordered[int(0.8 * len(ordered)) - 1] < tol
    elif dtype == "float16" and name in HF_FLOAT16_ERR:
        bound = 2 * HF_FLOAT16_ERR[name]
        assert median < tol and max(errs) < bound, f"{name}: median {median:.3e}, max {max(errs):.3e}"
    else:
        assert max(errs) < tol, f"{name} {dtype}: max relative logit error {max(errs):.3e}"


# ---------------------------------------------------------------------------------------------------------------
# The chat shape (written for this test in the style of the released template; ai.google.dev's Gemma 4 prompt
# formatting): `<|turn>role ... <turn|>` blocks, role `model` for the assistant, past thoughts
# (`<|channel>thought ... <channel|>`) dropped from model turns, `<|turn>model` as the generation prompt.

GEMMA4_TEMPLATE = """{{ bos_token }}
{%- for m in messages -%}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
{%- if m['content'] is string -%}{%- set content = m['content'] -%}
{%- else -%}
{%- set content = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
{%- endif -%}
{%- if role == 'model' and '<channel|>' in content -%}{%- set content = content.split('<channel|>')[-1] -%}{%- endif -%}
<|turn>{{ role }}
{{ content | trim }}<turn|>
{% endfor -%}
{%- if add_generation_prompt -%}<|turn>model
{% endif -%}"""


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello there, who are you?"}],
    [{"role": "system", "content": "Be terse & \"kind\"."}, {"role": "user", "content": "  Tell me\nabout it.  "},
     {"role": "assistant", "content": "<|channel>thought\nhm<channel|>It is small. "},
     {"role": "user", "content": [{"type": "text", "text": "naïve café 漢字 😀"}]}],
], ids=["one", "turns"])
def test_chat_template_renders_as_transformers(messages, spm_dir, tmp_path) -> None:
    from kobold_backend.engine.chat_template import ChatFormatter
    from kobold_backend.engine.tokenizer import load_tokenizer
    from tests.test_openai_chat_template import hf_render, with_template

    folder = with_template(spm_dir, tmp_path / "gemma4-chat", GEMMA4_TEMPLATE)
    formatter = ChatFormatter(GEMMA4_TEMPLATE, load_tokenizer(folder), folder)
    text = formatter.render(messages)
    assert text == hf_render(folder, messages, tokenize=False) and text.endswith("<turn|>\n<|turn>model\n")
    assert "thought" not in text
    assert formatter.encode(text) == list(hf_render(folder, messages, tokenize=True))


@pytest.mark.parametrize("name", ["gemma4_e", "gemma3n"])
def test_embedding_on_another_device_than_the_layers(name: str, archs, ours) -> None:
    """Per-layer inputs and AltUp streams are made beside the embedding and cross to the layers and back: with the
    embedding (and them) in float64 the logits stay those of the plain load, to float32 rounding."""
    lm = ours(name)
    ids = prompt_ids(archs.get(name), 24, seed=9)
    base = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    model = load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ).model
    model.embed_tokens = model.embed_tokens.double()
    ple = model.per_layer_embedding
    ple.embed, ple.projection, ple.norm = ple.embed.double(), ple.projection.double(), ple.norm.double()
    if model.streams is not None:
        model.streams.projections = [w.double() for w in model.streams.projections]
        model.streams.unprojections = [w.double() for w in model.streams.unprojections]
        model.streams.dtype = torch.float64
    assert row_rel_err(model.forward(ids, model.new_cache(), last_only=False), base) < LOGITS_RTOL
