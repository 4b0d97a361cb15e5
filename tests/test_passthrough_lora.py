"""The `lora` passthrough action against the peft library: adapters made with LoraConfig + get_peft_model and
saved with save_pretrained, compared with peft's merged model; scales, rsLoRA, rank_pattern, several adapters,
the adapter cache, untouched base weights, and the adapters this engine refuses."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.passthrough import PassthroughConfig, build_passthrough
from kobold_backend.errors import RequestError
from tests.fixtures.checkpoints import BuiltCheckpoint, CheckpointFactory
from tests.fixtures.hf_oracle import hf_load, prompt_ids, row_rel_err
from tests.test_passthrough import HFSteering, ours_logits, random_vectors

RTOL = 1e-4
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, **lora_kwargs: object) -> Path:
    """A peft LoRA adapter on the checkpoint at `base` with random nonzero A and B, saved with save_pretrained."""
    kwargs = dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    kwargs.update(lora_kwargs)
    model = get_peft_model(hf_load(base), LoraConfig(**kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.save_pretrained(str(out))
    assert (out / "adapter_model.safetensors").is_file()
    return out


def peft_merged(base: Path, adapters: Dict[str, Path], scales: Optional[Dict[str, float]] = None) -> torch.nn.Module:
    """peft's own loading of the saved adapters, scaled with LoraLayer.set_scale and merged into the weights."""
    names = list(adapters)
    model = PeftModel.from_pretrained(hf_load(base), str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, scale in (scales or {}).items():
                module.set_scale(name, scale)
    return model.merge_and_unload(adapter_names=names).eval()


def _layer_tensors(lm: LoadedModel) -> List[torch.Tensor]:
    return [w for layer in lm.model.layers for w in (getattr(layer, n) for n in type(layer).PROJECTIONS)
            if isinstance(w, torch.Tensor)]


@pytest.fixture(scope="module")
def built(checkpoints: CheckpointFactory) -> BuiltCheckpoint:
    return checkpoints.get("dense_fp32")


@pytest.fixture(scope="module")
def lm(built: BuiltCheckpoint) -> LoadedModel:
    return load_model(built.path, device="cpu")


@pytest.fixture(scope="module")
def lora_dir(built: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    make_adapter(built.oracle_path, root / "a1", seed=1)
    make_adapter(built.oracle_path, root / "a2", seed=2, r=2, lora_alpha=3, use_rslora=True,
                 target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 3})
    return root


@pytest.fixture
def config(lora_dir: Path) -> PassthroughConfig:
    return PassthroughConfig(lora_dir=lora_dir)


def test_lora_matches_peft_merged_and_leaves_base_weights(lm, built, lora_dir, config) -> None:
    ids = prompt_ids(built, 20, seed=1)
    before = [t.clone() for t in _layer_tensors(lm)]
    plain = ours_logits(lm, ids, None)
    pt = build_passthrough({"lora": [{"name": "a1"}]}, lm.model, config)
    ours = ours_logits(lm, ids, pt)
    with torch.no_grad():
        ref = peft_merged(built.oracle_path, {"a1": lora_dir / "a1"})(ids).logits
    assert row_rel_err(ours, plain) > 1e-2, "the adapter must change the logits for the test to mean anything"
    assert row_rel_err(ours, ref) < RTOL
    assert all(torch.equal(a, b) for a, b in zip(_layer_tensors(lm), before))
    assert torch.equal(ours_logits(lm, ids, None), plain)


def test_two_scaled_adapters_with_rslora_and_rank_pattern_match_peft(lm, built, lora_dir, config) -> None:
    a2 = load_file(str(lora_dir / "a2" / "adapter_model.safetensors"))
    assert {tuple(t.shape) for k, t in a2.items() if "v_proj.lora_A" in k} == {(3, 64)}
    ids = prompt_ids(built, 18, seed=2)
    spec = {"lora": [{"name": "a1", "scale": 0.5}, {"name": "a2", "scale": -0.8}]}
    ours = ours_logits(lm, ids, build_passthrough(spec, lm.model, config))
    with torch.no_grad():
        ref = peft_merged(built.oracle_path, {"a1": lora_dir / "a1", "a2": lora_dir / "a2"},
                          {"a1": 0.5, "a2": -0.8})(ids).logits
        only_a1 = peft_merged(built.oracle_path, {"a1": lora_dir / "a1"}, {"a1": 0.5})(ids).logits
    assert row_rel_err(ref, only_a1) > 1e-3
    assert row_rel_err(ours, ref) < RTOL


def test_lora_with_steer_matches_peft_with_a_hook(lm, built, lora_dir, config) -> None:
    vec = random_vectors([1], 64, seed=3)[1]
    ids = prompt_ids(built, 16, seed=3)
    spec = {"lora": {"name": "a2"}, "steer": {"vector": vec.tolist(), "strength": 2.0, "layers": [1]}}
    ours = ours_logits(lm, ids, build_passthrough(spec, lm.model, config))
    merged = peft_merged(built.oracle_path, {"a2": lora_dir / "a2"})
    with HFSteering(merged, {1: 2.0 * vec}), torch.no_grad():
        ref = merged(ids).logits
    assert row_rel_err(ours, ref) < RTOL


def test_adapters_are_loaded_once_and_evicted_lru(lm, lora_dir, tmp_path) -> None:
    config = PassthroughConfig(lora_dir=lora_dir, lora_cache_size=1)
    first = build_passthrough({"lora": [{"name": "a1"}]}, lm.model, config)
    again = build_passthrough({"lora": [{"name": "a1", "scale": 2.0}]}, lm.model, config)
    key = (0, "q_proj")
    assert first.actions["lora"].by_target[key][0][0] is again.actions["lora"].by_target[key][0][0]
    assert len(config.lora_cache) == 1
    build_passthrough({"lora": [{"name": "a2"}]}, lm.model, config)
    third = build_passthrough({"lora": [{"name": "a1"}]}, lm.model, config)
    assert len(config.lora_cache) == 1
    assert third.actions["lora"].by_target[key][0][0] is not first.actions["lora"].by_target[key][0][0]


def _variant(lora_dir: Path, root: Path, name: str, config_changes: Dict[str, object],
             drop: Optional[List[str]] = None) -> None:
    dst = root / name
    shutil.copytree(lora_dir / "a1", dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    for f in drop or []:
        (dst / f).unlink()


@pytest.fixture(scope="module")
def bad_dir(built: BuiltCheckpoint, checkpoints: CheckpointFactory, lora_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad_lora")
    _variant(lora_dir, root, "fan", {"fan_in_fan_out": True})
    _variant(lora_dir, root, "dora", {"use_dora": True})
    _variant(lora_dir, root, "bias", {"bias": "all"})
    _variant(lora_dir, root, "saves", {"modules_to_save": ["lm_head"]})
    _variant(lora_dir, root, "alphas", {"alpha_pattern": {"q_proj": 16}})
    _variant(lora_dir, root, "prefix", {"peft_type": "PREFIX_TUNING"})
    _variant(lora_dir, root, "noconfig", {}, drop=["adapter_config.json"])
    _variant(lora_dir, root, "bin", {}, drop=["adapter_model.safetensors"])
    (root / "bin" / "adapter_model.bin").write_bytes(b"pickle")
    make_adapter(built.oracle_path, root / "head", seed=4, target_modules=["q_proj", "lm_head"])
    # An adapter made for a model with 2 KV heads: its k_proj/v_proj B matrices have 32 rows, not 64.
    make_adapter(checkpoints.get("gqa").oracle_path, root / "gqa", seed=5)
    _variant(lora_dir, root, "deep", {})
    tensors = load_file(str(root / "deep" / "adapter_model.safetensors"))
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, str(root / "deep" / "adapter_model.safetensors"))
    _variant(lora_dir, root, "half", {})
    tensors = load_file(str(root / "half" / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "layers.0.mlp.up_proj.lora_B" not in k},
              str(root / "half" / "adapter_model.safetensors"))
    return root


BAD = [
    ("fan", "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported"),
    ("dora", "DoRA adapters (use_dora) are not supported"),
    ("bias", "bias='all' is not supported"),
    ("saves", "modules_to_save (['lm_head']) replaces whole modules"),
    ("alphas", "per-module alpha_pattern is not supported"),
    ("prefix", "peft_type is PREFIX_TUNING; only LORA adapters are supported"),
    ("noconfig", "adapter_config.json is missing"),
    ("bin", "only adapter_model.bin is present; convert it to adapter_model.safetensors"),
    ("head", "targets a module kobold_backend cannot apply LoRA to"),
    ("gqa", "layer 0 k_proj: lora_A [4, 64] and lora_B [32, 4] do not fit a [64, 64] projection"),
    ("deep", "is for layer 7 but the model has 2 layers"),
    ("half", "layer 0 up_proj has lora_A but not both lora_A and lora_B"),
]


@pytest.mark.parametrize("name, message", BAD, ids=[b[0] for b in BAD])
def test_unsupported_adapters_are_refused(lm, bad_dir, name, message) -> None:
    with pytest.raises(RequestError) as info:
        build_passthrough({"lora": [{"name": name}]}, lm.model, PassthroughConfig(lora_dir=bad_dir))
    assert info.value.field == "passthrough.lora[0].name"
    assert f"LoRA adapter {name!r}: " in str(info.value) and message in str(info.value)


def test_adapter_names_stay_inside_the_lora_folder(lm, lora_dir, tmp_path) -> None:
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "link").symlink_to(lora_dir / "a1")
    config = PassthroughConfig(lora_dir=tmp_path / "lora")
    for name, message in [("../lora", "no absolute paths or '..'"), (str(lora_dir / "a1"), "no absolute paths"),
                          ("link", "'link' leads outside the LoRA adapter folder")]:
        with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build_passthrough({"lora": {"name": name}}, lm.model, config)


def _assert_one_adapter_matches_peft(model: LoadedModel, ids: torch.Tensor, lora_dir: Path, name: str,
                                     oracle: Path) -> None:
    """Adapter `name` of `lora_dir` through the passthrough changes the logits and matches peft merged into the
    dense checkpoint `oracle`."""
    pt = build_passthrough({"lora": [{"name": name}]}, model.model, PassthroughConfig(lora_dir=lora_dir))
    ours = ours_logits(model, ids, pt)
    with torch.no_grad():
        ref = peft_merged(oracle, {name: lora_dir / name})(ids).logits
    assert row_rel_err(ours, ours_logits(model, ids, None)) > 1e-2
    assert row_rel_err(ours, ref) < RTOL


def test_adapter_on_fused_phi3_projections_matches_peft(tmp_path: Path) -> None:
    """Phi-3 checkpoints store qkv_proj and gate_up_proj fused, so PEFT adapters target those modules; their B rows
    split into the q/k/v (gate/up) deltas the engine applies to the fused weight's parts."""
    from tests.fixtures.arch_checkpoints import ARCH_BY_NAME, build_arch_checkpoint

    phi3 = build_arch_checkpoint(ARCH_BY_NAME["phi3"], tmp_path / "hf")
    make_adapter(phi3.path, tmp_path / "lora" / "fused", seed=5,
                 target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    model = load_model(phi3.path, device="cpu")
    assert model.model.layers[0].qkv_proj is not None and model.model.layers[0].gate_up_proj is not None
    ids = torch.tensor([[1, 17, 230, 44, 5, 912, 77, 3, 64, 150]])
    _assert_one_adapter_matches_peft(model, ids, tmp_path / "lora", "fused", phi3.path)


def test_adapter_on_act_order_gptq_matches_peft(checkpoints: CheckpointFactory, tmp_path: Path) -> None:
    """An act-order GPTQ model keeps its MLP intermediate in down_proj's permutation (engine/mlp_fold.py) while
    adapters address it in checkpoint order: gate/up/down deltas must still match peft on the dense weights."""
    built = checkpoints.get("gptq_act_order")
    make_adapter(built.oracle_path, tmp_path / "lora" / "mlp", seed=6, target_modules=["gate_proj", "up_proj",
                                                                                      "down_proj"])
    model = load_model(built.path, device="cpu")
    assert all(layer.mlp_perm is not None for layer in model.model.layers)
    ids = prompt_ids(built, 20, seed=2)
    _assert_one_adapter_matches_peft(model, ids, tmp_path / "lora", "mlp", built.oracle_path)
