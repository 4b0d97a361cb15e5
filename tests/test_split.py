"""Split models run the same numbers: layers over several CPU placements match the unsplit model and
transformers; on the device, a cuda:0 + cpu split decodes the same greedy tokens as all-GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from kobold_backend.bench.split import measure_split
from kobold_backend.engine.device_map import DeviceMap, plan_device_map
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.checkpoints import BuiltCheckpoint, CheckpointSpec, QuantSpec, build_checkpoint
from tests.fixtures.hf_oracle import hf_load, row_rel_err

SPLIT_SPECS = {
    "dense": CheckpointSpec("split_dense", seed=41, num_layers=4),
    "gptq": CheckpointSpec("split_gptq", seed=42, num_layers=4, num_kv_heads=2,
                           quant=QuantSpec(group_size=32, act_order=True)),
}
GREEDY = 24


@pytest.fixture(scope="module")
def split_models(fixture_root: Path) -> Dict[str, BuiltCheckpoint]:
    """Four-layer checkpoints (the shared fixtures have two or three layers), built with the shared writer."""
    root = fixture_root / "split"
    return {kind: build_checkpoint(spec, root) for kind, spec in SPLIT_SPECS.items()}


def prompt(built: BuiltCheckpoint, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, built.tokenizer_vocab_size - 3, (1, n), generator=g)
    ids[0, 0] = built.bos_token_id
    return ids


def greedy(lm: LoadedModel, ids: torch.Tensor, steps: int) -> List[int]:
    model = lm.model
    device = model.embed_tokens.device
    cache = model.new_cache(max_seq_len=64)
    logits = model.forward(ids.to(device), cache)
    out: List[int] = []
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = model.forward(torch.tensor([[out[-1]]], device=device), cache)
    return out


def load_plan(path: Path, plan: DeviceMap) -> LoadedModel:
    return load_model(path, with_tokenizer=False, **plan.load_kwargs())


@pytest.mark.parametrize("kind", list(SPLIT_SPECS))
def test_split_over_cpu_placements_matches_unsplit_and_transformers(
    kind: str, split_models: Dict[str, BuiltCheckpoint]
) -> None:
    built = split_models[kind]
    plan = plan_device_map(built.path, None, 64, layer_counts={"cpu:0": 1, "cpu:1": 2, "cpu": 1})
    assert plan.layer_devices == ["cpu:0", "cpu:1", "cpu:1", "cpu"] and not plan.uniform
    split = load_plan(built.path, plan)
    whole = load_model(built.path, device="cpu", max_seq_len=64, with_tokenizer=False)
    assert [str(layer.device) for layer in split.model.layers] == plan.layer_devices
    # One RoPE table pair per placement, shared by the layers placed there.
    assert len({id(t) for t in split.model.cos}) == 3

    ids = prompt(built, 40, seed=1)
    ours = split.model.forward(ids, split.model.new_cache(), last_only=False)
    unsplit = whole.model.forward(ids, whole.model.new_cache(), last_only=False)
    assert torch.equal(ours, unsplit)
    with torch.no_grad():
        ref = hf_load(built.oracle_path)(ids).logits
    assert row_rel_err(ours, ref) < 1e-4
    assert greedy(split, ids[:, :12], GREEDY) == greedy(whole, ids[:, :12], GREEDY)


def test_embeddings_in_ram_with_split_layers_match(split_models: Dict[str, BuiltCheckpoint]) -> None:
    built = split_models["dense"]
    plan = plan_device_map(built.path, None, 64, layer_counts={"cpu:1": 2, "cpu": 2}, embed_on_cpu=True)
    split = load_plan(built.path, plan)
    whole = load_model(built.path, device="cpu", max_seq_len=64, with_tokenizer=False)
    ids = prompt(built, 30, seed=3)
    assert torch.equal(split.model.forward(ids, split.model.new_cache(), last_only=False),
                       whole.model.forward(ids, whole.model.new_cache(), last_only=False))


# ---------------------------------------------------------------------------------------------------------------
# On the device (run with -m gpu).

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bytes_on(lm: LoadedModel, cache: Any, device: torch.device) -> int:
    """Bytes of every weight and cache tensor the model keeps on `device` (a tied head counted once)."""
    seen: Dict[int, int] = {}

    def add(w: Any) -> None:
        tensors = [w.qweight, w.scales, w.zeros, w.perm, w.bias] if isinstance(w, GPTQWeight) else [w]
        for t in tensors:
            if t is not None and t.device == device:
                seen[t.data_ptr()] = t.numel() * t.element_size()

    m = lm.model
    for layer in m.layers:
        for name in ("input_norm", "post_norm") + layer.PROJECTIONS:
            if getattr(layer, name) is not None:
                add(getattr(layer, name))
        if layer.mlp_perm is not None:  # down_proj's act-order permutation, folded into gate/up (mlp_fold.py)
            add(layer.mlp_perm)
    for w in (m.embed_tokens, m.norm, m.lm_head):
        add(w)
    for t in cache.k + cache.v:
        add(t)
    return sum(seen.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", list(SPLIT_SPECS))
@pytest.mark.parametrize("embed_on_cpu", [False, True])
@pytest.mark.parametrize("counts", [{"cpu": 2, "cuda:0": 2}, {"cpu": 1, "cuda:0": 3}])
def test_cuda_and_cpu_split_decodes_like_all_gpu(
    kind: str, embed_on_cpu: bool, counts: Dict[str, int], split_models: Dict[str, BuiltCheckpoint]
) -> None:
    built = split_models[kind]
    plan = plan_device_map(built.path, {"cuda:0": 1.0, "cpu": 4.0}, 64, layer_counts=counts,
                           embed_on_cpu=embed_on_cpu)
    split = load_plan(built.path, plan)
    all_gpu = load_model(built.path, device="cuda:0", max_seq_len=64, with_tokenizer=False)
    cpu_fp32 = load_model(built.path, device="cpu", max_seq_len=64, with_tokenizer=False)
    placed = [str(layer.device) for layer in split.model.layers]
    assert placed == ["cpu"] * counts["cpu"] + ["cuda:0"] * counts["cuda:0"]
    assert split.model.embed_tokens.device.type == ("cpu" if embed_on_cpu else "cuda")

    ids = prompt(built, 16, seed=5)
    expected = greedy(all_gpu, ids, GREEDY)
    assert greedy(split, ids, GREEDY) == expected
    assert greedy(cpu_fp32, ids, GREEDY) == expected  # the fixture is far from ties in every precision

    # The plan's GPU weight and cache bytes are exactly what the split model allocated there.
    usage = next(u for u in plan.usage if u.device == "cuda:0")
    cache = split.model.new_cache()
    assert _bytes_on(split, cache, torch.device("cuda", 0)) == usage.weight_bytes + usage.cache_bytes


@pytest.mark.gpu
@needs_gpu
def test_measure_split_runs(tmp_path: Path) -> None:
    from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq

    path = write_synthetic_gptq(tmp_path / "tiny", PRESETS["tiny"], group_size=32)
    results = [measure_split(path, n, max_seq_len=64, prompt_len=16, context=32, decode_steps=4) for n in (0, 1, 2)]
    assert [r["cpu_layers"] for r in results] == [0, 1, 2]
    for r in results:
        assert r["prompt_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert 0 < r["gpu_peak_bytes"] <= r["planned_bytes"]["cuda:0"]
