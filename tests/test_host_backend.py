"""The United plugin replayed through United's own call sequence (tests/united_harness.py): discovery of the
class.py shim, folder selection, parameters, load, generations with United's hooks and stoppers, unload.

Oracles: independent single-row runs for batches, sentencepiece for token texts, transformers for the RoPE
options, and properties any correct implementation has (no repeats under a huge repetition penalty, text cut
at the first newline, banned ids never sampled)."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file, save_file

from kobold_backend import __version__
from kobold_backend.host.backend import make_model_backend
from kobold_backend.host.settings import PLUGIN_FOLDER, settings_path
from kobold_backend.host.shim import write_shim
from tests import united_harness
from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.hf_oracle import hf_load, row_rel_err
from tests.united_harness import GenerationMode, GenerationSettings, UnitedHost

PLUGIN = "kobold_backend"
GREEDY = {"temp": 1.0, "top_k": 1, "top_p": 1.0, "tfs": 1.0, "typical": 1.0, "top_a": 0.0, "rep_pen": 1.0,
          "rep_pen_range": 0, "rep_pen_slope": 1.0}
RANDOM = dict(GREEDY, top_k=0)


@pytest.fixture(scope="module")
def model_dir(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("dense_fp32").path


def menu_item(path: Path) -> Dict[str, Any]:
    """The lower-cased attributes of a folder-browser item that select_model/load_model carry."""
    return {"name": path.name, "label": path.name, "size": "", "ismenu": "false", "isdownloaded": "true",
            "isdirectory": "true", "menu": "Custom", "path": str(path), "id": str(path)}


def on_cpu(params: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The form's defaults with every layer on the CPU (the tests compare against CPU float32 oracles)."""
    data = {p["id"]: p["default"] for p in params if p["uitype"] != "Valid Display"}
    total = sum(v for k, v in data.items() if k.endswith("_Layers"))
    data.update({k: 0 for k in data if k.endswith("_Layers")}, CPU_Layers=total)
    return data


def load(host: UnitedHost, path: Path, **values: Any) -> Any:
    data = on_cpu(host.select_folder(path.name, str(path))["model_backends"][PLUGIN])
    if any(k.endswith("_Layers") for k in values):
        data.update({k: 0 for k in data if k.endswith("_Layers")})
    data.update(values)
    data.update(menu_item(path))
    return host.load(PLUGIN, data)


def sample_with(host: UnitedHost, **settings: Any) -> None:
    for key, value in settings.items():
        setattr(host.vars, key, value)


def tokens(result: Any, row: int = 0) -> List[int]:
    return [int(t) for t in result.encoded[row]]


def test_discovery_registers_the_shim_over_uniteds_base(united: UnitedHost) -> None:
    reg = united.registry
    assert reg.import_errors == {}
    backend = reg.model_backends[PLUGIN]
    assert reg.module_names[PLUGIN] == PLUGIN_FOLDER and reg.crosswalk == {"GPTQ": [PLUGIN]}
    assert isinstance(backend, united_harness.InferenceModel)
    assert backend.disable is False
    assert backend.capabilties.stopper_hooks and backend.capabilties.post_token_hooks
    assert backend.stopper_hooks[0] is united_harness.Stoppers.core_stopper
    assert backend.post_token_hooks == [united_harness.PostTokenHooks.stream_tokens]
    assert GenerationMode.FOREVER in backend.get_supported_gen_modes()


def test_united_call_sequence(united: UnitedHost, model_dir: Path) -> None:
    offered = united.select_folder(model_dir.name, str(model_dir))["model_backends"]
    params = offered[PLUGIN]
    ids = [p["id"] for p in params]
    assert ids[0] == "valid_layers" and "CPU_Layers" in ids and "max_ctx" in ids
    form = on_cpu(params)
    form.update(max_ctx=256, ntk_alpha=1.0)
    refreshed = united.resubmit(dict(form, **menu_item(model_dir), valid_backends=[PLUGIN]))
    assert {p["id"]: p["default"] for p in refreshed["model_backends"][PLUGIN]}["max_ctx"] == 256

    backend = united.load(PLUGIN, dict(form, **menu_item(model_dir)))
    assert backend.model_name == str(model_dir) and united.vars.model == str(model_dir)
    assert backend.generator.max_context == 256
    assert united.vars.loaded_layers == united.vars.total_layers > 0
    saved = json.loads(settings_path(str(model_dir), Path("settings")).read_text())
    assert saved["max_ctx"] == 256 and saved["CPU_Layers"] == 2
    assert {p["id"]: p["default"] for p in united.select_folder(model_dir.name, str(model_dir))
            ["model_backends"][PLUGIN]}["max_ctx"] == 256

    sample_with(united, **GREEDY, genamt=12, numseqs=2, max_length=256)
    texts = united.generate("The license grants")
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0]
    bridge = united.vars.lua_koboldbridge.generated
    assert len(bridge[1]) == len(bridge[2]) == 12

    old = weakref.ref(backend.loaded.model)
    backend.unload()
    gc.collect()
    assert backend.model is None and backend.tokenizer is None and backend.generator is None
    assert old() is None


def test_hooks_run_after_every_token_then_stoppers(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **RANDOM)
    events: List[Any] = []
    backend.post_token_hooks.append(lambda model, ids: events.append(("hook", ids.clone())))

    def stop_after_seven(model: Any, ids: torch.Tensor) -> bool:
        events.append(("stopper", ids.shape[-1]))
        return ids.shape[-1] - len(prompt) >= 7

    backend.stopper_hooks.insert(0, stop_after_seven)
    prompt = backend.tokenizer.encode("Everyone is permitted to copy")
    result = backend.raw_generate(prompt, max_new=40, do_streaming=True, seed=3)
    out = tokens(result)
    assert len(out) == 7
    kinds = [e[0] for e in events]
    assert kinds == ["hook", "stopper"] * 7
    for step, (_, ids) in enumerate(events[0::2]):
        assert ids.shape == (1, len(prompt) + step + 1)
        assert ids[0].tolist() == prompt + out[: step + 1]
    streamed = united.vars.actions.streamed
    assert [s[0] for s in streamed] == [backend.tokenizer.decode(t) for t in out]
    assert "".join(s[0] for s in streamed) == result.decoded[0]


def test_stop_sequence_stopper_stops_at_the_string(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **GREEDY)
    prompt = backend.tokenizer.encode("This program is free software")
    baseline = backend.raw_generate(prompt, max_new=24)
    # United's stopper compares the end of the decoded text, so the stop string ends where a token ends.
    stop = backend.tokenizer.decode(tokens(baseline)[:12])[-3:]
    united.vars.stop_sequence = [stop]
    stopped = backend.raw_generate(prompt, max_new=24)
    cut = tokens(stopped)
    assert cut == tokens(baseline)[: len(cut)] and len(cut) < 24
    assert stopped.decoded[0].endswith(stop) or stop in backend.tokenizer.decode(cut[-1])
    assert stop not in backend.tokenizer.decode(cut[:-1])


def test_seed_makes_sampling_reproducible_including_zero(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **RANDOM)
    prompt = backend.tokenizer.encode("You may convey verbatim copies")
    runs = {seed: tokens(backend.raw_generate(prompt, max_new=16, seed=seed)) for seed in (0, 1, 2)}
    assert tokens(backend.raw_generate(prompt, max_new=16, seed=0)) == runs[0]
    assert runs[0] != runs[1] or runs[0] != runs[2]
    # without a seed argument, torch's global RNG decides (United seeds it for API calls with sampler_seed)
    torch.manual_seed(1234)
    first = tokens(backend.raw_generate(prompt, max_new=16))
    torch.manual_seed(1234)
    assert tokens(backend.raw_generate(prompt, max_new=16)) == first


def test_batch_rows_match_independent_runs(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **RANDOM)
    prompt = backend.tokenizer.encode("Each licensee is addressed as you")
    single = [tokens(backend.raw_generate(prompt, max_new=10, seed=40 + row)) for row in range(3)]
    batch = backend.raw_generate(prompt, max_new=10, batch_count=3, seed=40)
    assert batch.encoded.shape == (3, 10)
    assert [tokens(batch, row) for row in range(3)] == single
    assert batch.decoded == [backend.tokenizer.decode(row) for row in single]


def test_core_generate_batch_feeds_uniteds_stoppers(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **RANDOM, genamt=9, numseqs=3, full_determinism=True, seed=11, max_length=512)
    texts = united.generate("To protect your rights")
    assert len(texts) == 3 and len(set(texts)) > 1
    bridge = united.vars.lua_koboldbridge.generated
    rows = [[bridge[r + 1][t + 1] for t in range(9)] for r in range(3)]
    assert [backend.tokenizer.decode(row) for row in rows] == texts
    streamed = united.vars.actions.streamed
    assert len(streamed) == 9 and all(len(step) == 3 for step in streamed)


def test_repetition_penalty_reaches_generated_tokens(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    prompt = backend.tokenizer.encode("The precise terms and conditions")
    sample_with(united, **GREEDY)
    baseline = tokens(backend.raw_generate(prompt, max_new=40))
    assert len(set(baseline)) < len(baseline), "the fixture model should repeat itself under greedy decoding"
    sample_with(united, rep_pen=50.0, rep_pen_range=0)
    penalized = tokens(backend.raw_generate(prompt, max_new=40))
    assert len(set(penalized)) == len(penalized)
    assert not set(penalized) & set(prompt)


def special_ids(folder: Path) -> Dict[str, Any]:
    """EOS, BOS, newline and every token whose text has "[" or "]", from sentencepiece itself."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    brackets = {i for i in range(sp.get_piece_size())
                if not sp.is_control(i) and any(c in sp.decode([i]) for c in "[]")}
    return {"eos": sp.eos_id(), "bos": sp.bos_id(), "newline": sp.piece_to_id("<0x0A>"), "brackets": brackets}


@pytest.fixture(scope="module")
def eager_model(checkpoints: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of a fixture model whose head rows for EOS, newline and the bracket tokens are scaled up, so
    that it often wants to end, break the line or open a bracket."""
    source = checkpoints.get("dense_fp16").path
    folder = tmp_path_factory.mktemp("eager") / "eager"
    shutil.copytree(source, folder)
    ids = special_ids(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    rows = [ids["eos"], ids["newline"], *ids["brackets"]]
    tensors["lm_head.weight"][rows] *= 4.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_single_line_stops_at_the_first_newline(united: UnitedHost, eager_model: Path) -> None:
    backend = load(united, eager_model)
    sample_with(united, **RANDOM, use_default_badwordsids=True)
    prompt = backend.tokenizer.encode("Line one")
    newline = special_ids(eager_model)["newline"]
    checked = 0
    for seed in range(6):
        baseline = tokens(backend.raw_generate(prompt, max_new=40, seed=seed))
        if newline not in baseline[1:-1]:
            continue
        checked += 1
        first = baseline.index(newline)
        result = backend.raw_generate(prompt, max_new=40, seed=seed, single_line=True)
        assert result.decoded[0] == backend.tokenizer.decode(baseline).split("\n", 1)[0]
        assert result.decoded[0] == backend.tokenizer.decode(baseline[:first])
        assert list(result.encoded[0]) == backend.tokenizer.encode(result.decoded[0])
    assert checked >= 2


def test_default_badwordsids_ban_eos_and_brackets(united: UnitedHost, eager_model: Path) -> None:
    backend = load(united, eager_model)
    ids = special_ids(eager_model)
    prompt = backend.tokenizer.encode("Preamble")
    sample_with(united, **RANDOM, use_default_badwordsids=False)
    free = [tokens(backend.raw_generate(prompt, max_new=60, seed=seed)) for seed in range(6)]
    assert any(len(run) < 60 for run in free)  # the model stops at EOS ...
    assert all(ids["eos"] not in run for run in free)  # ... which is not part of the output
    assert any(set(run) & ids["brackets"] for run in free)
    sample_with(united, use_default_badwordsids=True)
    for seed in range(6):
        banned = tokens(backend.raw_generate(prompt, max_new=60, seed=seed))
        assert len(banned) == 60
        assert not set(banned) & (ids["brackets"] | {ids["eos"], ids["bos"]})


def test_forever_mode_fills_the_context(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir, max_ctx=256)
    sample_with(united, **RANDOM)
    prompt = backend.tokenizer.encode("Forever")
    result = backend.raw_generate(prompt, max_new=80, gen_mode=GenerationMode.FOREVER, seed=1)
    assert len(result.encoded[0]) == 256 - (len(prompt) + 1)  # + BOS


def test_abort_stops_within_a_token_and_resets(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **RANDOM)
    prompt = backend.tokenizer.encode("Abort")

    def abort_at_three(model: Any, ids: torch.Tensor) -> None:
        if ids.shape[-1] - len(prompt) == 3:
            model.abort_generation()

    backend.post_token_hooks.append(abort_at_three)
    assert len(backend.raw_generate(prompt, max_new=30, seed=0).encoded[0]) == 3
    assert backend.abort is False
    backend.post_token_hooks.remove(abort_at_three)
    assert len(backend.raw_generate(prompt, max_new=30, seed=0).encoded[0]) == 30


class Steering:
    """A passthrough object: adds `shift` to the residual stream after every layer and counts the calls."""

    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.calls = 0

    def after_layer(self, index: int, h: torch.Tensor, pos: int) -> torch.Tensor:
        self.calls += 1
        return h + self.shift

    def linear_delta(self, index: int, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        return None


def test_passthrough_reaches_the_model(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir)
    sample_with(united, **GREEDY)
    prompt = backend.tokenizer.encode("Steer")
    baseline = tokens(backend._raw_generate(prompt, 12, GenerationSettings()))
    idle, push = Steering(0.0), Steering(3.0)
    assert tokens(backend._raw_generate(prompt, 12, GenerationSettings(), passthrough=idle)) == baseline
    assert idle.calls >= 12 * 2
    assert tokens(backend._raw_generate(prompt, 12, GenerationSettings(), passthrough=push)) != baseline


def test_rope_options_take_effect_like_transformers(united: UnitedHost, model_dir: Path, tmp_path: Path) -> None:
    """compress_emb is linear RoPE scaling and ntk_alpha scales the base by alpha^(d/(d-2)); transformers
    with the equivalent config.json must give the same logits."""
    ids = torch.tensor([[1] + list(range(40, 100))])
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    cases = [({"compress_emb": 2.0}, {"rope_scaling": {"type": "linear", "factor": 2.0}}),
             ({"ntk_alpha": 3.0}, {"rope_theta": config["rope_theta"] * 3.0 ** (head_dim / (head_dim - 2))})]
    plain = None
    for values, hf_changes in cases:
        backend = load(united, model_dir, **dict({"compress_emb": 1.0, "ntk_alpha": 1.0}, **values))
        ours = backend.model.forward(ids, backend.model.new_cache(max_seq_len=128), last_only=False)
        if plain is None:
            plain = hf_load(model_dir)(ids).logits.detach()
        folder = tmp_path / f"hf-{len(hf_changes)}-{next(iter(values))}"
        shutil.copytree(model_dir, folder)
        (folder / "config.json").write_text(json.dumps(dict(config, **hf_changes)))
        with torch.no_grad():
            ref = hf_load(folder)(ids).logits
        assert row_rel_err(ours, ref) < 1e-4
        assert row_rel_err(plain, ref) > 1e-3  # the option changes the model
        backend.unload()


def test_put_model_and_cli_loads(united: UnitedHost, model_dir: Path) -> None:
    backend = load(united, model_dir, max_ctx=256)
    backend.unload()
    reloaded = united.put_model(str(model_dir), PLUGIN)
    assert reloaded.model_name == str(model_dir) and reloaded.generator.max_context == 256  # saved settings
    united.model.unload()
    cli = united.cli_load(str(model_dir), PLUGIN, str(model_dir), {"max_ctx": 384, "0_Layers": 0, "CPU_Layers": 2})
    assert cli.generator.max_context == 384 and cli.model_name == str(model_dir)
    sample_with(united, **GREEDY)
    assert len(cli.raw_generate("Hello", max_new=5).encoded[0]) == 5


def test_layer_sliders_get_the_memory_checked_plan(united: UnitedHost, model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """United's sliders are planned by engine/device_map like --cpu-layers: a split that does not fit the free
    memory is refused with the device and the shortfall, before any weight is read."""
    from kobold_backend.engine import device_map, loader

    def no_ram(cls: Any) -> device_map.HardwareProbe:
        return device_map.HardwareProbe(gpu_free=[], cpu_available=1 << 20)

    def must_not_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load_model was called for a plan that does not fit")

    monkeypatch.setattr(device_map.HardwareProbe, "detect", classmethod(no_ram))
    monkeypatch.setattr(loader, "load_model", must_not_load)
    with pytest.raises(device_map.PlanError, match=r"^cpu needs .* budget is 0.00 GiB: short by"):
        load(united, model_dir, max_ctx=256)
    assert united.registry.model_backends[PLUGIN].loaded is None


def test_folders_it_cannot_run_are_not_offered(united: UnitedHost, tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    backend = united.registry.model_backends[PLUGIN]
    assert united.select_folder(folder.name, str(folder)) == {"model_backends": {}}
    assert not backend.is_valid("missing", None, "Custom")
    params = backend.get_requested_parameters("KoboldAI/not-downloaded", None, "GPTQ")
    assert len(params) == 1 and params[0]["check"]["sum"] == []


def test_model_path_none_falls_back_to_models_folder(united: UnitedHost, model_dir: Path) -> None:
    shutil.copytree(model_dir, Path("models") / "org_tiny")
    backend = united.registry.model_backends[PLUGIN]
    assert backend.is_valid("org/tiny", None, "Custom")
    assert backend.get_requested_parameters("org/tiny", None, "Custom")[0]["id"] == "valid_layers"


def test_shim_registers_a_disabled_backend_when_the_package_is_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = UnitedHost(tmp_path / "KoboldAI")
    write_shim(host.plugins / PLUGIN_FOLDER, __version__)
    monkeypatch.setitem(sys.modules, "kobold_backend.host.backend", None)
    with host:
        reg = host.discover()
        assert reg.model_backends == {} and reg.import_errors == {}
        module = sys.modules[f"modeling.inference_models.{PLUGIN_FOLDER}.class"]
        backend = module.model_backend()
        assert backend.disable and "cannot be imported" in backend.disable_reason
        assert isinstance(backend, united_harness.InferenceModel)


def test_standalone_class_outside_united(model_dir: Path, tmp_path: Path) -> None:
    """make_model_backend(None): the class install-plugin's check and non-United callers get."""
    backend = make_model_backend(None)()
    backend.settings_dir = tmp_path
    assert not backend.disable and backend.capabilties.stopper_hooks
    assert backend.is_valid(model_dir.name, str(model_dir), "Custom")
    backend.set_input_parameters({"id": "tiny", "path": str(model_dir), "CPU_Layers": 2, "max_ctx": 256})
    backend.load()
    assert backend.model_name == "tiny" and (tmp_path / "tiny.kobold_backend.model_backend.settings").is_file()
    prompt = backend.tokenizer.encode("Standalone")
    greedy = GenerationSettings(**GREEDY)
    result = backend._raw_generate(prompt, 12, greedy, batch_count=2)
    assert result.is_whole_generation and result.encoded.shape == (2, 12)
    assert result.decoded == [backend.tokenizer.decode(row) for row in result.encoded]
    assert len(backend._raw_generate(prompt, 5, None, seed=0).encoded[0]) == 5  # United's defaults
    line = backend._raw_generate(prompt, 12, greedy, single_line=True)
    assert "\n" not in line.decoded[0] and list(line.encoded[0]) == backend.tokenizer.encode(line.decoded[0])
    backend.unload()
    assert backend.model is None


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "split"])
def test_unload_frees_every_gpu_byte(tmp_path: Path, model_dir: Path, placement: str) -> None:
    """Everything a load and its generations allocate on the GPU (weights, KV caches, batch caches, CUDA
    graphs) is freed by unload(). A first load/unload cycle runs before the baseline is taken because torch's
    cuBLAS workspace and the kernels' scratch buffer are allocated once per process and kept."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    host = UnitedHost(tmp_path / "KoboldAI")
    write_shim(host.plugins / PLUGIN_FOLDER, __version__)
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    values = {"0_Layers": n, "CPU_Layers": 0} if placement == "gpu" else \
        {"0_Layers": 1, "CPU_Layers": n - 1, "embed_on_cpu": True}
    with host:
        host.discover()
        sample_with(host, **RANDOM)
        for _ in range(2):
            gc.collect()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            backend = load(host, model_dir, **values)
            result = backend.raw_generate(backend.tokenizer.encode("GPU"), max_new=16, batch_count=2, seed=0)
            assert result.encoded.shape == (2, 16)
            assert torch.cuda.memory_allocated() > base
            backend.unload()
            torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base


def test_a_byte_level_bpe_model_generates_like_transformers(united: UnitedHost, checkpoints: CheckpointFactory,
                                                            tmp_path: Path) -> None:
    """A Llama-3-style tokenizer.json model (byte-level BPE, <|begin_of_text|>) through United's calls: the prompt's
    ids are the `tokenizers` library's, the greedy tokens transformers' argmax, the text the library's decode. The
    llama3 RoPE scaling is taken out so that every transformers release United may have (4.36 on) loads it."""
    from tokenizers import Tokenizer as HFTokenizer

    folder = tmp_path / "llama-bpe"
    shutil.copytree(checkpoints.get("llama3_rope").path, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling")
    (folder / "config.json").write_text(json.dumps(config))
    backend = load(united, folder)
    sample_with(united, **GREEDY)
    library = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = "Everyone is permitted to copy and distribute"
    ids = backend.tokenizer.encode(prompt)
    assert ids == library.encode(prompt, add_special_tokens=False).ids
    result = backend.raw_generate(ids, max_new=8)
    out = tokens(result)
    reference = hf_load(folder)
    sequence = torch.tensor([library.encode(prompt).ids])
    with torch.no_grad():
        for _ in range(8):
            sequence = torch.cat([sequence, reference(sequence).logits[:, -1:].argmax(-1)], dim=1)
    assert out == sequence[0, -8:].tolist()
    assert result.decoded[0] == library.decode(out)
    backend.unload()
