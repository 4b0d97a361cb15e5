"""Command-R, Command-R7B (Cohere 2), GLM-4, GLM-4.5, Mistral 3 (text) and Mistral-Nemo against transformers (CPU,
float32), dense and GPTQ.

Fixtures are built by transformers' own config and model classes (tests/fixtures/arch2026_checkpoints.py); for GPTQ
transformers loads the packer's dequantized weights, so both sides hold the same numbers and must agree to float32
rounding. Each family's own feature is shown to matter by `test_fixture_is_sensitive` (the oracle moves when it is
switched off), so the agreement tests do test it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch
import transformers

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.moe import RoutedExperts, Routing
from kobold_backend.engine.stored_format import stored_format
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.arch2026_checkpoints import SPECS, Factory
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, prompt_ids, row_rel_err

ALL = [s.name for s in SPECS]
LOGITS_RTOL = 1e-4
GREEDY_TOKENS = 32
MAX_SEQ = 96


def oracle_load(folder: Path) -> torch.nn.Module:
    """transformers in float32 on the CPU; Mistral 3 through its multimodal class (text-only inputs)."""
    cfg = json.loads((folder / "config.json").read_text())
    if cfg["model_type"] != "mistral3":
        return hf_load(folder)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def archs(tmp_path_factory: pytest.TempPathFactory) -> Factory:
    return Factory(tmp_path_factory.mktemp("arch2026"))


@pytest.fixture(scope="module")
def ours(archs: Factory) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(archs.get(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(archs: Factory) -> Callable[[str], torch.nn.Module]:
    return by_name(lambda name: oracle_load(archs.get(name).oracle_path))


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(name: str, archs, ours, hf, record_property) -> None:
    ids = prompt_ids(archs.get(name), 40, seed=1)
    lm = ours(name)
    logits = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        ref = hf(name)(ids).logits
    err = row_rel_err(logits, ref)
    record_property("max_rel_err", err)
    record_property("max_abs_err", float((logits - ref).abs().max()))
    assert err < LOGITS_RTOL, f"{name}: max relative logit error {err:.3e}"


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_transformers(name: str, archs, ours, hf, record_property) -> None:
    """A 16-token prompt then 32 greedy tokens through each side's KV cache (Cohere 2: past its window of 8)."""
    run = greedy_both(ours(name), hf(name), prompt_ids(archs.get(name), 16, seed=2), GREEDY_TOKENS, cuts=(5,))
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    assert len(set(run.ref_tokens)) > 3, f"fixture {name} decodes a loop; it would prove little"
    errs = [row_rel_err(a, b) for a, b in zip(run.logits, run.ref_logits)]
    record_property("max_step_rel_err", max(errs))
    assert run.tokens == run.ref_tokens
    assert max(errs) < LOGITS_RTOL, f"{name}: decode-step logits differ by {max(errs):.3e}"


@pytest.mark.parametrize("name", ["cohere2", "glm4_moe", "glm4"])
def test_graph_step_matches_forward(name: str, archs, ours) -> None:
    """decode_step (what a CUDA graph captures: device position, bucketed length) equals forward."""
    lm = ours(name)
    prompt = prompt_ids(archs.get(name), 12, seed=12)
    eager, graphy = lm.model.new_cache(), lm.model.new_cache()
    lm.model.forward(prompt, eager)
    lm.model.forward(prompt, graphy)
    token = torch.tensor([[7]])
    for step in range(12):
        pos = graphy.reserve(1)
        ref = lm.model.forward(token, eager)[0, -1]
        got = lm.model.decode_step(token, torch.tensor([pos]), graphy, 64)[0, -1]
        graphy.seq_len = pos + 1
        assert row_rel_err(got, ref) < 1e-5, step
        token = ref.argmax().view(1, 1)


@pytest.mark.parametrize("name", ["cohere2", "glm4_moe", "glm4"])
def test_multi_row_decode_step_equals_the_prompt_forward(name: str, archs, ours) -> None:
    """Five rows fed at a device position in one decode_step (a speculative verification, a chat turn in a graph):
    Cohere 2's windows and global layers without RoPE, and GLM's partial (split or interleaved) rotary embedding
    with its per-head q/k order, give the prompt forward's logits."""
    model = ours(name).model
    ids = prompt_ids(archs.get(name), 45, seed=5)
    eager, rows = model.new_cache(), model.new_cache()
    for cache in (eager, rows):
        model.forward(ids[:, :40], cache)
    want = model.forward(ids[:, 40:], eager, last_only=False)
    got = model.decode_step(ids[:, 40:], torch.tensor([40]), rows, MAX_SEQ)
    assert got.shape == want.shape == (1, 5, model.config.vocab_size)
    assert row_rel_err(got, want) < 1e-5


@pytest.mark.parametrize("name", ["cohere", "glm4"])
def test_context_shift_rerotates_permuted_keys(name: str, archs) -> None:
    """Cached keys are stored in the model's per-head order (interleaved / partial RoPE moved to rotate-half):
    on a one-layer model the shifted cache gives the logits of a fresh prefill of the kept tokens."""
    lm = load_model(archs.get(name).path, device="cpu", dtype="float32", max_seq_len=MAX_SEQ)
    model = lm.model
    assert model.rope_perms[0] is not None
    model.layers, model.cos, model.sin = model.layers[:1], model.cos[:1], model.sin[:1]
    ids = torch.randint(3, 900, (1, 60), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :4], ids[:, 4:20], ids[:, 20:50], ids[:, 50:]
    cache = model.new_cache()
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 4, 16)
    shifted = model.forward(new, cache, last_only=False)
    fresh = model.forward(torch.cat([memory, kept, new], 1), model.new_cache(), last_only=False)[:, -10:]
    assert row_rel_err(shifted, fresh) < 1e-5


def test_features_are_read(ours) -> None:
    cohere, cohere2, glm4, moe = (ours(n).model for n in ("cohere", "cohere2", "glm4", "glm4_moe"))
    f = cohere.features
    assert (f.norm, f.parallel_block, f.logit_scale, f.rope_interleaved, f.qk_norm) == ("layer", True, 0.5, True, True)
    assert cohere.layers[0].q_norm.shape == (4, 16) and cohere.layers[0].post_norm is None
    assert cohere.lm_head is cohere.embed_tokens
    assert cohere2.windows == (8, 8, 8, None)
    assert cohere2.features.ropes[3] is None and cohere2.features.ropes[0] is not None
    assert glm4.features.ropes[0].dim == 16 and glm4.features.biases == ("q_proj", "k_proj", "v_proj")
    assert glm4.layers[0].gate_up_proj is not None and glm4.layers[0].attn_out_norm is not None
    assert moe.layers[0].mlp is None and len(moe.layers) == 3
    mlp = moe.layers[1].mlp
    assert isinstance(mlp, RoutedExperts) and mlp.shared is not None
    assert mlp.routing == Routing("sigmoid", 2.5, 4, 2, fp32=True)
    assert (mlp.top_k, mlp.num_experts) == (2, 8)
    assert mlp.correction_bias is not None and mlp.correction_bias.dtype == torch.float32


def test_gptq_layers_stay_quantized(ours) -> None:
    for name in ("cohere_gptq", "glm4_gptq", "glm4_moe_gptq"):
        layer = ours(name).model.layers[1]
        assert isinstance(layer.o_proj, GPTQWeight), name
    assert ours("glm4_moe_gptq").model.layers[1].mlp.gate_up.qweight is not None


def test_glm4_moe_grouping_changes_the_choice(ours) -> None:
    """The fixture's groups and correction bias matter: without them the routing picks other experts."""
    mlp = ours("glm4_moe").model.layers[1].mlp
    rows = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    experts = mlp.route(rows)[1].sort(dim=-1).values
    from dataclasses import replace

    for plain in (replace(mlp, routing=replace(mlp.routing, n_group=1, topk_group=1)),
                  replace(mlp, correction_bias=None)):
        assert not torch.equal(plain.route(rows)[1].sort(dim=-1).values, experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm4_moe_routing_matches_transformers_router(dtype: torch.dtype, ours) -> None:
    """The loaded GLM-4.5 block's routing (DeepSeek-V3's sigmoid routing: groups ranked by their two best biased
    scores, router in float32) against transformers' Glm4MoeTopkRouter on 64 random rows, also from bfloat16 rows
    (both cast them up): the same experts with the same weights."""
    from transformers.models.glm4_moe import modeling_glm4_moe

    mlp = ours("glm4_moe").model.layers[1].mlp
    config = transformers.Glm4MoeConfig(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = modeling_glm4_moe.Glm4MoeTopkRouter(config)
    router.weight.data = mlp.router.float().clone()
    router.e_score_correction_bias.data = mlp.correction_bias.clone()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        _, ref_w, ref_e = router(x)
    w, e = mlp.route(x)
    order, ref_order = e.argsort(-1), ref_e.argsort(-1)
    assert torch.equal(e.gather(1, order), ref_e.gather(1, ref_order))
    assert torch.allclose(w.float().gather(1, order), ref_w.float().gather(1, ref_order).to(dtype).float(), atol=1e-6)


def test_glm4_moe_gathered_path_equals_grouped(ours) -> None:
    mlp = ours("glm4_moe_gptq").model.layers[2].mlp
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    weights, experts = mlp.route(rows)
    assert torch.allclose(mlp._gathered(rows, weights, experts), mlp._grouped(rows, weights, experts),
                          rtol=1e-5, atol=1e-5)


def _edited(archs: Factory, name: str, label: str, edit: Callable[[Dict[str, Any]], None]) -> Path:
    src = archs.get(name).oracle_path
    dst = archs.root / f"{name}-{label}"
    if not dst.exists():
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _rope_params(key: str, value: Any) -> Callable[[Dict[str, Any]], None]:
    return lambda c: c["rope_parameters"].update({key: value})


@pytest.mark.parametrize("name, label, edit", [
    ("cohere", "scale", lambda c: c.update(logit_scale=1.0)),
    ("cohere2", "no_window", lambda c: c.update(sliding_window=4096)),
    ("cohere2", "all_sliding", lambda c: c.update(layer_types=["sliding_attention"] * 4, sliding_window=4096)),
    ("glm4", "full_rope", _rope_params("partial_rotary_factor", 1.0)),
    ("glm4_moe", "no_groups", lambda c: c.update(n_group=1, topk_group=1)),
    ("glm4_moe", "unscaled", lambda c: c.update(routed_scaling_factor=1.0)),
])
def test_fixture_is_sensitive(name: str, label: str, edit, archs, hf) -> None:
    """Without the feature the oracle's logits move by more than 1%, so the tests above do test it."""
    ids = prompt_ids(archs.get(name), 40, seed=1)
    with torch.no_grad():
        changed = oracle_load(_edited(archs, name, label, edit))(ids).logits
        assert row_rel_err(changed, hf(name)(ids).logits) > 1e-2


def test_mistral3_reads_text_config_and_prefix(archs, ours) -> None:
    """The multimodal checkpoint loads its text model only: config from text_config, tensors from
    `language_model.`; the vision tower's tensors are in the file and not read."""
    built = archs.get("mistral3")
    from safetensors import safe_open

    with safe_open(str(built.path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("vision_tower.") for k in keys) and any(k.startswith("language_model.") for k in keys)
    lm = ours("mistral3")
    assert lm.config.architecture == "Mistral3ForConditionalGeneration"
    assert (lm.config.head_dim, lm.config.hidden_size, lm.config.num_heads) == (32, 64, 4)


def test_mistral3_without_text_config_is_one_sentence(archs, tmp_path: Path) -> None:
    folder = tmp_path / "m3"
    shutil.copytree(archs.get("mistral3").path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["text_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="text model's settings in text_config"):
        load_model(folder, device="cpu")


def test_glm4_moe_next_token_layer_is_stored_and_skipped(archs, ours) -> None:
    from safetensors import safe_open

    with safe_open(str(archs.get("glm4_moe").path / "model.safetensors"), "pt") as f:
        assert "model.layers.3.eh_proj.weight" in f.keys()
    assert len(ours("glm4_moe").model.layers) == 3


# GPU, along transformers' greedy path (teacher-forced), eager and CUDA-graph decode (GraphDecoder), the helper of
# tests/test_architectures_moe_gemma.py. float32 on CUDA must hold the CPU bound at every step (that proves the GPU
# logic: reordered RoPE, LayerNorm, sigmoid routing gathered on the device, graphs); float16 only measures rounding:
# 1e-2 every step, and for GLM-4.5 the median and 80% of steps (fp16 may pick another expert at a score near-tie).

FP16_RTOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp32_matches_transformers_at_every_step(name: str, graphs: bool, archs, hf) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.test_architectures_moe_gemma import _gpu_errors

    errs = _gpu_errors(archs.get(name), hf(name), "float32", graphs)
    assert max(errs) < LOGITS_RTOL, f"{name}: max relative logit error {max(errs):.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", ALL)
def test_gpu_fp16_matches_transformers(name: str, graphs: bool, archs, hf, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tests.test_architectures_moe_gemma import _gpu_errors

    errs = sorted(_gpu_errors(archs.get(name), hf(name), "float16", graphs))
    record_property("step_rel_errs", errs)
    if name.startswith("glm4_moe"):
        assert errs[len(errs) // 2] < FP16_RTOL and errs[int(0.8 * len(errs)) - 1] < FP16_RTOL, errs[-5:]
    else:
        assert errs[-1] < FP16_RTOL, f"{name}: relative logit errors {errs[-5:]}"


# ---------------------------------------------------------------------------------------------------------------
# Every host runs these families with no code of its own: United's folder check and load dialog, the split
# planner, the server's model report, the generator.


@pytest.mark.parametrize("name", ["cohere", "cohere2", "glm4", "glm4_moe", "glm4_moe_gptq", "mistral3"])
def test_united_accepts_the_folder_and_the_planner_counts_it(name: str, archs, ours) -> None:
    """The layout names the tensors transformers saved, so a split plan made without reading weights counts what
    the loader holds, byte for byte."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import Sizes, checkpoint_shapes, config_shapes, plan_device_map
    from kobold_backend.engine.load_options import requested_parameters
    from kobold_backend.host.backend import check_model_folder

    built, lm = archs.get(name), ours(name)
    assert check_model_folder(built.path) is None
    dialog = {p["id"]: p for p in requested_parameters(built.path, {}, gpus=[])}
    assert dialog["valid_layers"]["label"].endswith(f"/{lm.config.num_layers}")
    shapes = checkpoint_shapes(built.path)
    # what the engine does not read: Mistral 3's vision tower and projector, GLM-4.5's next-token-prediction layer
    read = {k: v for k, v in shapes.items() if k.startswith(("model.embed_tokens", "model.norm", "lm_head"))
            or k.startswith("model.layers.") and int(k.split(".")[2]) < lm.config.num_layers}
    assert config_shapes(ModelConfig.from_dir(built.path)) == read
    dm = plan_device_map(built.path, None, MAX_SEQ, layer_counts={"cpu": lm.config.num_layers})
    (usage,) = dm.usage
    assert usage.weight_bytes == lm.model.nbytes
    sizes = Sizes(lm.config, shapes, MAX_SEQ)
    for i, layer in enumerate(lm.model.layers):
        held = list(layer.tensors())
        assert sizes.layer(i, 4) == sum(w.nbytes if isinstance(w, GPTQWeight) else w.numel() * w.element_size()
                                        for w in held)


@pytest.mark.parametrize("name, architecture", [("cohere2", "Cohere2ForCausalLM"), ("glm4_moe", "Glm4MoeForCausalLM"),
                                                ("mistral3", "Mistral3ForConditionalGeneration")])
def test_server_names_the_architecture(name: str, architecture: str, archs) -> None:
    from tests.server_helpers import make_app

    app = make_app(archs.get(name).path)
    stored = stored_format(archs.get(name).path).name  # what doctor says; the fixtures are float16 or bfloat16
    assert stored in ("float16", "bfloat16")
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json() == {"result": f"kobold_backend/{name}", "architecture": architecture,
                                                     "format": stored, "bits_per_weight": 16.0}
        assert c.get("/ui/status").get_json()["architecture"] == architecture  # what the page shows
    finally:
        app.extensions["kobold_backend"].close()


@pytest.mark.parametrize("name", ["cohere_gptq", "glm4_moe"])
def test_generator_greedy_matches_transformers(name: str, archs, ours, hf) -> None:
    """The engine's Generator (lane, chunked prefill, sampler at temperature 0) gives transformers' greedy tokens."""
    from kobold_backend.engine.generator import GenerationRequest, Generator
    from kobold_backend.engine.sampling import SamplerSettings

    built, lm = archs.get(name), ours(name)
    prompt = prompt_ids(built, 20, seed=15)
    out = Generator(lm.model, lm.tokenizer).generate(
        GenerationRequest(prompt[0].tolist(), 24, SamplerSettings(temperature=0), ban_eos=True))
    assert out.token_ids == greedy_both(lm, hf(name), prompt, 24).ref_tokens


@pytest.mark.parametrize("name", ["cohere", "glm4_moe", "mistral3"])
def test_awq_checkpoint_matches_transformers(name: str, tmp_path: Path) -> None:
    """AutoAWQ GEMM copies (tests/fixtures/awq_pack.py) of the interleaved-RoPE, routed-expert and multimodal
    fixtures: every projection (experts and shared experts included, `language_model.` names for Mistral 3) read
    through the weight-format layer; logits against transformers on the dequantized weights."""
    import dataclasses

    from tests.fixtures.arch2026_checkpoints import SPEC_BY_NAME, build
    from tests.fixtures.awq_pack import write_awq

    spec = SPEC_BY_NAME[name]
    if spec.settings.get("num_nextn_predict_layers"):  # write_awq's oracle would hold the MTP layer too
        spec = dataclasses.replace(spec, settings=dict(spec.settings, num_nextn_predict_layers=0))
    built = build(spec, tmp_path / "hf")
    oracle = write_awq(built.path, tmp_path / "awq", group=32)
    lm = load_model(tmp_path / "awq", device="cpu", max_seq_len=MAX_SEQ)
    assert lm.config.quant is not None and lm.config.quant.method == "awq"
    assert isinstance(lm.model.layers[-1].o_proj, GPTQWeight)
    ids = prompt_ids(built, 24, seed=6)
    with torch.no_grad():
        ref = oracle_load(oracle)(ids).logits
    assert row_rel_err(lm.model.forward(ids, lm.model.new_cache(), last_only=False), ref) < LOGITS_RTOL


def _exl2_vs_dequantized(model_type: str, extra: Any, tmp_path: Path, device: str) -> float:
    """A synthetic EXL2 folder of the family (the bench's writer: random 3/4/5-bit groups over every projection
    its layout names) loaded and run, against the same model with every EXL2 linear replaced by its dequantized
    dense weight (EXL2's dequantization is checked bit for bit against exllamav2 in tests/test_exl2.py)."""
    from kobold_backend.bench.checkpoint import Shape
    from kobold_backend.bench.exl2_checkpoint import write_synthetic_exl2
    from kobold_backend.engine.model import Layer
    from kobold_backend.ops.exl2_weight import EXL2Weight, exl2_dequantize

    shape = Shape(256, 512, 4, 4, 2, 256, model_type=model_type, head_dim=64, extra_config=extra)
    path = write_synthetic_exl2(tmp_path / model_type, shape, device="cpu", max_position_embeddings=512)
    dtype = "float16" if device == "cuda" else None
    lm = load_model(path, device=device, dtype=dtype, with_tokenizer=False, max_seq_len=64)
    assert lm.weight_format is not None and lm.weight_format.name == "EXL2"
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0)).to(device)
    ours = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    replaced = 0
    for layer in lm.model.layers:
        assert layer.mlp_perm is None
        for name in Layer.PROJECTIONS:
            w = getattr(layer, name)
            if isinstance(w, EXL2Weight):
                setattr(layer, name, exl2_dequantize(w).to(layer.input_norm.dtype))
                replaced += 1
    assert replaced >= 4 * 4
    ref = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    assert torch.isfinite(ours).all()
    return row_rel_err(ours.cpu(), ref.cpu())


EXL2_FAMILIES = [("cohere", (("use_qk_norm", True), ("logit_scale", 0.25))),
                 ("cohere2", (("sliding_window", 8),)),
                 ("glm4", (("attention_bias", False), ("partial_rotary_factor", 0.5)))]


@pytest.mark.parametrize("model_type, extra", EXL2_FAMILIES, ids=[f[0] for f in EXL2_FAMILIES])
def test_exl2_checkpoint_loads_every_projection(model_type: str, extra: Any, tmp_path: Path) -> None:
    assert _exl2_vs_dequantized(model_type, extra, tmp_path, "cpu") < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, extra", EXL2_FAMILIES, ids=[f[0] for f in EXL2_FAMILIES])
def test_gpu_exl2_kernels_match_dequantized(model_type: str, extra: Any, tmp_path: Path) -> None:
    """The EXL2 CUDA kernels in float16 against the dequantized dense weights through the same model."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert _exl2_vs_dequantized(model_type, extra, tmp_path, "cuda") < 1e-2
