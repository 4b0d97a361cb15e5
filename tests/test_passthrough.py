"""Passthrough steer/capture against transformers (forward hooks on model.model.layers[i], output_hidden_states),
request validation messages, the action registry and entry points, and no leak into later requests."""

from __future__ import annotations

import base64
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.passthrough import (
    ENTRY_POINT_GROUP,
    Action,
    ForwardPassthrough,
    PassthroughConfig,
    build_passthrough,
    known_actions,
    load_entry_points,
    register_action,
)
from kobold_backend.engine.passthrough import registry as registry_module
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.errors import RequestError
from tests.fixtures.checkpoints import BuiltCheckpoint, CheckpointFactory
from tests.fixtures.hf_oracle import hf_load, hf_step, prompt_ids, row_rel_err

NAME = "dense_fp32"
RTOL = 1e-4
GREEDY = SamplerSettings(top_k=1)


# ---- helpers shared with the other test_passthrough_* files ----------------------------------------------------


def write_gguf_vector(path: Path, directions: Dict[int, torch.Tensor], arch: str = "controlvector") -> Path:
    """What repeng's ControlVector.export_gguf writes, through the gguf package's own writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    writer.add_uint32(f"{arch}.layer_count", len(directions))
    for layer, vec in directions.items():
        writer.add_tensor(f"direction.{layer}", vec.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def layer_output(out: Any) -> torch.Tensor:
    """A transformers decoder layer returns a tensor (v5) or a tuple whose first item is the hidden state."""
    return out[0] if isinstance(out, tuple) else out


def with_layer_output(out: Any, hidden: torch.Tensor) -> Any:
    return (hidden,) + tuple(out[1:]) if isinstance(out, tuple) else hidden


class HFSteering:
    """Forward hooks adding strength * vector to output[0] of model.model.layers[i] (repeng's ControlModule)."""

    def __init__(self, hf: torch.nn.Module, vectors: Dict[int, torch.Tensor], normalize: bool = False) -> None:
        self.handles = []
        for index, vec in vectors.items():
            self.handles.append(hf.model.layers[index].register_forward_hook(self._hook(vec, normalize)))

    @staticmethod
    def _hook(vec: torch.Tensor, normalize: bool) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            h = layer_output(out)
            steered = h + vec
            if normalize:
                steered = steered / steered.norm(dim=-1, keepdim=True) * h.norm(dim=-1, keepdim=True)
            return with_layer_output(out, steered)

        return hook

    def __enter__(self) -> HFSteering:
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()


def ours_logits(lm: LoadedModel, ids: torch.Tensor, passthrough: Optional[Any]) -> torch.Tensor:
    return lm.model.forward(ids, lm.model.new_cache(max_seq_len=64), passthrough=passthrough, last_only=False)


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor, n: int) -> List[int]:
    logits, past = hf_step(hf, prompt, None)
    tokens: List[int] = []
    for _ in range(n):
        tokens.append(int(logits[0, -1].argmax()))
        logits, past = hf_step(hf, torch.tensor([[tokens[-1]]]), past)
    return tokens


def greedy(gen: Generator, prompt: List[int], n: int, passthrough: Optional[Any] = None) -> List[int]:
    req = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, settings=GREEDY, passthrough=passthrough)
    return gen.generate(req).token_ids


def decode_capture(entry: Dict[str, Any]) -> torch.Tensor:
    dtype = {"float16": np.float16, "float32": np.float32}[entry["dtype"]]
    data = np.frombuffer(base64.b64decode(entry["data"]), dtype=np.dtype(dtype).newbyteorder("<"))
    return torch.from_numpy(data.astype(np.float32).reshape(entry["shape"]))


@pytest.fixture(scope="module")
def built(checkpoints: CheckpointFactory) -> BuiltCheckpoint:
    return checkpoints.get(NAME)


@pytest.fixture(scope="module")
def lm(built: BuiltCheckpoint) -> LoadedModel:
    return load_model(built.path, device="cpu")


@pytest.fixture(scope="module")
def hf(built: BuiltCheckpoint) -> torch.nn.Module:
    return hf_load(built.oracle_path)


@pytest.fixture
def config(tmp_path: Path) -> PassthroughConfig:
    for sub in ("vectors", "lora", "captures"):
        (tmp_path / sub).mkdir()
    return PassthroughConfig(vectors_dir=tmp_path / "vectors", lora_dir=tmp_path / "lora",
                             capture_output_dir=tmp_path / "captures")


def random_vectors(layers: List[int], size: int, seed: int) -> Dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(size, generator=g) for i in layers}


# ---- steer ---------------------------------------------------------------------------------------------------------

def test_steer_gguf_vector_matches_transformers_hook(lm, hf, built, config) -> None:
    vecs = random_vectors([0, 1], lm.config.hidden_size, seed=1)
    write_gguf_vector(config.vectors_dir / "happy.gguf", vecs)
    ids = prompt_ids(built, 24, seed=1)
    pt = build_passthrough({"steer": {"vector": "happy", "strength": 4.0}}, lm.model, config)
    ours = ours_logits(lm, ids, pt)
    with HFSteering(hf, {i: 4.0 * v for i, v in vecs.items()}), torch.no_grad():
        ref = hf(ids).logits
    with torch.no_grad():
        plain = hf(ids).logits
    assert row_rel_err(ours, plain) > 0.1, "the steering must change the logits for the test to mean anything"
    assert row_rel_err(ours, ref) < RTOL

    # Only layer 1 of the same file, negative strength.
    pt = build_passthrough({"steer": {"vector": "happy", "strength": -2.5, "layers": [1]}}, lm.model, config)
    with HFSteering(hf, {1: -2.5 * vecs[1]}), torch.no_grad():
        ref = hf(ids).logits
    assert row_rel_err(ours_logits(lm, ids, pt), ref) < RTOL


def test_steer_inline_normalized_matches_repeng_formula(lm, hf, built, config) -> None:
    vec = random_vectors([0], lm.config.hidden_size, seed=2)[0]
    ids = prompt_ids(built, 20, seed=2)
    spec = {"steer": {"vector": vec.tolist(), "strength": 3.0, "layers": [0], "normalize": True}}
    ours = ours_logits(lm, ids, build_passthrough(spec, lm.model, config))
    with HFSteering(hf, {0: 3.0 * vec}, normalize=True), torch.no_grad():
        ref = hf(ids).logits
    with HFSteering(hf, {0: 3.0 * vec}), torch.no_grad():
        unnormalized = hf(ids).logits
    assert row_rel_err(ref, unnormalized) > 1e-2
    assert row_rel_err(ours, ref) < RTOL


def test_steer_safetensors_file_and_list_of_entries_sum(lm, hf, built, config) -> None:
    h = lm.config.hidden_size
    file_vecs = random_vectors([0, 1], h, seed=3)
    save_file({f"direction.{i}": v for i, v in file_vecs.items()}, str(config.vectors_dir / "calm.safetensors"))
    inline = random_vectors([1], h, seed=4)[1]
    spec = {"steer": [{"vector": "calm", "strength": 2.0, "layers": [0, 1]},
                      {"vector": inline.tolist(), "strength": -1.5, "layers": 1}]}
    ids = prompt_ids(built, 18, seed=3)
    ours = ours_logits(lm, ids, build_passthrough(spec, lm.model, config))
    with HFSteering(hf, {0: 2.0 * file_vecs[0], 1: 2.0 * file_vecs[1] - 1.5 * inline}), torch.no_grad():
        ref = hf(ids).logits
    assert row_rel_err(ours, ref) < RTOL


def test_steer_through_the_generator_matches_transformers_greedy(lm, hf, built, config) -> None:
    vecs = random_vectors([0, 1], lm.config.hidden_size, seed=5)
    write_gguf_vector(config.vectors_dir / "v.gguf", vecs)
    prompt = prompt_ids(built, 12, seed=5)
    gen = Generator(lm.model, lm.tokenizer, use_graphs=False)
    pt = build_passthrough({"steer": {"vector": "v.gguf", "strength": 3.0}}, lm.model, config)
    ours = greedy(gen, prompt[0].tolist(), 16, pt)
    with HFSteering(hf, {i: 3.0 * v for i, v in vecs.items()}):
        ref = hf_greedy(hf, prompt, 16)
    assert ours == ref
    assert ours != hf_greedy(hf, prompt, 16)


# ---- capture -------------------------------------------------------------------------------------------------------

def test_capture_matches_output_hidden_states(lm, hf, built, config) -> None:
    ids = prompt_ids(built, 22, seed=6)
    last = lm.config.num_layers - 1
    spec = {"capture": {"layers": list(range(lm.config.num_layers)), "positions": "all", "dtype": "float32"}}
    pt = build_passthrough(spec, lm.model, config)
    ours_logits(lm, ids, pt)
    res = pt.results()["capture"]
    assert res["layers"] == [0, 1] and set(res) >= {"prompt"} and "generated" not in res
    block_out: Dict[int, torch.Tensor] = {}
    handle = hf.model.layers[last].register_forward_hook(
        lambda m, a, out: block_out.__setitem__(last, layer_output(out).clone()))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    handle.remove()
    assert len(hs) == lm.config.num_layers + 1
    for layer in range(last):  # hidden_states[i + 1] is the output of block i (before the last)
        entry = res["prompt"][str(layer)]
        assert entry["shape"] == [1, 22, lm.config.hidden_size] and entry["positions"] == list(range(22))
        assert row_rel_err(decode_capture(entry), hs[layer + 1]) < RTOL
    # transformers puts the final norm into its last hidden_states entry; the block's own output comes from a hook.
    assert row_rel_err(decode_capture(res["prompt"][str(last)]), block_out[last]) < RTOL

    # Default: float16, last position only.
    pt = build_passthrough({"capture": {"layers": [0]}}, lm.model, config)
    ours_logits(lm, ids, pt)
    entry = pt.results()["capture"]["prompt"]["0"]
    assert entry["dtype"] == "float16" and entry["shape"] == [1, 1, 64] and entry["positions"] == [21]
    assert torch.allclose(decode_capture(entry), hs[1][:, -1:], rtol=1e-3, atol=1e-3)


def test_capture_generated_tokens_match_transformers(lm, hf, built, config) -> None:
    prompt = prompt_ids(built, 10, seed=7)
    gen = Generator(lm.model, lm.tokenizer, use_graphs=False)
    spec = {"capture": {"layers": [0], "phase": ["prompt", "generated"], "dtype": "float32"}}
    pt = build_passthrough(spec, lm.model, config)
    tokens = greedy(gen, prompt[0].tolist(), 8, pt)
    res = pt.results()["capture"]
    full = torch.cat([prompt, torch.tensor([tokens[:-1]])], 1)  # the last sampled token is never fed
    with torch.no_grad():
        hs = hf(full, output_hidden_states=True).hidden_states[1]
    assert res["prompt"]["0"]["positions"] == [9]
    assert row_rel_err(decode_capture(res["prompt"]["0"]), hs[:, 9:10]) < RTOL
    gen_entry = res["generated"]["0"]
    assert gen_entry["positions"] == list(range(10, 17)) and gen_entry["shape"] == [1, 7, 64]
    assert row_rel_err(decode_capture(gen_entry), hs[:, 10:17]) < RTOL


def test_capture_phase_follows_begin_for_a_one_token_chunk(lm, config) -> None:
    """With the prompt length known, a one-token forward inside the prompt counts as prompt."""
    pt = build_passthrough({"capture": {"layers": [1], "positions": "all", "phase": ["prompt", "generated"]}},
                           lm.model, config)
    pt.begin(3)
    cache = lm.model.new_cache(max_seq_len=16)
    lm.model.forward(torch.tensor([[1, 5, 6]]), cache, passthrough=pt)
    lm.model.forward(torch.tensor([[7]]), cache, passthrough=pt)
    res = pt.results()["capture"]
    assert res["prompt"]["1"]["positions"] == [0, 1, 2] and res["generated"]["1"]["positions"] == [3]


def test_capture_after_steer_sees_the_steered_stream(lm, hf, built, config) -> None:
    vec = random_vectors([0], lm.config.hidden_size, seed=8)[0]
    ids = prompt_ids(built, 15, seed=8)
    spec = {"steer": {"vector": vec.tolist(), "strength": 2.0, "layers": [0]},
            "capture": {"layers": [0], "positions": "all", "dtype": "float32"}}
    pt = build_passthrough(spec, lm.model, config)
    ours_logits(lm, ids, pt)
    seen: List[torch.Tensor] = []
    with torch.no_grad():  # transformers v5 installs its hidden_states hooks on first use: before the steering hook
        hf(ids[:, :2], output_hidden_states=True)
    with HFSteering(hf, {0: 2.0 * vec}), torch.no_grad():
        # transformers v5 records hidden_states with its own hooks, which run before the steering hook:
        # a hook registered after it sees the steered output.
        handle = hf.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(layer_output(out).clone()))
        plain = hf(ids, output_hidden_states=True).hidden_states[1]
        handle.remove()
    captured = decode_capture(pt.results()["capture"]["prompt"]["0"])
    assert row_rel_err(captured, seen[0]) < RTOL
    assert row_rel_err(seen[0] - 2.0 * vec, plain) < RTOL


def test_capture_written_to_file_atomically(lm, built, config) -> None:
    ids = prompt_ids(built, 9, seed=9)
    inline = build_passthrough({"capture": {"layers": [0, 1], "positions": "all"}}, lm.model, config)
    ours_logits(lm, ids, inline)
    to_file = build_passthrough({"capture": {"layers": [0, 1], "positions": "all", "output": "run1"}},
                                lm.model, config)
    ours_logits(lm, ids, to_file)
    res = to_file.results()["capture"]
    assert res["file"] == "run1.safetensors" and "data" not in res["prompt"]["0"]
    assert sorted(p.name for p in config.capture_output_dir.iterdir()) == ["run1.safetensors"]
    saved = load_file(str(config.capture_output_dir / "run1.safetensors"))
    for layer in ("0", "1"):
        expected = decode_capture(inline.results()["capture"]["prompt"][layer])
        assert saved[f"prompt.{layer}"].dtype == torch.float16
        assert torch.equal(saved[f"prompt.{layer}"].float(), expected)
        assert saved[f"prompt.{layer}.positions"].tolist() == list(range(9))


# ---- validation ----------------------------------------------------------------------------------------------------

def _vector_files(config: PassthroughConfig, tmp_path: Path) -> None:
    write_gguf_vector(config.vectors_dir / "short.gguf", {0: torch.ones(32)})
    write_gguf_vector(config.vectors_dir / "deep.gguf", {0: torch.ones(64), 5: torch.ones(64)})
    write_gguf_vector(config.vectors_dir / "layer1.gguf", {1: torch.ones(64)})
    write_gguf_vector(config.vectors_dir / "model.gguf", {0: torch.ones(64)}, arch="llama")
    (config.vectors_dir / "garbage.safetensors").write_bytes(b"not a tensor file")
    outside = write_gguf_vector(tmp_path / "outside.gguf", {0: torch.ones(64)})
    (config.vectors_dir / "escape.gguf").symlink_to(outside)


H64 = [0.5] * 64
INVALID = [
    ("not-a-dict", "passthrough", "passthrough must be an object of named actions"),
    ({}, "passthrough", "passthrough names no action; known actions: capture, lora, steer"),
    ({"bogus": {}}, "passthrough.bogus", "unknown passthrough action 'bogus'; known actions: capture, lora, steer"),
    ({"steer": 3}, "passthrough.steer", "must be an object, not a number"),
    ({"steer": []}, "passthrough.steer", "must not be an empty list"),
    ({"steer": {"strength": 1}}, "passthrough.steer", "needs 'vector'"),
    ({"steer": {"vector": H64, "layers": [0], "sign": 1}}, "passthrough.steer", "unknown key 'sign'"),
    ({"steer": {"vector": H64, "layers": [0], "strength": "4"}}, "passthrough.steer.strength",
     "must be a number, not a string"),
    ({"steer": {"vector": H64, "layers": [0], "normalize": 1}}, "passthrough.steer.normalize",
     "must be true or false"),
    ({"steer": {"vector": H64, "layers": [0, 2]}}, "passthrough.steer.layers[1]",
     "layer 2 is out of range; this model has layers 0..1"),
    ({"steer": {"vector": H64, "layers": [-1]}}, "passthrough.steer.layers[0]", "layer -1 is out of range"),
    ({"steer": {"vector": H64, "layers": [True]}}, "passthrough.steer.layers[0]", "must be a layer index"),
    ({"steer": {"vector": H64, "layers": []}}, "passthrough.steer.layers", "must list at least one layer"),
    ({"steer": {"vector": [0.5] * 63, "layers": [0]}}, "passthrough.steer.vector",
     "has 63 numbers but the model's hidden size is 64"),
    ({"steer": {"vector": [0.5] * 63 + ["x"], "layers": [0]}}, "passthrough.steer.vector",
     "item 63 must be a number"),
    ({"steer": {"vector": [0.5] * 63 + [float("nan")], "layers": [0]}}, "passthrough.steer.vector",
     "non-finite"),
    ({"steer": {"vector": [0.5] * 200, "layers": [0]}}, "passthrough.steer.vector",
     "an inline vector may hold at most 100 numbers, not 200"),
    ({"steer": {"vector": H64}}, "passthrough.steer.layers", "an inline vector needs 'layers'"),
    ({"steer": {"vector": 7}}, "passthrough.steer.vector", "must be a control-vector name or a list of floats"),
    ({"steer": [{"vector": H64, "layers": [0]}, {"vector": "short"}]}, "passthrough.steer[1].vector",
     "control vector 'short' has length 32 (direction.0) but the model's hidden size is 64"),
    ({"steer": {"vector": "deep"}}, "passthrough.steer.vector",
     "control vector 'deep' has direction.5 but this model has layers 0..1"),
    ({"steer": {"vector": "layer1", "layers": [0]}}, "passthrough.steer.layers",
     "control vector 'layer1' has no direction for layer 0 (it has 1)"),
    ({"steer": {"vector": "model"}}, "passthrough.steer.vector",
     "general.architecture is 'llama', not 'controlvector'"),
    ({"steer": {"vector": "garbage"}}, "passthrough.steer.vector", "control vector 'garbage': neither a GGUF"),
    ({"steer": {"vector": "../outside.gguf"}}, "passthrough.steer.vector", "(no absolute paths or '..')"),
    ({"steer": {"vector": "/etc/passwd"}}, "passthrough.steer.vector", "(no absolute paths or '..')"),
    ({"steer": {"vector": "escape"}}, "passthrough.steer.vector", "'escape' leads outside the control-vector folder"),
    ({"steer": {"vector": "sad"}}, "passthrough.steer.vector", "no control-vector named 'sad' on this server"),
    ({"steer": [{"vector": H64, "layers": [0]}] * 3}, "passthrough.steer",
     "has 3 entries; this server allows at most 2"),
    ({"capture": {"positions": "all"}}, "passthrough.capture.layers", "needs 'layers'"),
    ({"capture": {"layers": [0], "positions": "first"}}, "passthrough.capture.positions",
     "must be one of 'last', 'all', not 'first'"),
    ({"capture": {"layers": [0], "phase": ["prompt", "decode"]}}, "passthrough.capture.phase",
     "must be one of 'prompt', 'generated'"),
    ({"capture": {"layers": [0], "phase": []}}, "passthrough.capture.phase", "must name at least one phase"),
    ({"capture": {"layers": [0], "dtype": "bfloat16"}}, "passthrough.capture.dtype", "must be one of"),
    ({"capture": {"layers": [0], "output": "../x"}}, "passthrough.capture.output", "is not a plain file name"),
    ({"capture": {"layers": [0], "output": "a/b"}}, "passthrough.capture.output", "is not a plain file name"),
    ({"capture": {"layers": [0, 1], "positions": "all"}}, "passthrough.capture",
     "may capture up to 65536 values (2 layers x 512 positions x 64); at most 10000 may be returned in the response"),
    ({"capture": {"layers": [0], "phase": "generated"}}, "passthrough.capture",
     "may capture up to 32768 values (1 layers x 512 positions x 64)"),
    ({"lora": {"scale": 1.0}}, "passthrough.lora.name", "needs 'name'"),
    ({"lora": [{"name": "nope"}]}, "passthrough.lora[0].name", "no LoRA adapter named 'nope' on this server"),
    ({"lora": [{"name": "x", "scale": None}]}, "passthrough.lora[0].scale", "must be a number, not null"),
]


@pytest.mark.parametrize("spec, field, message", INVALID, ids=[f"{i}-{c[1]}" for i, c in enumerate(INVALID)])
def test_invalid_specs_are_refused_with_their_field(lm, config, tmp_path, spec, field, message) -> None:
    _vector_files(config, tmp_path)
    config.max_inline_vector = 100
    config.max_steer_entries = 2
    config.max_capture_values_inline = 10000
    with pytest.raises(RequestError) as info:
        build_passthrough(spec, lm.model, config)
    assert info.value.field == field
    assert message in str(info.value)


def test_folders_not_configured(lm) -> None:
    bare = PassthroughConfig()
    for spec, field, message in [
        ({"steer": {"vector": "happy"}}, "passthrough.steer.vector", "this server has no control-vector folder"),
        ({"lora": [{"name": "a"}]}, "passthrough.lora[0].name", "this server has no LoRA adapter folder"),
        ({"capture": {"layers": [0], "output": "x"}}, "passthrough.capture.output",
         "this server has no capture output folder"),
    ]:
        with pytest.raises(RequestError) as info:
            build_passthrough(spec, lm.model, bare)
        assert (info.value.field, message in str(info.value)) == (field, True)


def test_capture_volume_uses_the_given_lengths(lm, config) -> None:
    config.max_capture_values_inline = 64 * 2 * 30
    spec = {"capture": {"layers": [0, 1], "positions": "all", "phase": ["prompt", "generated"]}}
    build_passthrough(spec, lm.model, config, prompt_tokens=20, max_new_tokens=10)
    with pytest.raises(RequestError, match="2 layers x 31 positions"):
        build_passthrough(spec, lm.model, config, prompt_tokens=20, max_new_tokens=11)
    # A file may hold more than the response.
    config.max_capture_values_file = 10 ** 6
    build_passthrough({"capture": dict(spec["capture"], output="big")}, lm.model, config)


# ---- registry and entry points -------------------------------------------------------------------------------------

class ShiftAction(Action):
    """Adds a constant to the residual stream after one layer (a user-defined action for the tests)."""

    def __init__(self, layer: int, shift: float) -> None:
        self.layers = [layer]
        self.shift = shift
        self.calls = 0

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> torch.Tensor:
        self.calls += 1
        return hidden + self.shift

    def results(self) -> Dict[str, Any]:
        return {"calls": self.calls}


def shift_factory(params: Any, ctx: Any) -> ShiftAction:
    if not isinstance(params, dict) or not isinstance(params.get("shift"), (int, float)):
        raise ctx.error("needs a numeric 'shift'", ".shift")
    return ShiftAction(int(params.get("layer", 0)), float(params["shift"]))


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry_module, "_registry", dict(registry_module._registry))
    monkeypatch.setattr(registry_module, "_entry_points_loaded", False)
    yield


def test_register_action_composes_with_builtins(lm, hf, built, config, isolated_registry) -> None:
    register_action("shift", shift_factory)
    assert known_actions() == ["capture", "lora", "shift", "steer"]
    with pytest.raises(ValueError, match="already registered"):
        register_action("shift", shift_factory)
    with pytest.raises(ValueError, match="must be a letter"):
        register_action("9lives", shift_factory)
    with pytest.raises(RequestError, match="needs a numeric 'shift'") as info:
        build_passthrough({"shift": {"shift": "x"}}, lm.model, config)
    assert info.value.field == "passthrough.shift.shift"

    vec = random_vectors([1], lm.config.hidden_size, seed=10)[1]
    ids = prompt_ids(built, 11, seed=10)
    pt = build_passthrough({"shift": {"shift": 0.75, "layer": 0},
                            "steer": {"vector": vec.tolist(), "layers": [1]}}, lm.model, config)
    ours = ours_logits(lm, ids, pt)
    with HFSteering(hf, {0: torch.full((64,), 0.75), 1: vec}), torch.no_grad():
        ref = hf(ids).logits
    assert row_rel_err(ours, ref) < RTOL
    assert pt.results() == {"shift": {"calls": 1}}
    assert pt.eager is True and isinstance(pt, ForwardPassthrough)


def test_entry_point_actions_are_registered(lm, config, tmp_path, monkeypatch, isolated_registry) -> None:
    """A distribution on sys.path declaring [kobold_backend.passthrough] is found via importlib.metadata."""
    site = tmp_path / "site"
    pkg = site / "kb_plugin_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from tests.test_passthrough import shift_factory

        def broken(params, ctx):
            raise RuntimeError
    """))
    info = site / "kb_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kb-plugin-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nplugin_shift = kb_plugin_demo:shift_factory\nsteer = kb_plugin_demo:broken\n"
        "missing = kb_plugin_demo:no_such_thing\n")
    monkeypatch.syspath_prepend(str(site))
    load_entry_points(force=True)
    assert "plugin_shift" in known_actions() and "missing" not in known_actions()
    assert registry_module._registry["steer"] is not sys.modules["kb_plugin_demo"].broken
    pt = build_passthrough({"plugin_shift": {"shift": 1.0}}, lm.model, config)
    lm.model.forward(torch.tensor([[1, 2, 3]]), lm.model.new_cache(max_seq_len=8), passthrough=pt)
    assert pt.results() == {"plugin_shift": {"calls": 1}}


# ---- no leak into later requests -----------------------------------------------------------------------------------

def test_passthrough_never_affects_a_later_request(lm, built, config) -> None:
    vecs = random_vectors([0, 1], lm.config.hidden_size, seed=11)
    write_gguf_vector(config.vectors_dir / "strong.gguf", vecs)
    prompt = prompt_ids(built, 14, seed=11)[0].tolist()
    fresh = load_model(built.path, device="cpu")
    expected = greedy(Generator(fresh.model, fresh.tokenizer, use_graphs=False), prompt, 16)

    gen = Generator(lm.model, lm.tokenizer, use_graphs=False)
    spec = {"steer": {"vector": "strong", "strength": 4.0},
            "capture": {"layers": [1], "phase": ["prompt", "generated"]}}
    steered = greedy(gen, prompt, 16, build_passthrough(spec, lm.model, config))
    assert steered != expected
    assert greedy(gen, prompt, 16) == expected
    # A longer prompt sharing the steered prefix must not reuse the steered cache either.
    longer = prompt + [7, 8, 9]
    greedy(gen, prompt, 16, build_passthrough(spec, lm.model, config))
    assert greedy(gen, longer, 8) == greedy(Generator(fresh.model, fresh.tokenizer, use_graphs=False), longer, 8)


def test_guide_view_keeps_only_the_actions_that_change_the_computation(lm, config) -> None:
    steer = {"vector": [0.1] * 64, "layers": [0]}
    pt = build_passthrough({"capture": {"layers": [0]}, "steer": steer}, lm.model, config)
    guide = pt.guide_view()
    assert guide is not None and guide.names == ["steer"] and guide.actions["steer"] is pt.actions["steer"]
    assert build_passthrough({"capture": {"layers": [0]}}, lm.model, config).guide_view() is None
