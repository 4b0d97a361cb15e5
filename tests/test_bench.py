"""`kobold-backend bench` runs end to end on the CPU with a tiny synthetic checkpoint and reports every field.

No timing is asserted: speed targets live in docs/performance.md, measured on the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq
from kobold_backend.cli.main import main
from kobold_backend.engine.config import ModelConfig

FIELDS = ("prompt_tokens_per_s", "decode_tokens_per_s", "chat_turn", "copy_bandwidth_bytes_per_s",
          "roofline_tokens_per_s", "decode_fraction_of_roofline", "weights_bytes", "cache_bytes")


@pytest.mark.parametrize("act_order", [False, True])
def test_bench_tiny_cpu_writes_every_field(tmp_path: Path, act_order: bool) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--preset", "tiny", "--device", "cpu", "--compare", "--json", str(out)]
    assert main(argv + (["--act-order"] if act_order else [])) == 0
    result = json.loads(out.read_text())
    ours = result["kobold_backend"]
    for field in FIELDS:
        assert field in ours, field
    assert set(ours["prompt_tokens_per_s"]) == {"16", "64"}
    assert set(ours["decode_tokens_per_s"]) == {"16", "100"}
    assert all(v > 0 for v in ours["decode_tokens_per_s"].values())
    assert 0 < ours["chat_turn"]["ttft_s"] and ours["chat_turn"]["cached_tokens"] == 100
    assert result["act_order"] is act_order
    assert result["environment"]["torch"]
    # without a GPU the comparisons are skipped with a reason, never silently absent
    assert "skipped" in result["exllamav2"] and "skipped" in result["transformers"]


def test_bench_times_each_cache_dtype_of_a_list(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--cache-dtype fp16,q8 times the same checkpoint once per cache: one result each, each with its own cache
    bytes (the q8 cache under half the fp16 one), and a table per cache."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--device", "cpu", "--cache-dtype", "fp16,q8", "--json",
                 str(out)]) == 0
    runs = json.loads(out.read_text())["cache_dtypes"]
    assert list(runs) == ["fp16", "q8"]
    assert [r["cache_dtype"] for r in runs.values()] == ["fp16", "q8"]
    fp16, q8 = (r["kobold_backend"]["cache_bytes"] for r in runs.values())
    assert 0 < q8 < fp16 / 2  # one byte and a scale per 32 values against 2 (4 for the CPU float32 cache)
    assert all(r["kobold_backend"]["decode_tokens_per_s"]["100"] > 0 for r in runs.values())
    assert capsys.readouterr().err.count("KV cache q8") == 1


def test_synthetic_checkpoint_is_a_valid_gptq_model(tmp_path: Path) -> None:
    folder = write_synthetic_gptq(tmp_path / "m", PRESETS["tiny"], group_size=32, act_order=True, device="cpu")
    config = ModelConfig.from_dir(folder)
    assert config.quant is not None and config.quant.desc_act and config.quant.group_size == 32
    assert config.num_kv_heads == PRESETS["tiny"].kv_heads


def test_synthetic_act_order_shares_one_permutation_per_input(tmp_path: Path) -> None:
    """As in real act-order checkpoints (GPTQ orders a linear's inputs by its Hessian, a function of the input
    alone), q/k/v share one g_idx and gate/up another, so the loader fuses them; o and down keep their own."""
    from safetensors import safe_open

    from kobold_backend.engine.loader import load_model
    from kobold_backend.ops.gptq_weight import GPTQWeight

    folder = write_synthetic_gptq(tmp_path / "m", PRESETS["tiny"], group_size=32, act_order=True, device="cpu")
    g = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            g.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.0.") and "g_idx" in k})
    name = "model.layers.0.{}.g_idx".format
    qkv = [g[name(f"self_attn.{p}_proj")] for p in "qkv"]
    gate_up = [g[name(f"mlp.{p}_proj")] for p in ("gate", "up")]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2]) and torch.equal(gate_up[0], gate_up[1])
    assert not torch.equal(qkv[0], gate_up[0]) and not torch.equal(qkv[0], g[name("self_attn.o_proj")])
    trivial = torch.arange(qkv[0].numel(), dtype=torch.int32) // 32
    assert not torch.equal(qkv[0], trivial), "act-order checkpoints must permute the inputs"
    layer = load_model(folder, device="cpu", with_tokenizer=False, max_seq_len=32).model.layers[0]
    assert isinstance(layer.qkv_proj, GPTQWeight) and isinstance(layer.gate_up_proj, GPTQWeight)
    assert layer.qkv_proj.perm is not None


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "phi3", "mistral"])
def test_synthetic_checkpoint_follows_the_architecture_layout(model_type: str, tmp_path: Path) -> None:
    """Presets of any registered architecture write exactly the tensors its description names, and load."""
    from kobold_backend.bench.checkpoint import Shape
    from kobold_backend.engine.device_map import checkpoint_shapes, config_shapes
    from kobold_backend.engine.loader import load_model

    shape = Shape(128, 384, 2, 4, 2, 512, model_type=model_type, head_dim=64 if model_type == "qwen3" else None)
    folder = write_synthetic_gptq(tmp_path / model_type, shape, group_size=32, device="cpu")
    config = ModelConfig.from_dir(folder)
    assert config.model_type == model_type and config_shapes(config) == checkpoint_shapes(folder)
    lm = load_model(folder, device="cpu", with_tokenizer=False, max_seq_len=32)
    logits = lm.model.forward(torch.tensor([[1, 5, 9]]), lm.model.new_cache())
    assert torch.isfinite(logits).all()


def test_every_preset_is_a_valid_config() -> None:
    from kobold_backend.bench.checkpoint import synthetic_config

    for name, shape in PRESETS.items():
        config = ModelConfig.from_dict(synthetic_config(shape))
        assert (config.model_type, config.num_layers, config.num_kv_heads) == (shape.model_type, shape.layers,
                                                                               shape.kv_heads), name


@pytest.mark.parametrize("preset, model_type", [("tiny-gemma2", "gemma2"), ("tiny-mixtral", "mixtral")])
def test_synthetic_checkpoints_of_other_families(tmp_path: Path, preset: str, model_type: str) -> None:
    """The Gemma-2 and Mixtral presets' writer: the family's checkpoint names (per-expert GPTQ for Mixtral), one
    shard per layer with an index, a config transformers' own config class reads, and a model that runs."""
    import torch
    import transformers

    from kobold_backend.engine.loader import load_model
    from kobold_backend.engine.weights import WeightReader

    shape = PRESETS[preset]
    folder = write_synthetic_gptq(tmp_path / "m", shape, group_size=32, device="cpu")
    config = ModelConfig.from_dir(folder)
    assert config.model_type == model_type and config.quant is not None
    raw = json.loads((folder / "config.json").read_text())
    hf_config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    assert hf_config.num_hidden_layers == shape.layers
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == shape.layers + 1
    with WeightReader(folder) as reader:
        names = set(reader.names())
    if model_type == "mixtral":
        last = dict(shape.extra_config)["num_local_experts"] - 1
        assert f"model.layers.1.block_sparse_moe.experts.{last}.w2.qweight" in names
        assert "model.layers.1.block_sparse_moe.gate.weight" in names  # routers stay dense, as in GPTQ repos
    else:
        assert "model.layers.1.post_feedforward_layernorm.weight" in names and "lm_head.weight" not in names
    lm = load_model(folder, device="cpu", with_tokenizer=False, max_seq_len=32)
    logits = lm.model.forward(torch.tensor([[1, 7, 9]]), lm.model.new_cache())
    assert logits.shape == (1, 1, shape.vocab) and bool(torch.isfinite(logits).all())


def test_bench_tiny_mixtral_roofline_counts_only_routed_experts(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny-mixtral", "--device", "cpu", "--json", str(out)]) == 0
    ours = json.loads(out.read_text())["kobold_backend"]
    assert all(v > 0 for v in ours["decode_tokens_per_s"].values())
    # with 2 of 4 experts read per token, the roofline is above what reading every weight would allow
    assert ours["roofline_tokens_per_s"] > ours["copy_bandwidth_bytes_per_s"] / ours["weights_bytes"]


def test_bench_speculative_reports_every_variant(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--device", "cpu", "--speculative", "--draft-preset", "tiny",
                 "--draft-tokens", "3", "--json", str(out)]) == 0
    spec = json.loads(out.read_text())["speculation"]
    assert spec["draft_tokens"] == 3 and spec["draft_weights_bytes"] > 0
    for text in ("repetitive", "random"):
        runs = spec[text]
        assert set(runs) == {"plain", "ngram", "self_draft", "draft"}
        for name, run in runs.items():
            assert run["identical_to_plain"] and run["tokens_per_s"] > 0, (text, name)
        assert runs["self_draft"]["acceptance_rate"] == 1.0 and runs["self_draft"]["tokens_per_target_forward"] > 2
    assert set(spec["components"]["predicted_speedup"]) == {"0.5", "0.7", "0.8", "0.9"}
    assert "speculation (k=3" in capsys.readouterr().err
