"""Mixtral, Qwen3-MoE, Gemma 2 and Gemma 3 (text) against transformers (CPU, float32), dense and GPTQ.

Fixtures are built by transformers' own config and model classes (tests/fixtures/moe_gemma_checkpoints.py); for
GPTQ transformers loads the packer's dequantized weights, so both sides hold the same numbers and must agree to
float32 rounding. The Gemma fixtures have a sliding window of 8, so every prompt here is longer than the window and
every decode runs past it. The routed-experts tests check that a token reads only the experts it was routed to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.moe import ExpertStack, RoutedExperts
from kobold_backend.engine.stored_format import stored_format
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, hf_step, prompt_ids, row_rel_err
from tests.fixtures.moe_gemma_checkpoints import SPECS, ArchFactory, BuiltArch

ALL = [s.name for s in SPECS]
MOE = [s.name for s in SPECS if s.family in ("mixtral", "qwen3_moe")]
GEMMA = [s.name for s in SPECS if s.family.startswith("gemma")]
LOGITS_RTOL = 1e-4
REUSE_RTOL = 1e-5
GREEDY_TOKENS = 32
MAX_SEQ = 96



@pytest.fixture(scope="module")
def archs(tmp_path_factory: pytest.TempPathFactory) -> ArchFactory:
    return ArchFactory(tmp_path_factory.mktemp("moe_gemma_fixtures"))


@pytest.fixture(scope="module")
def ours(archs: ArchFactory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(archs: ArchFactory) -> Callable[[str], torch.nn.Module]:
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
    """A 16-token prompt then 32 greedy tokens through each side's KV cache (Gemma: 6 windows of 8)."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 16, seed=2), GREEDY_TOKENS)
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    errs = [row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    loop = set(run.ref_tokens)
    assert len(loop) > 3, f"fixture {name} decodes a loop of {loop}; it would prove little"
    record_property("max_step_rel_err", max(errs))
    assert run.tokens == run.ref_tokens
    assert max(errs) < LOGITS_RTOL, f"{name}: decode-step logits differ by {max(errs):.3e}"


@pytest.mark.parametrize("name", ["mixtral_gptq", "qwen3_moe", "gemma2", "gemma3_gptq"])
def test_prefix_reuse_matches_fresh_prefill(name: str, archs, ours) -> None:
    built, lm = archs.get(name), ours(name)
    a, b, c = prompt_ids(built, 20, 3), prompt_ids(built, 12, 4)[:, 1:], prompt_ids(built, 9, 5)[:, 1:]
    fresh = lm.model.forward(torch.cat([a, b], 1), lm.model.new_cache(), last_only=False)[:, 20:]
    cache = lm.model.new_cache()
    lm.model.forward(torch.cat([a, c], 1), cache)
    cache.truncate(20)
    assert row_rel_err(lm.model.forward(b, cache, last_only=False), fresh) < REUSE_RTOL


@pytest.mark.parametrize("name", ["mixtral_gptq", "qwen3_moe", "gemma2_gptq", "gemma3"])
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


# ---------------------------------------------------------------------------------------------------------------
# Gemma: long prompts in chunks, decoding past the window; the fixtures exercise every Gemma feature.


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_gptq"])
def test_gemma_long_prompt_in_chunks_then_decode(name: str, archs, ours, hf) -> None:
    """A 30-token prompt (almost 4 windows) prefilled in uneven chunks, then 32 greedy tokens: ours == transformers."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 30, seed=11), 32, cuts=(3, 14))
    assert row_rel_err(run.last_chunk, run.ref_prompt[:, 14:]) < LOGITS_RTOL
    assert run.tokens == run.ref_tokens
    assert max(row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)) < LOGITS_RTOL


def _without(name: str, label: str, archs: ArchFactory, edit: Callable[[Dict[str, Any]], None]) -> torch.nn.Module:
    return hf_load(archs.variant(name, label, edit))


def _no_window(cfg: Dict[str, Any]) -> None:
    cfg["sliding_window"] = 4096  # longer than any prompt: full attention


def _gemma3_local_like_global(cfg: Dict[str, Any]) -> None:
    cfg["rope_parameters"]["sliding_attention"]["rope_theta"] = cfg["rope_parameters"]["full_attention"]["rope_theta"]


def _gemma3_unscaled(cfg: Dict[str, Any]) -> None:
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "default",
                                                "rope_theta": cfg["rope_parameters"]["full_attention"]["rope_theta"]}


@pytest.mark.parametrize("name, label, edit", [
    ("gemma2", "full", _no_window),
    ("gemma2", "no_attn_cap", lambda c: c.update(attn_logit_softcapping=None)),
    ("gemma2", "no_final_cap", lambda c: c.update(final_logit_softcapping=None)),
    ("gemma2", "scalar", lambda c: c.update(query_pre_attn_scalar=c["head_dim"])),
    ("gemma3", "full", _no_window),
    ("gemma3", "local_base", _gemma3_local_like_global),
    ("gemma3", "unscaled", _gemma3_unscaled),
    ("qwen3_moe", "no_norm_topk", lambda c: c.update(norm_topk_prob=False)),
])
def test_fixture_is_sensitive(name: str, label: str, edit, archs, hf) -> None:
    """Without the feature the oracle's logits move by more than 1%, so the tests above do test it."""
    ids = prompt_ids(archs.get(name), 40, seed=1)
    with torch.no_grad():
        changed = _without(name, label, archs, edit)(ids).logits
        assert row_rel_err(changed, hf(name)(ids).logits) > 1e-2


def test_gemma_features_are_read(ours) -> None:
    g2, g3 = ours("gemma2").model, ours("gemma3").model
    assert g2.windows == (8, None, 8, None)
    assert g3.windows == (8, 8, 8, 8, 8, None, 8)
    assert g2.scale == pytest.approx(24 ** -0.5) and g2.features.attn_softcap == 10.0
    assert g3.features.ropes[0].theta == 10000.0 and g3.features.ropes[0].scaling is None
    assert g3.features.ropes[5].theta == 1e6 and g3.features.ropes[5].scaling.factor == 8.0
    assert g3.cos[0] is g3.cos[4] and g3.cos[0] is not g3.cos[5]
    assert all(layer.q_norm is not None for layer in g3.layers)


@pytest.mark.parametrize("keep, window", [(0, 8), (5, None)], ids=["local", "global"])
def test_gemma3_context_shift_uses_each_layers_rope(keep: int, window, archs) -> None:
    """Context shifting re-rotates cached keys with the layer's own table (local base 1e4; global base 1e6 with
    linear scaling 8): on a one-layer model the shifted cache gives the logits of a fresh prefill of the kept
    tokens."""
    lm = load_model(archs.get("gemma3").path, device="cpu", dtype="float32", max_seq_len=MAX_SEQ)
    model = lm.model
    assert model.windows[keep] == window
    model.layers, model.cos, model.sin = [model.layers[keep]], [model.cos[keep]], [model.sin[keep]]
    model.windows, model.rope_factors = (window,), [model.rope_factors[keep]]
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :4], ids[:, 4:20], ids[:, 20:50], ids[:, 50:]
    cache = model.new_cache()
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 4, 16)
    shifted = model.forward(new, cache, last_only=False)
    fresh = model.forward(torch.cat([memory, kept, new], 1), model.new_cache(), last_only=False)[:, -10:]
    assert row_rel_err(shifted, fresh) < REUSE_RTOL


def test_gemma3_hub_config_spelling_is_read(archs, ours) -> None:
    """gemma3_gptq's config.json uses the Hub's keys (rope_local_base_freq, sliding_window_pattern); same features."""
    assert "rope_local_base_freq" in archs.get("gemma3_gptq").config
    a, b = ours("gemma3").model.features, ours("gemma3_gptq").model.features
    assert (a.windows, a.ropes, a.attn_scale) == (b.windows, b.ropes, b.attn_scale)


# ---------------------------------------------------------------------------------------------------------------
# Routed experts.


def _routed(lm: LoadedModel) -> List[RoutedExperts]:
    return [layer.mlp for layer in lm.model.layers if layer.mlp is not None]


def test_moe_layers_and_stacks(ours) -> None:
    mixtral, mixtral_q, qwen = ours("mixtral"), ours("mixtral_gptq"), ours("qwen3_moe")
    assert len(_routed(mixtral)) == 2 and len(_routed(qwen)) == 2
    assert qwen.model.layers[1].mlp is None and qwen.model.layers[1].gate_up_proj is not None  # mlp_only_layers
    block = _routed(qwen)[0]
    assert (block.num_experts, block.top_k, block.renormalize) == (8, 3, True)
    assert block.up is None and block.gate_up.out_features == 64  # gate and up fused per expert
    q = _routed(mixtral_q)[0]
    # act-order gives gate (w1) and up (w3) different permutations: they stay two stacks
    assert q.up is not None and q.gate_up.qweight is not None and q.gate_up.perm is not None
    assert q.gate_up.qweight.shape == (4, 64 // 8, 96) and q.down.qweight.shape == (4, 96 // 8, 64)
    assert mixtral.model.nbytes > 0 and mixtral_q.model.nbytes < mixtral.model.nbytes


def _poison_unchosen(block: RoutedExperts, chosen: List[int]) -> RoutedExperts:
    """A copy of the block whose experts outside `chosen` hold NaN (dense) or NaN scales (GPTQ)."""
    def poison(stack: ExpertStack) -> ExpertStack:
        out = ExpertStack(stack.in_features, stack.out_features, *(None if t is None else t.clone() for t in (
            stack.weight, stack.qweight, stack.scales, stack.zeros, stack.perm)), stack.group_size)
        for e in range(stack.num_experts):
            if e not in chosen:
                (out.weight if out.weight is not None else out.scales)[e].fill_(float("nan"))  # type: ignore[index]
        return out
    return RoutedExperts(block.router, poison(block.gate_up), None if block.up is None else poison(block.up),
                         poison(block.down), block.top_k, block.renormalize, block.act)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("path", ["grouped", "gathered"])
def test_one_token_reads_only_its_experts(name: str, path: str, ours) -> None:
    """With every expert the token was not routed to poisoned with NaN, its output is unchanged: the step never
    touches their weights. Both paths (grouped: prefill and CPU; gathered: CUDA decode, graph-capturable)."""
    block = _routed(ours(name))[0]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    weights, experts = block.route(x)
    chosen = experts[0].tolist()
    assert len(chosen) == block.top_k < block.num_experts
    run = getattr(block, f"_{path}")
    clean = run(x, weights, experts)
    poisoned = getattr(_poison_unchosen(block, chosen), f"_{path}")(x, weights, experts)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.parametrize("name", MOE)
def test_gathered_path_equals_grouped_path(name: str, ours) -> None:
    for block in _routed(ours(name)):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
        weights, experts = block.route(x)
        assert row_rel_err(block._gathered(x, weights, experts), block._grouped(x, weights, experts)) < 1e-6


def test_mixtral_routing_weights_renormalised(ours) -> None:
    block = _routed(ours("mixtral"))[0]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    weights, experts = block.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x, block.router), dim=-1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(experts, top.indices)
    assert torch.allclose(weights, top.values / top.values.sum(-1, keepdim=True), atol=1e-6)


def test_expert_stack_refuses_mixed_experts() -> None:
    dense = torch.zeros(8, 16)
    gptq = GPTQWeight(torch.zeros(2, 8, dtype=torch.int32), torch.ones(1, 8), torch.zeros(1, 8), None, 16, 16, 8)
    with pytest.raises(ValueError, match="dense and of one shape"):
        ExpertStack.stack([dense, gptq])
    with pytest.raises(ValueError, match="share shapes"):
        ExpertStack.stack([gptq, dense])


def test_moe_config_errors(archs, tmp_path: Path) -> None:
    import shutil

    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.errors import ModelFormatError

    src = archs.get("mixtral").path
    for change, message in [({"num_experts_per_tok": 9}, "exceeds the 4 experts"),
                            ({"num_local_experts": 0}, "num_local_experts must be a positive integer"),
                            ({"num_local_experts": None}, "lacks 'num_local_experts'")]:
        dst = tmp_path / message.split()[0]
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(change)
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelFormatError, match=message):
            ModelConfig.from_dir(dst)


# ---------------------------------------------------------------------------------------------------------------
# Every host runs these families with no code of its own: United's folder check and load dialog, the split
# planner (which must count every expert), the server's model report, the generator.


@pytest.mark.parametrize("name", ALL)
def test_united_accepts_the_folder_and_the_planner_counts_it(name: str, archs, ours) -> None:
    """The layout names exactly the tensors transformers saved (routers, every expert, Gemma's four norms, q/k
    norms), so a split plan made without reading weights counts what the loader holds, byte for byte."""
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
        held = list(layer.tensors())
        assert sizes.layer(i, 4) == sum(w.nbytes if isinstance(w, GPTQWeight) else w.numel() * w.element_size()
                                        for w in held)


@pytest.mark.parametrize("name, architecture", [("mixtral", "MixtralForCausalLM"),
                                                ("gemma3", "Gemma3ForCausalLM")])
def test_server_names_the_architecture(name: str, architecture: str, archs) -> None:
    from tests.server_helpers import make_app

    app = make_app(archs.get(name).path)
    stored = stored_format(archs.get(name).path).name  # what doctor says; the fixtures are float16 or bfloat16
    assert stored in ("float16", "bfloat16")
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json() == {"result": f"kobold_backend/{name}", "architecture": architecture,
                                                     "format": stored, "bits_per_weight": 16.0}
    finally:
        app.extensions["kobold_backend"].close()


@pytest.mark.parametrize("name", ["qwen3_moe_gptq", "gemma2"])
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
# GPU, along transformers' greedy path (teacher-forced), eager and CUDA-graph decode.
# float16 with the native kernels. Bound: 5e-3 relative logit error at every step, as the other architectures' GPU
# tests. A router's top-k is a discrete choice: where two experts' router logits are closer than fp16 rounding (the
# fixtures' fp32 paths have gaps down to 1e-3), fp16 may pick the other expert for that token, a legitimate
# difference of a few percent. For the MoE fixtures the bound therefore holds for the median and for 80% of the
# steps. Gemma 3's seven layers of fp16 norms give up to 1.3e-2 (bound 2e-2). Every fixture also runs the same
# paths in float32 on CUDA (torch ops, routing gathered on the device, graphs), where every step must be within
# the CPU bound: that is what proves the GPU logic, the fp16 bounds only measure rounding.

GPU_RTOL = 5e-3
GEMMA3_FP16_RTOL = 2e-2
GPU_FP32_RTOL = 1e-4


def _gpu_errors(built: BuiltArch, ref_model: torch.nn.Module, dtype: str, graphs: bool) -> List[float]:
    from kobold_backend.engine.decode_graph import GraphDecoder

    lm = load_model(built.path, device="cuda", dtype=dtype, max_seq_len=MAX_SEQ)
    prompt = prompt_ids(built, 20 if graphs else 24, seed=14 if graphs else 10)
    cache = lm.model.new_cache()
    got = lm.model.forward(prompt.cuda(), cache, last_only=not graphs)
    ref, past = hf_step(ref_model, prompt, None)
    errs = [] if graphs else [row_rel_err(got.cpu(), ref[:, -1:])]  # the prompt's last position
    decoder = GraphDecoder(lm.model, cache) if graphs else None
    for _ in range(40 if graphs else 24):
        token = ref[:, -1:].argmax(-1)
        step = decoder.step(int(token)) if decoder is not None else lm.model.forward(token.cuda(), cache)[0, -1]
        ref, past = hf_step(ref_model, token, past)
        errs.append(row_rel_err(step.float().cpu(), ref[0, -1]))
    lm.unload()
    return errs


def _within_fp16_bound(name: str, errs: List[float]) -> bool:
    if name.startswith("gemma3"):
        # 7 layers, each with q/k and four (1 + w) norms rounded to fp16: measured 4e-3 to 1.3e-2 on the H200
        # (2026-12-02) while the same steps in float32 on CUDA stay within 1e-4 (test below), so this is rounding.
        return max(errs) < GEMMA3_FP16_RTOL
    if name not in MOE:
        return max(errs) < GPU_RTOL
    ordered = sorted(errs)
    return ordered[len(ordered) // 2] < GPU_RTOL and ordered[int(0.8 * len(ordered)) - 1] < GPU_RTOL


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp16_matches_transformers(name: str, graphs: bool, archs, hf, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    errs = _gpu_errors(archs.get(name), hf(name), "float16", graphs)
    record_property("step_rel_errs", errs)
    assert _within_fp16_bound(name, errs), f"{name}: relative logit errors {sorted(errs)[-5:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp32_matches_transformers_at_every_step(name: str, graphs: bool, archs, hf) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    errs = _gpu_errors(archs.get(name), hf(name), "float32", graphs)
    assert max(errs) < GPU_FP32_RTOL, f"{name}: max relative logit error {max(errs):.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixtral_gptq", "qwen3_moe", "gemma2_gptq", "gemma3"])
def test_gpu_layer_split_matches_transformers(name: str, archs, hf) -> None:
    """The first half of the layers on the GPU (fp16), the rest on the CPU (fp32), prompt then 8 teacher-forced
    steps: routed experts and Gemma's tables cross devices with no per-architecture code. Bound as above."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    built = archs.get(name)
    n = json.loads((built.path / "config.json").read_text())["num_hidden_layers"]
    devices = ["cuda"] * (n // 2) + ["cpu"] * (n - n // 2)
    lm = load_model(built.path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ, layer_devices=devices)
    prompt = prompt_ids(built, 30, seed=16)
    cache = lm.model.new_cache()
    errs = [row_rel_err(lm.model.forward(prompt.cuda(), cache, last_only=False).cpu(), hf(name)(prompt).logits)]
    ref, past = hf_step(hf(name), prompt, None)
    for _ in range(8):
        token = ref[:, -1:].argmax(-1)
        got = lm.model.forward(token.cuda(), cache)[0, -1]
        ref, past = hf_step(hf(name), token, past)
        errs.append(row_rel_err(got.cpu(), ref[0, -1]))
    assert _within_fp16_bound(name, errs), f"{name}: relative logit errors {sorted(errs)[-3:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE)
def test_gpu_one_token_reads_only_its_experts(name: str, archs) -> None:
    """On CUDA a decode row takes the gathered path; with the unchosen experts poisoned its output is unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    lm = load_model(archs.get(name).path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ)
    block = _routed(lm)[0]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).half().cuda()
    chosen = block.route(x)[1][0].tolist()
    clean = block(x)
    poisoned = _poison_unchosen(block, chosen)(x)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)
