"""Qwen3.5 dense and MoE (hybrid Gated DeltaNet / gated attention) against transformers (CPU, float32).

Fixtures are built by transformers' own classes (tests/fixtures/qwen35_checkpoints.py). Besides logits and greedy
decoding, these tests follow the recurrent state through the cache: prompts prefilled in chunks (also across the
64-token blocks of the chunked delta rule), the Generator's prefix reuse across requests (the next chat turn
continues the state; a retry or an edit restores a snapshot), and the features that refuse such a state (context
shift, CUDA graphs, speculation, beams).
"""

from __future__ import annotations

from typing import Callable, List

import pytest
import torch
import transformers

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.sampling import SamplerSettings
from tests.fixtures.hf_oracle import by_name, greedy_both, hf_load, hf_step, prompt_ids, row_rel_err
from tests.fixtures.int8_activations import int8_ggml_activations, int8_on_cuda
from tests.fixtures.qwen35_checkpoints import SPECS, BuiltQwen35, build_qwen35

if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 classes (the oracle)", allow_module_level=True)

NAMES = [name for name, spec in SPECS.items() if not spec.vision]  # dense, MoE and GPTQ text models
LOGITS_ATOL = 1e-4
GREEDY_TOKENS = 32
MAX_SEQ = 256


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], BuiltQwen35]:
    root = tmp_path_factory.mktemp("qwen35_fixtures")
    return by_name(lambda name: build_qwen35(name, root))


@pytest.fixture(scope="module")
def ours(built) -> Callable[[str], LoadedModel]:
    return by_name(lambda name: load_model(built(name).path, device="cpu", max_seq_len=MAX_SEQ))


@pytest.fixture(scope="module")
def hf(built) -> Callable[[str], torch.nn.Module]:
    return by_name(lambda name: hf_load(built(name).oracle_path))


def _greedy_ref(model: torch.nn.Module, prompt: List[int], steps: int) -> List[int]:
    logits, past = hf_step(model, torch.tensor([prompt]), None)
    tokens: List[int] = []
    for _ in range(steps):
        tokens.append(int(logits[0, -1].argmax()))
        logits, past = hf_step(model, torch.tensor([[tokens[-1]]]), past)
    return tokens


def _greedy(tokens: List[int], n: int = GREEDY_TOKENS) -> GenerationRequest:
    return GenerationRequest(tokens, n, SamplerSettings(temperature=0), ban_eos=True)


@pytest.mark.parametrize("name", NAMES)
def test_layers_are_hybrid(name: str, ours) -> None:
    from kobold_backend.engine.linear_attention import GatedDeltaNet

    model = ours(name).model
    mixers = [layer.mixer for layer in model.layers]
    full = [layer for layer in model.layers if layer.mixer is None]  # the generic attention, output-gated
    assert any(isinstance(m, GatedDeltaNet) for m in mixers) and full
    assert all(m is None or isinstance(m, GatedDeltaNet) for m in mixers)
    if name.endswith("gptq"):
        from kobold_backend.ops.gptq_weight import GPTQWeight

        assert all(isinstance(m.in_qkv, GPTQWeight) for m in mixers if isinstance(m, GatedDeltaNet))
        assert all(isinstance(layer.qkv_proj or layer.q_proj, GPTQWeight) for layer in full)
    cache = model.new_cache()
    for layer, k, state in zip(model.layers, cache.k, cache.states):
        linear = isinstance(layer.mixer, GatedDeltaNet)
        assert (state is not None) == linear and k.shape[2] == (0 if linear else MAX_SEQ)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name: str, built, ours, hf, record_property) -> None:
    """150 tokens: three blocks of the chunked delta rule, the last one partial. The oracle runs in float64: over
    150 tokens transformers' own float32 run is ~6e-5 from it (ours ~5e-5), so the two float32 runs may differ by
    about 1e-4 between themselves. The MoE oracle stays float32 (transformers' grouped expert product has no
    float64)."""
    import copy

    ids = prompt_ids(built(name), 150, seed=1)
    lm = ours(name)
    logits = lm.model.forward(ids, lm.model.new_cache(), last_only=False)
    with torch.no_grad():
        oracle = hf(name) if SPECS[name].settings.get("num_experts") else copy.deepcopy(hf(name)).double()
        ref = oracle(ids).logits
    err = (logits.double() - ref).abs().max().item()
    record_property("max_abs_err", err)
    assert err < LOGITS_ATOL, f"{name}: max |dlogits| {err:.3e}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name: str, built, ours, hf, record_property) -> None:
    """A 16-token prompt prefilled in three chunks, then 32 greedy tokens one at a time, through each side's cache."""
    run = greedy_both(ours(name), hf(name), prompt_ids(built(name), 16, seed=2), GREEDY_TOKENS, cuts=(5, 11))
    gaps = [float(v.topk(2).values[0] - v.topk(2).values[1]) for v in run.ref_logits]
    assert min(gaps) > 1e-3, f"fixture {name} has a near-tie on its greedy path (gap {min(gaps):.2e})"
    assert len(set(run.ref_tokens)) > 3
    err = max((a - b).abs().max().item() for a, b in zip(run.logits, run.ref_logits))
    record_property("max_step_abs_err", err)
    assert run.tokens == run.ref_tokens
    assert err < LOGITS_ATOL, f"{name}: decode-step logits differ by {err:.3e}"


@pytest.mark.parametrize("name", NAMES)
def test_generator_reuses_the_state_across_requests(name: str, built, ours, hf) -> None:
    """Through the Generator: a prompt, then the next turn (prompt + reply + new text) continuing the live state,
    then the same turn again (a retry: the snapshot before its last token), then an edit early in the prompt (back
    to the empty state). Every reply is transformers' greedy reply to the whole prompt."""
    lm, ref = ours(name), hf(name)
    gen = Generator(lm.model, lm.tokenizer)
    assert not gen.use_graphs
    first = prompt_ids(built(name), 20, seed=3)[0].tolist()
    out = gen.generate(_greedy(first))
    assert out.token_ids == _greedy_ref(ref, first, GREEDY_TOKENS) and out.reused_tokens == 0
    turn = first + out.token_ids + prompt_ids(built(name), 9, seed=4)[0, 1:].tolist()
    out2 = gen.generate(_greedy(turn))
    assert out2.reused_tokens == len(first) + GREEDY_TOKENS - 1  # all the cache held: the reply's last was unfed
    assert out2.token_ids == _greedy_ref(ref, turn, GREEDY_TOKENS)
    again = gen.generate(_greedy(turn))
    assert again.reused_tokens == len(turn) - 1 and again.token_ids == out2.token_ids
    edit = first[:10] + prompt_ids(built(name), 12, seed=5)[0, 1:].tolist()
    out3 = gen.generate(_greedy(edit, 16))
    assert out3.reused_tokens == 0 and out3.token_ids == _greedy_ref(ref, edit, 16)


def test_multimodal_checkpoint_loads_its_text_model(built, record_property) -> None:
    """The released repos' layout: config.json's text_config, the decoder under model.language_model.; the vision
    tower is not read. Logits equal transformers' Qwen3_5ForConditionalGeneration on text input."""
    fixture = built("qwen35_vl")
    lm = load_model(fixture.path, device="cpu", max_seq_len=MAX_SEQ)
    assert lm.config.architecture == "Qwen3_5ForConditionalGeneration" and lm.config.num_layers == 2
    held = sum(t.numel() for layer in lm.model.layers for t in layer.tensors())
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(fixture.path), dtype=torch.float32)
    decoder = sum(p.numel() for n, p in ref.named_parameters() if ".layers." in n and "visual" not in n)
    assert held == decoder
    ids = prompt_ids(fixture, 40, seed=14)
    with torch.no_grad():
        want = ref.eval()(input_ids=ids).logits
    err = (lm.model.forward(ids, lm.model.new_cache(), last_only=False) - want).abs().max().item()
    record_property("max_abs_err", err)
    assert err < LOGITS_ATOL


@pytest.mark.parametrize("name", list(SPECS))
def test_planned_shapes_are_the_checkpoints(name: str, built) -> None:
    """Every decoder tensor the description lays out (for split plans and synthetic checkpoints) is in the file
    with that shape, and nothing of the decoder is left out."""
    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.device_map import checkpoint_shapes, config_shapes

    path = built(name).path
    stored = {k: v for k, v in checkpoint_shapes(path).items() if k.startswith(("model.", "lm_head"))}
    assert config_shapes(ModelConfig.from_dir(path)) == {k: v for k, v in stored.items() if ".visual." not in k}


@pytest.mark.parametrize("name", NAMES)
def test_split_planner_counts_states_not_kv_on_linear_layers(name: str, built, ours) -> None:
    """The planner's cache bytes are the allocated cache's: K/V for the attention layers, a fixed state for the
    linear ones, with room for the snapshots of those states; its weight bytes are the loaded model's."""
    from kobold_backend.engine.cache import MAX_SNAPSHOTS
    from kobold_backend.engine.device_map import plan_device_map

    lm = ours(name)
    dm = plan_device_map(built(name).path, None, MAX_SEQ, layer_counts={"cpu": lm.config.num_layers})
    (usage,) = dm.usage
    cache = lm.model.new_cache()
    states = sum(s.nbytes for s in cache.states if s is not None)
    assert states and usage.cache_bytes == cache.nbytes + MAX_SNAPSHOTS * states
    assert usage.weight_bytes == lm.model.nbytes


def test_truncate_restores_a_snapshot_and_refuses_other_lengths(built, ours) -> None:
    lm = ours("qwen35")
    ids = prompt_ids(built("qwen35"), 40, seed=6)
    fresh = lm.model.forward(ids, lm.model.new_cache(), last_only=False)[:, 25:]
    cache = lm.model.new_cache()
    lm.model.forward(ids[:, :25], cache)
    cache.tokens.extend(ids[0, :25].tolist())
    cache.snapshot()
    other = prompt_ids(built("qwen35"), 30, seed=7)[:, 1:]
    lm.model.forward(other, cache)
    cache.tokens.extend(other[0].tolist())
    assert cache.restorable(40) == 25 and cache.restorable(24) == 0
    with pytest.raises(ValueError, match="cannot return to length 30"):
        cache.truncate(30)
    cache.truncate(25)
    assert row_rel_err(lm.model.forward(ids[:, 25:], cache, last_only=False), fresh) < 1e-5


def test_a_forward_that_fails_part_way_drops_the_states(built, ours, hf) -> None:
    """A forward interrupted inside the stack (here: a layer raising) leaves no state that ran ahead of the
    cache's tokens: the next request starts from the empty state and matches transformers."""
    lm = ours("qwen35")
    gen = Generator(lm.model, lm.tokenizer)
    prompt = prompt_ids(built("qwen35"), 20, seed=20)[0].tolist()
    gen.generate(_greedy(prompt, 4))
    mlp = lm.model._mlp

    def fail(index, *args):
        if index == 2:
            raise RuntimeError("interrupted")
        return mlp(index, *args)

    lm.model._mlp = fail
    try:
        with pytest.raises(RuntimeError, match="interrupted"):
            gen.generate(_greedy(prompt + [5, 6, 7], 4))
    finally:
        del lm.model._mlp
    assert gen.cache.seq_len == 0
    out = gen.generate(_greedy(prompt + [5, 6, 7], 8))
    assert out.reused_tokens == 0 and out.token_ids == _greedy_ref(hf("qwen35"), prompt + [5, 6, 7], 8)


def test_banned_phrase_rewind_recomputes_from_a_snapshot(built, ours) -> None:
    """A rewind inside the reply (no snapshot there) re-runs from the prompt's snapshot: the output is what the
    same request gives on a fresh cache."""
    lm = ours("qwen35")
    prompt = prompt_ids(built("qwen35"), 20, seed=8)[0].tolist()
    plain = Generator(lm.model, lm.tokenizer).generate(_greedy(prompt, 24))
    text = lm.tokenizer.decode(plain.token_ids[4:7]).strip()
    assert len(text) > 1
    req = GenerationRequest(prompt, 24, SamplerSettings(temperature=0), ban_eos=True, banned_strings=[text])
    warm = Generator(lm.model, lm.tokenizer)
    warm.generate(_greedy(prompt, 4))
    got = warm.generate(req)
    want = Generator(lm.model, lm.tokenizer, cache=lm.model.new_cache()).generate(req)
    assert got.token_ids == want.token_ids and got.token_ids != plain.token_ids
    assert text.lower() not in lm.tokenizer.decode(got.token_ids).lower()


def test_refused_features_say_why(built, ours) -> None:
    from kobold_backend.engine.decode_graph import graphs_supported
    from kobold_backend.engine.speculative import SpeculationConfig
    from kobold_backend.errors import RequestError

    lm = ours("qwen35")
    model = lm.model
    assert model.recurrent and not graphs_supported(model)
    cache = model.new_cache()
    model.forward(prompt_ids(built("qwen35"), 12, seed=9), cache)
    with pytest.raises(ValueError, match="cannot be shifted"):
        model.shift_cache(cache, 2, 4)
    with pytest.raises(ValueError, match="no CUDA graphs"):
        model.decode_step(torch.tensor([[5]]), torch.tensor([12]), cache, 64)
    gen = Generator(model, lm.tokenizer)
    with pytest.raises(RequestError, match="beam search"):
        gen.generate(GenerationRequest([1, 5, 6], 4, num_beams=2))
    gen.use_speculation(SpeculationConfig("ngram", 4))
    prompt = prompt_ids(built("qwen35"), 20, seed=10)[0].tolist()
    out = gen.generate(_greedy(prompt, 8))
    assert "linear-attention" in gen.stats.speculation.fallback
    assert out.token_ids == Generator(model, lm.tokenizer).generate(_greedy(prompt, 8)).token_ids


def test_a_linear_attention_draft_model_is_refused(built) -> None:
    from kobold_backend.errors import ModelFormatError

    path = built("qwen35").path
    with pytest.raises(ModelFormatError, match="linear-attention layers"):
        load_model(path, device="cpu", max_seq_len=MAX_SEQ, speculative="draft", draft_model=path, draft_tokens=4)


def test_context_shift_falls_back_to_the_common_prefix(built, ours, hf) -> None:
    """A prompt with a span cut out after its start (what a full context gets) reuses only the common prefix."""
    lm = ours("qwen35")
    gen = Generator(lm.model, lm.tokenizer)
    ids = prompt_ids(built("qwen35"), 90, seed=11)[0].tolist()
    gen.generate(_greedy(ids[:80], 4))
    cut = ids[:4] + ids[40:90]
    out = gen.generate(_greedy(cut, 8))
    assert out.reused_tokens == 0 and out.token_ids == _greedy_ref(hf("qwen35"), cut, 8)


@pytest.mark.parametrize("cache_dtype, bound", [("q8", 1e-2), ("k8v4", 0.25)])
def test_quantized_kv_cache_on_the_attention_layers(cache_dtype: str, bound: float, built) -> None:
    """The full-attention layers' K/V quantized (head_dim 32), the linear states in float32: logits near fp32
    (4-bit values of this random model's heads alone move them by ~0.12, as tests/test_kv_quant.py measures)."""
    from kobold_backend.ops.kv_quant import QuantizedKV

    lm = load_model(built("qwen35").path, device="cpu", max_seq_len=MAX_SEQ, cache_dtype=cache_dtype)
    ids = prompt_ids(built("qwen35"), 40, seed=12)
    plain = load_model(built("qwen35").path, device="cpu", max_seq_len=MAX_SEQ)
    want = plain.model.forward(ids, plain.model.new_cache(), last_only=False)
    cache = lm.model.new_cache()
    assert isinstance(cache.k[3], QuantizedKV) and cache.states[3] is None and cache.states[0] is not None
    got = torch.cat([lm.model.forward(ids[:, :30], cache, last_only=False),
                     lm.model.forward(ids[:, 30:], cache, last_only=False)], dim=1)
    assert 1e-6 < row_rel_err(got, want) < bound


# ---------------------------------------------------------------------------------------------------------------
# GPU (the lead's device run): float16 and float32 on CUDA along transformers' greedy path, teacher-forced.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [("float16", 2e-2), ("float32", 1e-4)])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_matches_transformers(name: str, dtype: str, bound: float, built, hf, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    lm = load_model(built(name).path, device="cuda", dtype=dtype, max_seq_len=MAX_SEQ)
    prompt = prompt_ids(built(name), 100, seed=13)
    cache = lm.model.new_cache()
    got = lm.model.forward(prompt.cuda(), cache)
    ref, past = hf_step(hf(name), prompt, None)
    errs = [row_rel_err(got.float().cpu(), ref[:, -1:])]
    for _ in range(24):
        token = ref[:, -1:].argmax(-1)
        step = lm.model.forward(token.cuda(), cache)[0, -1]
        ref, past = hf_step(hf(name), token, past)
        errs.append(row_rel_err(step.float().cpu(), ref[0, -1]))
    record_property("step_rel_errs", errs)
    out = Generator(lm.model, lm.tokenizer).generate(_greedy(prompt[0].tolist(), 16))
    lm.unload()
    ordered = sorted(errs)
    if SPECS[name].settings.get("num_experts") and dtype == "float16":
        # a router's top-k may flip where two experts' logits are closer than fp16 rounding (as for Qwen3-MoE in
        # tests/test_architectures_moe_gemma.py): the bound holds for the median and 80% of the steps
        assert ordered[len(ordered) // 2] < bound and ordered[int(0.8 * len(ordered)) - 1] < bound, ordered[-3:]
    else:
        assert ordered[-1] < bound, f"{name} {dtype}: relative logit errors {ordered[-3:]}"
    if dtype == "float32":
        assert out.token_ids == _greedy_ref(hf(name), prompt[0].tolist(), 16)


def test_lora_applies_to_the_mlp_and_the_gated_attention(built, ours, tmp_path) -> None:
    """Peft adapters on the MLP and on the full-attention layers' q_proj (query and gate) and v_proj match peft's
    merged model; one naming the attention of a linear-attention layer is refused (its mixer takes no deltas)."""
    from kobold_backend.engine.passthrough import PassthroughConfig, build_passthrough
    from kobold_backend.errors import RequestError
    from tests.test_passthrough import ours_logits
    from tests.test_passthrough_lora import make_adapter, peft_merged

    fixture, lm = built("qwen35"), ours("qwen35")
    make_adapter(fixture.path, tmp_path / "mlp", seed=1, target_modules=["gate_proj", "up_proj", "down_proj"])
    make_adapter(fixture.path, tmp_path / "attn", seed=2, target_modules=["q_proj", "v_proj"])
    config = PassthroughConfig(lora_dir=tmp_path)
    ids = prompt_ids(fixture, 20, seed=15)
    got = ours_logits(lm, ids, build_passthrough({"lora": [{"name": "mlp"}]}, lm.model, config))
    with torch.no_grad():
        ref = peft_merged(fixture.path, {"mlp": tmp_path / "mlp"})(ids).logits
    assert row_rel_err(got, ours_logits(lm, ids, None)) > 1e-2 and row_rel_err(got, ref) < 1e-4
    got = ours_logits(lm, ids, build_passthrough({"lora": [{"name": "attn"}]}, lm.model, config))
    with torch.no_grad():
        ref = peft_merged(fixture.path, {"attn": tmp_path / "attn"})(ids).logits
    assert row_rel_err(got, ours_logits(lm, ids, None)) > 1e-2 and row_rel_err(got, ref) < 1e-4
    linear = next(i for i, layer in enumerate(lm.model.layers) if layer.mixer is not None)
    (tmp_path / "mixer").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / "mixer" / name).write_bytes((tmp_path / "attn" / name).read_bytes())
    _rename_layers(tmp_path / "mixer" / "adapter_model.safetensors", linear)
    with pytest.raises(RequestError, match="token mixer"):
        build_passthrough({"lora": [{"name": "mixer"}]}, lm.model, config)


def _rename_layers(path, layer: int) -> None:
    """Point every tensor of a peft adapter file at decoder layer `layer`."""
    import re

    from safetensors.torch import load_file, save_file

    tensors = {re.sub(r"layers\.\d+\.", f"layers.{layer}.", k): v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path))


def test_lockstep_rows_copy_the_prefilled_state(built, ours, hf) -> None:
    """n = 2 completions in lockstep: row 1's cache is a copy of row 0's prefill, recurrent states included."""
    lm = ours("qwen35")
    prompt = prompt_ids(built("qwen35"), 20, seed=16)[0].tolist()
    req = GenerationRequest(prompt, 12, SamplerSettings(temperature=0), ban_eos=True, n=2)
    rows = Generator(lm.model, lm.tokenizer).stream_rows(req)
    try:
        got = [[e.token_id for e in row if e.token_id is not None] for row in rows]
    finally:
        for row in rows:
            row.close()
    want = _greedy_ref(hf("qwen35"), prompt, 12)
    assert got == [want, want]


@pytest.mark.parametrize("name", ["qwen35", "qwen35_moe", "qwen35_vl"])
def test_hosts_accept_the_folder_and_name_the_architecture(name: str, built) -> None:
    """United's folder check and load dialog, and the server's model report, with no code of their own."""
    from kobold_backend.engine.load_options import requested_parameters
    from kobold_backend.host.backend import check_model_folder
    from tests.server_helpers import make_app

    path = built(name).path
    assert check_model_folder(path) is None
    dialog = {p["id"]: p for p in requested_parameters(path, {}, gpus=[])}
    assert dialog["valid_layers"]["label"].endswith(f"/{len(SPECS[name].settings['layer_types'])}")
    app = make_app(path)
    try:
        got = app.test_client().get("/api/v1/model").get_json()
        assert got["architecture"] == SPECS[name].model_class and got["result"] == f"kobold_backend/{name}"
    finally:
        app.extensions["kobold_backend"].close()


# ---------------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp's qwen35 layout: tiled value heads, ssm_a = -exp(A_log), +1 norms, a trailing MTP layer).


@pytest.fixture(scope="module")
def gguf_files(built, tmp_path_factory: pytest.TempPathFactory):
    from tests.fixtures.qwen35_gguf import write_qwen35_gguf

    def write(name: str):
        out = tmp_path_factory.mktemp(f"{name}_gguf")
        oracle = write_qwen35_gguf(built(name).path, out)
        return out / "model.gguf", hf_load(oracle)

    return by_name(write)


@pytest.mark.parametrize("name, model_type", [("qwen35", "qwen3_5_text"), ("qwen35_moe", "qwen3_5_moe_text")])
def test_gguf_matches_transformers(name: str, model_type: str, gguf_files, built, record_property) -> None:
    from kobold_backend.engine.linear_attention import GatedDeltaNet
    from kobold_backend.ops.ggml import GGMLWeight

    path, ref = gguf_files(name)
    lm = load_model(path, device="cpu", max_seq_len=MAX_SEQ)
    layers = SPECS[name].settings["num_hidden_layers"]
    assert lm.config.model_type == model_type and lm.config.num_layers == layers  # the MTP layer is not read
    mixers = [layer.mixer for layer in lm.model.layers]
    assert all(m.tiled and isinstance(m.in_qkv, GGMLWeight) for m in mixers if isinstance(m, GatedDeltaNet))
    ids = prompt_ids(built(name), 100, seed=17)
    with torch.no_grad():
        want = ref(ids).logits
    err = (lm.model.forward(ids, lm.model.new_cache(), last_only=False) - want).abs().max().item()
    record_property("max_abs_err", err)
    assert err < LOGITS_ATOL
    prompt = ids[0, :20].tolist()
    out = Generator(lm.model, lm.tokenizer).generate(_greedy(prompt, 24))
    assert out.token_ids == _greedy_ref(ref, prompt, 24)


def test_gguf_value_head_order_matters(gguf_files, built) -> None:
    """Read as if grouped (Hugging Face's order), the tiled file gives other logits: the test above tests it."""
    path, ref = gguf_files("qwen35")
    lm = load_model(path, device="cpu", max_seq_len=MAX_SEQ)
    for layer in lm.model.layers:
        if hasattr(layer.mixer, "tiled"):
            layer.mixer.tiled = False
    ids = prompt_ids(built("qwen35"), 40, seed=18)
    with torch.no_grad():
        want = ref(ids).logits
    assert row_rel_err(lm.model.forward(ids, lm.model.new_cache(), last_only=False), want) > 1e-2


def test_united_accepts_the_gguf(gguf_files) -> None:
    from kobold_backend.host.backend import check_model_folder

    assert check_model_folder(gguf_files("qwen35")[0]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen35", "qwen35_moe"])
def test_gpu_gguf_matches_the_cpu_run(name: str, gguf_files, built) -> None:
    """The GGUF files on CUDA in float16 (Q8_0 linears through the GGML kernels), teacher-forced along the engine's
    float32 CPU run of the same file (held to transformers by test_gguf_matches_transformers) within 1e-2, plus 1.5
    times the error the integer GEMV's int8 activation rounding gives a float32 run (the rule of
    tests/test_gguf_archs.py's GPU test). On the H200 (2026-12-03): 4.9e-2 with the int8 GEMV, 2.4e-3 with the
    float16-activation GEMV; the rounding rule alone 4.1e-2; transformers' own float16 run 4.4e-3 from its float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    path, _ = gguf_files(name)
    runs = {"cpu": load_model(path, device="cpu", max_seq_len=MAX_SEQ),
            "gpu": load_model(path, device="cuda", dtype="float16", max_seq_len=MAX_SEQ)}
    if int8_on_cuda():
        runs["int8"] = load_model(path, device="cpu", max_seq_len=MAX_SEQ)
    caches = {k: lm.model.new_cache() for k, lm in runs.items()}
    errs: dict = {"gpu": [], "int8": []}
    ids = prompt_ids(built(name), 60, seed=19)
    for _ in range(17):
        ref = runs["cpu"].model.forward(ids, caches["cpu"])
        errs["gpu"].append(row_rel_err(runs["gpu"].model.forward(ids.cuda(), caches["gpu"]).float().cpu(), ref))
        if "int8" in runs:
            with int8_ggml_activations():
                errs["int8"].append(row_rel_err(runs["int8"].model.forward(ids, caches["int8"]), ref))
        ids = ref[:, -1:].argmax(-1)
    runs["gpu"].unload()
    bound = 1e-2 + 1.5 * max(errs["int8"], default=0.0)
    ordered = sorted(errs["gpu"])
    if name.endswith("moe"):  # router top-k flips under fp16 rounding, as in test_gpu_matches_transformers
        assert ordered[len(ordered) // 2] < bound and ordered[int(0.8 * len(ordered)) - 1] < bound, (errs, bound)
    else:
        assert ordered[-1] < bound, (errs, bound)


def test_engine_bench_runs_without_graphs(built) -> None:
    """`kobold-backend bench` truncates its cache back between runs: on a linear-attention model it returns to the
    snapshots it took, eager (no graphs), and the chat-turn figure reuses the cached context."""
    from kobold_backend.bench.engine_bench import bench_engine

    result = bench_engine(str(built("qwen35").path), device="cpu", prompt_lengths=(32,), contexts=(16, 40),
                          decode_steps=4, chat_context=60, chat_new=8, max_seq_len=128)
    assert result["graphs"] is False and set(result["decode_tokens_per_s"]) == {"16", "40"}
    assert result["chat_turn"]["cached_tokens"] == 60
