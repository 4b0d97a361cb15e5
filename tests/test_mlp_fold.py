"""The act-order fold (engine/mlp_fold.py): down_proj's input permutation moves into gate/up's output columns at
load, so down no longer gathers its input. Every column is summed in the same order as before, so on the CPU the
logits equal, bit for bit, those of the same checkpoint loaded without the fold (transformers is the oracle for
both in test_model_oracle.py and test_passthrough_lora.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kobold_backend.bench.checkpoint import Shape, write_synthetic_gptq
from kobold_backend.engine import loader
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.hf_oracle import prompt_ids
from tests.test_passthrough import ours_logits


def _unfolded(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> LoadedModel:
    with monkeypatch.context() as m:
        m.setattr(loader, "fold_down_permutation", lambda layer: None)
        return load_model(path, device="cpu", **kwargs)


def _check_layers(folded: LoadedModel, plain: LoadedModel) -> None:
    for a, b in zip(folded.model.layers, plain.model.layers):
        assert isinstance(b.down_proj, GPTQWeight) and b.down_proj.perm is not None and b.mlp_perm is None
        assert isinstance(a.down_proj, GPTQWeight) and a.down_proj.perm is None, "down still gathers its input"
        assert a.mlp_perm is not None and torch.equal(a.mlp_perm, b.down_proj.perm)
        assert torch.equal(a.down_proj.qweight, b.down_proj.qweight)
    # the permutation moved from down_proj to the layer: the same bytes, which the planner counts
    assert folded.model.nbytes == plain.model.nbytes


@pytest.mark.parametrize("name", ["gptq_act_order", "gptq8_act_order"])
def test_fold_drops_the_down_gather_and_keeps_the_logits(name: str, checkpoints: CheckpointFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    built = checkpoints.get(name)
    folded = load_model(built.path, device="cpu")
    plain = _unfolded(built.path, monkeypatch)
    _check_layers(folded, plain)
    ids = prompt_ids(built, 16, seed=3)
    assert torch.equal(ours_logits(folded, ids, None), ours_logits(plain, ids, None))


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_fold_with_shared_permutations_and_stored_gate_up(model_type: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Real act-order checkpoints share one permutation across gate/up (they still fuse after the fold); Phi-3
    stores gate_up_proj fused, whose two halves are both permuted."""
    shape = Shape(128, 384, 2, 4, 2, 512, model_type=model_type)
    folder = write_synthetic_gptq(tmp_path / model_type, shape, group_size=32, act_order=True, device="cpu")
    folded = load_model(folder, device="cpu", with_tokenizer=False, max_seq_len=64)
    plain = _unfolded(folder, monkeypatch, with_tokenizer=False, max_seq_len=64)
    _check_layers(folded, plain)
    assert all(isinstance(layer.gate_up_proj, GPTQWeight) for layer in folded.model.layers)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    ours, ref = ours_logits(folded, ids, None), ours_logits(plain, ids, None)
    assert ref.abs().max() > 0
    assert torch.equal(ours, ref)
