"""AWQ (AutoAWQ GEMM) checkpoints: the packer in tests/fixtures/awq_pack.py, written from the format's definition,
against the library's unpacking, and whole-model logits against transformers on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kobold_backend.engine.awq import unpack_awq_cols
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.loader import load_model
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops import reference
from kobold_backend.ops.gptq_weight import GPTQWeight
from tests.fixtures.awq_pack import pack_cols, quantize, write_awq
from tests.fixtures.checkpoints import CheckpointSpec, build_checkpoint
from tests.fixtures.hf_oracle import hf_load, hf_step, row_rel_err

SPEC = CheckpointSpec("awq_source", seed=41, num_kv_heads=2, dtype="float16")


def test_unpack_inverts_the_packer() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(unpack_awq_cols(pack_cols(values)), values.to(torch.int32))


def test_weight_dequantizes_to_the_packers_values() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    packed, deq = quantize(w, 32)
    from kobold_backend.engine.awq import load_awq_linear

    class Reader(dict):
        def get(self, name, shape=None):  # type: ignore[no-untyped-def,override]
            t = self[name]
            assert shape is None or tuple(t.shape) == tuple(shape), (name, t.shape, shape)
            return t

    reader = Reader({f"p.{k}": v for k, v in packed.items()})
    quant = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
                                   "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8,
                                   "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                           "version": "gemm", "zero_point": True}}).quant
    weight = load_awq_linear(reader, "p", 128, 48, quant, torch.float32, "cpu")  # type: ignore[arg-type]
    assert isinstance(weight, GPTQWeight)
    torch.testing.assert_close(reference.gptq_dequantize(weight).t(), deq, rtol=0, atol=0)


def test_awq_model_matches_transformers(tmp_path: Path) -> None:
    hf = build_checkpoint(SPEC, tmp_path).path
    oracle = write_awq(hf, tmp_path / "awq", group=32)
    lm = load_model(tmp_path / "awq", device="cpu")
    assert lm.config.quant is not None and lm.config.quant.method == "awq"
    # as stored: 4 bits a weight plus a float16 scale and a 4-bit zero per group of 32 (float32 in memory on the
    # CPU, which the figure does not count: it is the file's, as `doctor --model` says)
    assert str(lm.weight_format) == "AWQ 4-bit g32, 4.62 bpw"
    ref_model = hf_load(oracle)
    ids = torch.tensor([[1, 15, 300, 7, 42, 99, 5, 250]])
    ours = lm.model.forward(ids, lm.model.new_cache(64), last_only=False)
    ref, _ = hf_step(ref_model, ids, None)
    assert row_rel_err(ours, ref) < 1e-4
    cache = lm.model.new_cache(64)
    logits, (ref_logits, past) = lm.model.forward(ids, cache), hf_step(ref_model, ids, None)
    for _ in range(32):
        a, b = int(logits[0, -1].argmax()), int(ref_logits[0, -1].argmax())
        assert a == b
        logits = lm.model.forward(torch.tensor([[a]]), cache)
        ref_logits, past = hf_step(ref_model, torch.tensor([[b]]), past)


@pytest.mark.parametrize("settings, message", [
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 3}, "AWQ with 3 bits is not supported"),
    ({"quant_method": "awq", "zero_point": False}, "AWQ without zero points"),
])
def test_unsupported_awq_settings_are_one_sentence(settings: dict, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        ModelConfig.from_dict({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8,
                               "quantization_config": settings})
