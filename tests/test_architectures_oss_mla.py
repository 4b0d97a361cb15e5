"""gpt-oss (dense and MXFP4 experts), DeepSeek-V2 and DeepSeek-V3 against transformers (CPU, float32).

Fixtures are built by transformers' own config and model classes (tests/fixtures/oss_mla_checkpoints.py). gpt-oss
has 4 layers alternating a window of 8 and full attention, attention sinks, YaRN, 4 experts with biases; the MXFP4
variant's oracle holds transformers' own dequantization of the blocks. DeepSeek-V2 is V2-Lite-shaped (q without
LoRA, softmax routing), V3 has q LoRA, sigmoid routing with correction bias over 4 groups and a routed scale; both
have YaRN with mscale, a dense first layer and shared experts, and run from the compressed latent cache.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List

import pytest
import torch

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.mla import LatentAttention
from kobold_backend.engine.mxfp4 import dequantize_mxfp4
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, prompt_ids, row_rel_err
from tests.fixtures.oss_mla_checkpoints import SPECS, Factory, pack_mxfp4

ALL = [s.name for s in SPECS]
DEEPSEEK = ["deepseek_v2", "deepseek_v3"]
LOGITS_RTOL = 1e-4
LOGITS_ATOL = 1e-4  # logits here reach |17|; measured 1.1e-5 to 1.7e-5 (2026-12-03)
REUSE_RTOL = 1e-5
GREEDY_TOKENS = 32
MAX_SEQ = 96


@pytest.fixture(scope="module")
def archs(tmp_path_factory: pytest.TempPathFactory) -> Factory:
    return Factory(tmp_path_factory.mktemp("oss_mla_fixtures"))


@pytest.fixture(scope="module")
def ours(archs: Factory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(archs: Factory) -> Callable[[str], torch.nn.Module]:
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
    record_property("max_abs_err", float((logits - ref).abs().max()))
    assert err < LOGITS_RTOL, f"{name}: max relative logit error {err:.3e}"
    assert float((logits - ref).abs().max()) < LOGITS_ATOL


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_transformers(name: str, archs, ours, hf, record_property) -> None:
    """A 16-token prompt prefilled in two chunks, then 32 greedy tokens through each side's cache (gpt-oss: 6
    windows of 8)."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 16, seed=2), GREEDY_TOKENS, cuts=(5,))
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    errs = [row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    assert len(set(run.ref_tokens)) > 3, f"fixture {name} decodes a loop; it would prove little"
    record_property("max_step_rel_err", max(errs))
    assert run.tokens == run.ref_tokens
    assert max(errs) < LOGITS_RTOL, f"{name}: decode-step logits differ by {max(errs):.3e}"
    assert row_rel_err(run.last_chunk, run.ref_prompt[:, 5:]) < LOGITS_RTOL


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v2", "deepseek_v3"])
def test_prefix_reuse_and_rewind_match_fresh_prefill(name: str, archs, ours) -> None:
    built, lm = archs.get(name), ours(name)
    a, b, c = prompt_ids(built, 20, 3), prompt_ids(built, 12, 4)[:, 1:], prompt_ids(built, 9, 5)[:, 1:]
    fresh = lm.model.forward(torch.cat([a, b], 1), lm.model.new_cache(), last_only=False)[:, 20:]
    cache = lm.model.new_cache()
    lm.model.forward(torch.cat([a, c], 1), cache)
    cache.rewind(8)
    assert row_rel_err(lm.model.forward(b, cache, last_only=False), fresh) < REUSE_RTOL


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "deepseek_v2", "deepseek_v3"])
def test_graph_step_matches_forward(name: str, archs, ours) -> None:
    """decode_step (what a CUDA graph captures: device position, bucketed length) equals forward."""
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


@pytest.mark.parametrize("name, keep", [("gpt_oss", 1), ("deepseek_v2", 1), ("deepseek_v3", 2)])
def test_context_shift_rerotates_the_rope_part(name: str, keep: int, archs) -> None:
    """On a one-layer model the shifted cache gives the logits of a fresh prefill of the kept tokens: gpt-oss's
    YaRN keys (attention factor 1.14 left out of the re-rotation), DeepSeek's latent cache where only the last
    qk_rope_head_dim values of each entry are rotated."""
    lm = load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ)
    model = lm.model
    assert model.windows[keep] is None
    model.layers, model.cos, model.sin = [model.layers[keep]], [model.cos[keep]], [model.sin[keep]]
    model.windows, model.rope_factors = (None,), [model.rope_factors[keep]]
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :4], ids[:, 4:20], ids[:, 20:50], ids[:, 50:]
    cache = model.new_cache()
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 4, 16)
    shifted = model.forward(new, cache, last_only=False)
    fresh = model.forward(torch.cat([memory, kept, new], 1), model.new_cache(), last_only=False)[:, -10:]
    assert row_rel_err(shifted, fresh) < REUSE_RTOL


def test_deepseek_cache_is_the_compressed_latent(ours) -> None:
    """One cached vector of kv_lora_rank + qk_rope_head_dim per token and layer, no values: 40 values here against
    the 4 heads x (24 + 24) = 192 an expanded K/V cache would hold."""
    for name in DEEPSEEK:
        model = ours(name).model
        cache = model.new_cache()
        assert tuple(cache.k[0].shape) == (1, 1, MAX_SEQ, 40) and cache.v[0].shape[-1] == 0
        assert all(isinstance(layer.attn, LatentAttention) for layer in model.layers)
    assert ours("deepseek_v3").model.layers[0].attn.q_a_proj is not None
    assert ours("deepseek_v2").model.layers[0].attn.q_proj is not None


@pytest.mark.parametrize("cache_dtype", ["q8", "k8v4"])
def test_deepseek_refuses_a_quantized_cache(cache_dtype: str, archs) -> None:
    with pytest.raises(ValueError, match="latent attention cache"):
        load_model(archs.get("deepseek_v2").path, device="cpu", max_seq_len=MAX_SEQ, cache_dtype=cache_dtype)


def test_gpt_oss_runs_from_a_quantized_cache(archs, ours) -> None:
    """Sinks and windows through the 8-bit cache's dequantizing path: close to the float cache (8-bit rounding)."""
    built = archs.get("gpt_oss")
    q8 = load_model(built.path, device="cpu", max_seq_len=MAX_SEQ, cache_dtype="q8")
    ids = prompt_ids(built, 24, seed=6)
    ref_model = ours("gpt_oss").model
    ref = ref_model.forward(ids, ref_model.new_cache(), last_only=False)
    cache = q8.model.new_cache()
    got = q8.model.forward(ids[:, :20], cache, last_only=False)
    for i in range(20, 24):
        got = torch.cat([got, q8.model.forward(ids[:, i : i + 1], cache, last_only=False)], 1)
    assert row_rel_err(got, ref) < 2e-2


def _variant_logits(archs: Factory, name: str, label: str, edit: Callable[[Dict[str, Any]], None]) -> torch.Tensor:
    ids = prompt_ids(archs.get(name), 40, seed=1)
    with torch.no_grad():
        return hf_load(archs.variant(name, label, edit))(ids).logits


@pytest.mark.parametrize("name, label, edit", [
    ("gpt_oss", "full", lambda c: c.update(sliding_window=4096)),
    ("gpt_oss", "plain_rope", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
    ("gpt_oss", "no_clamp", lambda c: c.update(swiglu_limit=1000.0)),
    ("deepseek_v2", "no_mscale", lambda c: c["rope_parameters"].update(mscale_all_dim=0)),
    ("deepseek_v3", "ungrouped", lambda c: c.update(topk_group=4)),
    ("deepseek_v3", "unscaled", lambda c: c.update(routed_scaling_factor=1.0)),
])
def test_fixture_exercises_the_feature(name: str, label: str, edit, archs, hf) -> None:
    """transformers itself without the feature differs from the fixture by far more than the tolerance."""
    ids = prompt_ids(archs.get(name), 40, seed=1)
    with torch.no_grad():
        ref = hf(name)(ids).logits
    assert row_rel_err(_variant_logits(archs, name, label, edit), ref) > 100 * LOGITS_RTOL


def test_mxfp4_dequantization_matches_transformers() -> None:
    """Random blocks and scales through ours and transformers' own MXFP4 conversion (which returns [E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))


def test_mxfp4_packer_round_trips_within_fp4_rounding() -> None:
    """Every value within half the widest E2M1 step (2, between 4 and 6) times its block's scale, which is below
    a third of the block's largest magnitude."""
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4))
    back = dequantize_mxfp4(*pack_mxfp4(w))
    assert ((back - w).abs() <= w.abs().reshape(2, 8, 2, 32).amax(-1).repeat_interleave(32, -1) / 3).all()
    assert (back - w).abs().mean() < 0.1


def test_gpt_oss_mxfp4_checkpoint_is_read_as_stored(archs, ours) -> None:
    built = archs.get("gpt_oss_mxfp4")
    assert built.config["quantization_config"]["quant_method"] == "mxfp4"
    names = json.loads((built.path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (built.path / "model.safetensors").read_bytes()[:8], "little")].decode())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    layer = ours("gpt_oss_mxfp4").model.layers[0]
    assert layer.sinks is not None and layer.mlp.router_bias is not None


# ---------------------------------------------------------------------------------------------------------------
# GPU (the lead's device run): float16 with the native kernels, along the CPU float32 run's greedy path (the CPU
# run matches transformers above), eager and graphs.
# Bound as the other MoE fixtures: a router's top-k may flip where two experts are closer than fp16 rounding, so
# the median and 80% of the steps are within 5e-3; float32 on CUDA must be within 1e-4 at every step.

GPU_RTOL = 5e-3
GPU_FP32_RTOL = 1e-4


def _engine_reference(built: Any) -> Any:
    """hf_step's contract over this engine's own CPU float32 run, which the CPU tests above hold to transformers:
    the GPU tests then do not depend on the device's transformers release (5.17's gpt-oss ignores the config's
    swiglu_alpha / swiglu_limit, which the fixture sets, and hard-codes 1.702 / 7.0)."""
    lm = load_model(built.path, device="cpu", dtype="float32", max_seq_len=MAX_SEQ)
    cache = lm.model.new_cache()

    def step(ids: torch.Tensor) -> torch.Tensor:
        return lm.model.forward(ids, cache, last_only=False)

    return step


def _gpu_errors(built: Any, dtype: str, graphs: bool) -> List[float]:
    from kobold_backend.engine.decode_graph import GraphDecoder

    lm = load_model(built.path, device="cuda", dtype=dtype, max_seq_len=MAX_SEQ)
    reference = _engine_reference(built)
    prompt = prompt_ids(built, 20, seed=14)
    cache = lm.model.new_cache()
    got = lm.model.forward(prompt.cuda(), cache, last_only=True)
    ref = reference(prompt)
    errs = [row_rel_err(got.float().cpu(), ref[:, -1:])]
    decoder = GraphDecoder(lm.model, cache) if graphs else None
    for _ in range(32):
        token = ref[:, -1:].argmax(-1)
        step = decoder.step(int(token)) if decoder is not None else lm.model.forward(token.cuda(), cache)[0, -1]
        ref = reference(token)
        errs.append(row_rel_err(step.float().cpu(), ref[0, -1]))
    lm.unload()
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp16_matches_the_cpu_run(name: str, graphs: bool, archs, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    errs = _gpu_errors(archs.get(name), "float16", graphs)
    record_property("step_rel_errs", errs)
    ordered = sorted(errs)
    assert ordered[len(ordered) // 2] < GPU_RTOL and ordered[int(0.8 * len(ordered)) - 1] < GPU_RTOL, ordered[-5:]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp32_matches_the_cpu_run_at_every_step(name: str, graphs: bool, archs) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    errs = _gpu_errors(archs.get(name), "float32", graphs)
    assert max(errs) < GPU_FP32_RTOL, f"{name}: max relative logit error {max(errs):.3e}"


@pytest.mark.parametrize("name", ALL)
def test_the_planner_counts_what_the_loader_holds(name: str, archs, ours) -> None:
    """A split plan made from the headers counts every tensor the loader holds, byte for byte (gpt-oss's stacked
    experts, MXFP4 blocks as the dense weights they become, sinks, DeepSeek's latent attention), and the latent
    cache as it is allocated."""
    from kobold_backend.engine.device_map import Sizes, checkpoint_shapes, plan_device_map

    built, lm = archs.get(name), ours(name)
    dm = plan_device_map(built.path, None, MAX_SEQ, layer_counts={"cpu": lm.config.num_layers})
    (usage,) = dm.usage
    assert usage.weight_bytes == lm.model.nbytes
    assert usage.cache_bytes == lm.model.new_cache().nbytes
    shapes = checkpoint_shapes(built.path)
    sizes = Sizes(lm.config, shapes, MAX_SEQ)
    for i, layer in enumerate(lm.model.layers):
        assert sizes.layer(i, 4) == sum(w.numel() * w.element_size() for w in layer.tensors())
        # the layout's other tensors (gpt-oss's sinks, DeepSeek-V3's router bias) are the checkpoint's, as the
        # planner's config_shapes lists them
        layout = lm.config.description.layout(lm.config, i)
        listed = {f"model.layers.{i}.{name}": shape for name, shape in layout.extras.values()}
        listed.update({f"model.layers.{i}.{name}": shape for name, shape in layout.tensors.items()})
        assert {k: shapes.get(k) for k in listed} == listed
        assert bool(listed) == (name != "deepseek_v2" and (name == "gpt_oss" or layer.mlp is not None))


# ---------------------------------------------------------------------------------------------------------------
# Chat template. The published gpt-oss ("harmony") template is not available offline; this one, written for the
# test, uses the constructs it is built from (recursive macros, namespace objects assigned in loops, look-ahead
# slices of the messages, strftime_now, raise_exception, tojson of tool arguments, `is not defined` defaults,
# whitespace control) and must render exactly as transformers' own renderer does.

HARMONY_LIKE = """
{%- macro type_of(spec) -%}
    {%- if spec.type == "array" -%}{{- type_of(spec['items']) + "[]" -}}
    {%- elif spec.type == "integer" -%}{{- "number" -}}
    {%- else -%}{{- spec.type -}}{%- endif -%}
{%- endmacro -%}
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "<|start|>system<|message|>Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") }}
{{- "\\n\\nReasoning: " + reasoning_effort }}
{{- "\\ndays: " + type_of({"type": "array", "items": {"type": "integer"}}) }}
{{- "<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
    {%- set loop_messages = messages[1:] %}
    {{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "<|end|>" }}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == "assistant" -%}
        {%- if "<|channel|>" in message.content | default("") %}
            {{- raise_exception("pass analysis text in 'thinking', not channel tags in 'content'") }}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set later = namespace(final=false) %}
            {%- for future in loop_messages[loop.index:] %}
                {%- if future.role == "assistant" and "tool_calls" not in future %}
                    {%- set later.final = true %}
                {%- endif %}
            {%- endfor %}
            {%- set call = message.tool_calls[0].function %}
            {%- if message.thinking and not later.final %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments | tojson + "<|call|>" }}
            {%- set last_call.name = call.name %}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" -%}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content | tojson + "<|end|>" }}
    {%- else -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""

CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "call the tool", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Thanks"}]


def test_harmony_style_template_renders_as_transformers() -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from kobold_backend.engine.chat_template import compile_template

    kwargs = dict(messages=CHAT, add_generation_prompt=True, bos_token="", eos_token="", tools=None,
                  documents=None)
    ours = compile_template(HARMONY_LIKE).render(**kwargs)
    assert ours == _compile_jinja_template(HARMONY_LIKE).render(**kwargs)
    assert "<|start|>functions.get_weather to=assistant" in ours and ours.endswith("<|start|>assistant")
    assert "days: number[]<|end|>" in ours and '"days": [1, 2]' in ours
    assert "<|channel|>analysis" not in ours  # a final answer follows the call: its analysis is dropped


def test_deepseek_reorders_and_dequantizes_gptq_projections() -> None:
    """The rotary-row permutation and kv_b_proj's dequantization on a GPTQ layer (random codes, act-order
    permutation), checked through the layer's own matmul."""
    from kobold_backend.engine.architectures.deepseek import _dense, _permute_rows
    from kobold_backend.engine.model import project
    from kobold_backend.ops.gptq_weight import GPTQWeight

    g = torch.Generator().manual_seed(7)
    k, n, group = 64, 40, 32
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    w = GPTQWeight(qweight, torch.rand(k // group, n, generator=g) / 8, zeros, torch.randperm(k, generator=g), group,
                   k, n)
    x = torch.randn(3, k, generator=g)
    order = torch.randperm(n, generator=g)
    assert torch.allclose(project(x, _permute_rows(w, order, "t")), project(x, w)[:, order], atol=1e-5)
    assert torch.allclose(x @ _dense(w).t(), project(x, w), atol=1e-5)


@pytest.mark.parametrize("family, scoring, settings", [
    ("deepseek_v2", "softmax", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    routed_scaling_factor=1.5)),
    ("deepseek_v3", "sigmoid", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
])
def test_routing_matches_transformers_router(family: str, scoring: str, settings: Dict[str, Any]) -> None:
    """Our routing against transformers' own router module on 64 random rows: the same experts with the same
    weights (V2's group-limited greedy, which no fixture uses, included)."""
    import transformers

    from kobold_backend.engine.moe import RoutedExperts, Routing

    cls = "DeepseekV2" if family == "deepseek_v2" else "DeepseekV3"
    config = getattr(transformers, f"{cls}Config")(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                   **settings)
    module = getattr(transformers.models, family)
    router = getattr(getattr(module, f"modeling_{family}"), f"{cls}TopkRouter")(config)
    g = torch.Generator().manual_seed(9)
    router.weight.data = torch.randn(16, 32, generator=g)
    bias = None
    if hasattr(router, "e_score_correction_bias"):
        bias = torch.randn(16, generator=g) * 0.3
        router.e_score_correction_bias.data = bias
    x = torch.randn(64, 32, generator=g)
    _, ref_w, ref_e = router(x)
    ours = RoutedExperts(router.weight.data, None, None, None, 3, scoring == "sigmoid",  # type: ignore[arg-type]
                         lambda a, b: a, Routing(scoring, settings["routed_scaling_factor"], 4, 2),
                         correction_bias=bias)
    w, e = ours.route(x)
    order, ref_order = e.argsort(-1), ref_e.argsort(-1)
    assert torch.equal(e.gather(1, order), ref_e.gather(1, ref_order))
    assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)


def test_deepseek_v3_checkpoint_with_its_mtp_layer_loads(archs, ours, tmp_path) -> None:
    """A DeepSeek-V3 checkpoint stores its multi-token-prediction layer after the decoder's
    (`num_nextn_predict_layers` 1): accepted and not read; the logits are those of the checkpoint without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    built = archs.get("deepseek_v3")
    folder = tmp_path / "with_mtp"
    shutil.copytree(built.path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    n = built.config["num_hidden_layers"]
    tensors.update({k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone() for k, v in tensors.items()
                    if k.startswith(f"model.layers.{n - 1}.")})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    lm = load_model(folder, device="cpu", max_seq_len=MAX_SEQ)
    ids = prompt_ids(built, 12, seed=8)
    ref = ours("deepseek_v3").model
    assert len(lm.model.layers) == n
    assert torch.equal(lm.model.forward(ids, lm.model.new_cache()), ref.forward(ids, ref.new_cache()))


def test_gpt_oss_released_config_spelling_is_read(archs) -> None:
    """The released config.json: `rope_scaling` and `rope_theta` (transformers 4 keys), `experts_per_token`."""
    from kobold_backend.engine.config import ModelConfig

    cfg = dict(archs.get("gpt_oss").config)
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["experts_per_token"] = cfg.pop("num_experts_per_tok")
    config = ModelConfig.from_dict(cfg)
    ours = ModelConfig.from_dict(archs.get("gpt_oss").config)
    assert config.features.ropes == ours.features.ropes and config.features.windows == ours.features.windows
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v2", "deepseek_v3"])
def test_multi_row_decode_step_equals_the_prompt_forward(name: str, archs) -> None:
    """Five rows fed at a device position in one decode_step (a speculative verification, a chat turn in a graph):
    attention sinks and sliding windows, and the latent cache, give the prompt forward's logits."""
    lm = load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ)
    model = lm.model
    ids = torch.randint(3, 900, (1, 45), generator=torch.Generator().manual_seed(5))
    eager, rows = model.new_cache(), model.new_cache()
    for cache in (eager, rows):
        model.forward(ids[:, :40], cache)
    want = model.forward(ids[:, 40:], eager, last_only=False)
    got = model.decode_step(ids[:, 40:], torch.tensor([40]), rows, MAX_SEQ)
    assert row_rel_err(got, want) < REUSE_RTOL
