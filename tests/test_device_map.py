"""The layer-split planner: byte counts against loaded models and hand formulas, decisions on 7B/13B/70B shapes,
errors that name the device and the shortfall, and the command-line wiring (with a fake hardware probe)."""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from kobold_backend.cli.split import add_split_arguments, parse_gpu_split, split_from_args
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.device_map import (
    GIB,
    DeviceMap,
    HardwareProbe,
    PlanError,
    Sizes,
    checkpoint_shapes,
    config_shapes,
    plan_device_map,
)
from kobold_backend.engine.load_options import LoadOptions, planned_load_options
from kobold_backend.engine.loader import load_model
from kobold_backend.errors import RequestError
from tests.fixtures.checkpoints import CheckpointFactory

LLAMA_SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab (the published configs)
    "7b": (4096, 11008, 32, 32, 32, 32000),
    "13b": (5120, 13824, 40, 40, 40, 32000),
    "33b": (6656, 17920, 60, 52, 52, 32000),
    "70b": (8192, 28672, 80, 64, 8, 32000),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
}


def llama_config(shape: str, group_size: Optional[int] = 128, act_order: bool = False) -> Dict[str, Any]:
    h, inter, layers, heads, kv, vocab = LLAMA_SHAPES[shape]
    cfg: Dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 8192, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    }
    if group_size is not None:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                      "desc_act": act_order, "sym": True}
    return cfg


def config_of(shape: str, **kw: Any) -> ModelConfig:
    return ModelConfig.from_dict(llama_config(shape, **kw))


def hand_layer_bytes(shape: str, elem: int = 2, group_size: int = 128) -> int:
    """One GPTQ decoder layer as loaded: 4-bit qweight, scales and unpacked zeros per group, two norms."""
    h, inter, _, heads, kv, _ = LLAMA_SHAPES[shape]
    d = h // heads
    mats = [(h, h), (h, kv * d), (h, kv * d), (h, h), (h, inter), (h, inter), (inter, h)]
    return sum(k * n // 2 + 2 * (k // group_size) * n * elem for k, n in mats) + 2 * h * elem


def hand_cache_bytes(shape: str, tokens: int, elem: int = 2) -> int:
    h, _, _, heads, kv, _ = LLAMA_SHAPES[shape]
    return 2 * kv * tokens * (h // heads) * elem


# ---------------------------------------------------------------------------------------------------------------
# Byte counts.


@pytest.mark.parametrize("name", ["dense_fp16", "dense_fp32", "gqa", "mistral", "gptq_act_order", "gptq8_act_order",
                                  "gptq_g-1", "gptq_v1_asym_g32"])
def test_planned_bytes_equal_the_loaded_model(name: str, checkpoints: CheckpointFactory) -> None:
    """On the CPU (float32), the plan's weight and cache bytes are exactly what load_model allocates."""
    built = checkpoints.get(name)
    lm = load_model(built.path, device="cpu", max_seq_len=96)
    dm = plan_device_map(built.path, None, 96, layer_counts={"cpu": lm.config.num_layers})
    assert dm.layer_devices == ["cpu"] * lm.config.num_layers and dm.head_device == "cpu"
    (usage,) = dm.usage
    assert usage.weight_bytes == lm.model.nbytes
    assert usage.cache_bytes == lm.model.new_cache().nbytes
    sizes = Sizes(lm.config, checkpoint_shapes(built.path), 96)
    for i, layer in enumerate(lm.model.layers):
        # q/k/v and gate/up may be fused into one wide weight at load: count whatever the layer holds.
        actual = sum(_nbytes(getattr(layer, p)) for p in layer.PROJECTIONS if getattr(layer, p) is not None)
        actual += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
        if layer.mlp_perm is not None:  # down_proj's act-order permutation, folded into gate/up (mlp_fold.py)
            actual += _nbytes(layer.mlp_perm)
        assert sizes.layer(i, 4) == actual
    assert sizes.rope(4) == _nbytes(lm.model.cos[0]) + _nbytes(lm.model.sin[0])


def _nbytes(w: Any) -> int:
    return w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


@pytest.mark.parametrize("name", ["gptq_v1_sym_g32", "gptq_act_order", "gptq_g-1", "dense_fp16", "dense_fp32"])
def test_config_shapes_match_checkpoint_headers(name: str, checkpoints: CheckpointFactory) -> None:
    """Shapes derived from a config alone are the ones the fixture writer (an independent packer) stores."""
    built = checkpoints.get(name)
    assert config_shapes(ModelConfig.from_dir(built.path)) == checkpoint_shapes(built.path)


@pytest.mark.parametrize("shape", ["7b", "13b", "70b", "llama3-8b"])
def test_layer_and_cache_bytes_follow_the_hand_formula(shape: str) -> None:
    sizes = Sizes(config_of(shape), config_shapes(config_of(shape)), 4096)
    assert sizes.layer(0, 2) == hand_layer_bytes(shape)
    assert sizes.layer(0, 4) == hand_layer_bytes(shape, elem=4)
    assert sizes.cache(2) == hand_cache_bytes(shape, 4096)
    # 7B GPTQ-128: 202,375,168 weights per layer at half a byte each, plus 4 bytes per 128-row group and column.
    if shape == "7b":
        assert sizes.layer(0, 2) == 202_375_168 // 2 + 202_375_168 // 128 * 4 + 4 * 4096


@pytest.mark.parametrize("shape, published_mib", [("7b", 5194), ("13b", 9127), ("33b", 20795)])
def test_single_gpu_total_is_close_to_exllama_measurements(shape: str, published_mib: int) -> None:
    """exllama v1's README (engine-notes 4.1): peak VRAM of GPTQ-128 models at 2048 tokens, embeddings in RAM.
    Its layout differs in details (packed zeros, its own scratch buffers), so agreement is to within 8%."""
    dm = plan_device_map(config_of(shape), {"cuda:0": 80}, 2048, embed_on_cpu=True)
    gpu = next(u for u in dm.usage if u.device == "cuda:0")
    assert dm.layers_on("cuda:0") == LLAMA_SHAPES[shape][2]
    assert abs(gpu.used_bytes / 2**20 / published_mib - 1) < 0.08, gpu.used_bytes / 2**20


# ---------------------------------------------------------------------------------------------------------------
# Decisions.

DECISIONS = [
    # shape, GB budgets, context, cpu_layers, embed_on_cpu, expected: "all-gpu" / "split" / "spill" / "error"
    ("7b", {"cuda:0": 8}, 4096, None, False, "all-gpu"),
    ("7b", {"cuda:0": 4}, 4096, None, False, "error"),
    ("7b", {"cuda:0": 4}, 4096, "auto", False, "spill"),
    ("7b", {"cuda:0": 4, "cuda:1": 4}, 4096, None, False, "split"),
    ("7b", {"cuda:0": 3, "cuda:1": 3}, 4096, None, False, "error"),
    ("7b", {"cuda:0": 6}, 4096, 8, False, "spill"),
    ("13b", {"cuda:0": 12}, 4096, None, False, "all-gpu"),
    ("13b", {"cuda:0": 6, "cuda:1": 6}, 4096, None, False, "split"),
    ("13b", {"cuda:0": 8}, 4096, "auto", True, "spill"),
    ("70b", {"cuda:0": 24, "cuda:1": 24}, 4096, None, False, "split"),
    ("70b", {"cuda:0": 17.2, "cuda:1": 24}, 2048, None, False, "split"),
    ("70b", {"cuda:0": 24}, 4096, None, False, "error"),
    ("70b", {"cuda:0": 24}, 4096, "auto", True, "spill"),
    ("70b", {"cuda:0": 80}, 8192, None, False, "all-gpu"),
    ("llama3-8b", {"cuda:0": 8}, 8192, None, False, "all-gpu"),
    ("llama3-8b", {"cuda:0": 6}, 8192, None, False, "error"),
    ("llama3-8b", {"cuda:0": 5}, 8192, "auto", False, "spill"),
]


@pytest.mark.parametrize("shape, budgets, ctx, cpu_layers, embed_on_cpu, expected", DECISIONS)
def test_planner_decisions(shape: str, budgets: Dict[str, float], ctx: int, cpu_layers: Any, embed_on_cpu: bool,
                           expected: str) -> None:
    config = config_of(shape)
    n = config.num_layers
    if expected == "error":
        last = list(budgets)[-1]
        with pytest.raises(PlanError, match=last + r" would need .* short by \d+\.\d\d GiB"):
            plan_device_map(config, budgets, ctx, cpu_layers=cpu_layers, embed_on_cpu=embed_on_cpu)
        return
    dm = plan_device_map(config, budgets, ctx, cpu_layers=cpu_layers, embed_on_cpu=embed_on_cpu)
    assert len(dm.layer_devices) == n
    assert dm.head_device == "cuda:0"
    assert dm.embed_device == ("cpu" if embed_on_cpu else "cuda:0")
    # CPU layers first, then each GPU's block in budget order.
    blocks = [d for i, d in enumerate(dm.layer_devices) if i == 0 or dm.layer_devices[i - 1] != d]
    assert blocks == sorted(set(blocks), key=lambda d: (d != "cpu", d))
    cpu = dm.layers_on("cpu")
    gpus = [d for d in budgets if dm.layers_on(d)]
    assert {"all-gpu": (cpu == 0 and len(gpus) == 1), "split": (cpu == 0 and len(gpus) > 1),
            "spill": cpu > 0}[expected], dm.describe()
    if isinstance(cpu_layers, int):
        assert cpu == cpu_layers
    per_layer = hand_layer_bytes(shape) + hand_cache_bytes(shape, ctx)
    for u in dm.usage:
        if u.device == "cpu":
            continue
        assert u.used_bytes <= budgets[u.device] * GIB, dm.describe()
        gpu_layers = len(u.layers)
        h, vocab = LLAMA_SHAPES[shape][0], LLAMA_SHAPES[shape][5]
        head = (h + vocab * h + (0 if embed_on_cpu else vocab * h)) * 2 if u.device == "cuda:0" else 0
        assert u.weight_bytes == gpu_layers * hand_layer_bytes(shape) + head
        assert u.cache_bytes == gpu_layers * hand_cache_bytes(shape, ctx)
    if cpu_layers == "auto" or cpu_layers is None:
        # Greedy fill is maximal: the last GPU holding layers has no room for one more of them.
        last = [u for u in dm.usage if u.device != "cpu" and u.layers][-1]
        if cpu:
            assert last.free_bytes is not None and last.free_bytes < per_layer, dm.describe()


def test_70b_on_two_24gb_gpus_fills_the_first_then_the_second() -> None:
    """exllama's auto_map: as many layers as fit on cuda:0 (after the head), the rest on cuda:1."""
    dm = plan_device_map(config_of("70b"), {"cuda:0": 24, "cuda:1": 24}, 4096)
    first, second = (next(u for u in dm.usage if u.device == d) for d in ("cuda:0", "cuda:1"))
    assert len(first.layers) + len(second.layers) == 80
    assert first.layers == list(range(len(first.layers)))
    assert first.holds == ["embed", "head"] and second.holds == []
    assert first.free_bytes is not None and first.free_bytes < hand_layer_bytes("70b") + hand_cache_bytes("70b", 4096)


def test_embeddings_in_ram_free_gpu_memory_for_layers() -> None:
    config = config_of("llama3-8b")  # 128256 x 4096 embeddings: 1 GiB in float16, 2 GiB in float32 on the CPU
    on_gpu = plan_device_map(config, {"cuda:0": 5}, 8192, cpu_layers="auto")
    in_ram = plan_device_map(config, {"cuda:0": 5}, 8192, cpu_layers="auto", embed_on_cpu=True)
    assert in_ram.layers_on("cuda:0") > on_gpu.layers_on("cuda:0")
    cpu = next(u for u in in_ram.usage if u.device == "cpu")
    assert "embed" in cpu.holds
    assert in_ram.load_kwargs()["embed_on_cpu"] is True


def test_no_gpu_runs_everything_on_the_cpu() -> None:
    dm = plan_device_map(config_of("7b"), {"cpu": 64}, 2048, cpu_layers="auto")
    assert dm.layer_devices == ["cpu"] * 32 and dm.head_device == "cpu" and dm.uniform
    assert dm.load_kwargs() == {"device": "cpu", "layer_devices": None, "embed_on_cpu": False, "max_seq_len": 2048,
                                "cache_dtype": "fp16"}


def test_longer_context_moves_layers_off_the_gpu() -> None:
    config = config_of("13b")
    short = plan_device_map(config, {"cuda:0": 8}, 2048, cpu_layers="auto")
    long = plan_device_map(config, {"cuda:0": 8}, 8192, cpu_layers="auto")
    assert long.layers_on("cpu") > short.layers_on("cpu")


def test_describe_lists_each_device() -> None:
    dm = plan_device_map(config_of("7b"), {"cuda:0": 4, "cpu": 32}, 4096, cpu_layers="auto")
    text = dm.describe()
    cpu_line = next(line for line in text.splitlines() if line.strip().startswith("cpu"))
    gpu_line = next(line for line in text.splitlines() if line.strip().startswith("cuda:0"))
    n_cpu = dm.layers_on("cpu")
    assert f"0-{n_cpu - 1}" in cpu_line and f"{n_cpu}-31 +embed+head" in gpu_line
    free = next(u for u in dm.usage if u.device == "cuda:0").free_bytes
    assert gpu_line.split()[-1] == "GiB" and f"{free / GIB:.2f}" in gpu_line
    assert "4096-token fp16 cache" in text


# ---------------------------------------------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("counts, message", [
    ({"cuda:0": 24, "cpu": 6}, r"add up to 30 \(cuda:0 24 \+ cpu 6\) but the model has 32 layers"),
    ({"cuda:0": 30, "cpu": 8}, r"add up to 38 .* 32 layers"),
    ({"cuda:0": 40, "cpu": -8}, r"cpu is -8; counts must be whole numbers >= 0"),
    ({"cuda:0": 31.5, "cpu": 0.5}, r"cuda:0 is 31.5"),
    ({"tpu:0": 32}, r"'tpu:0' is not a device"),
    ({"cuda:0": 16, "cuda": 16}, r"cuda:0 is given twice"),
])
def test_explicit_counts_must_add_up(counts: Dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_device_map(config_of("7b"), None, 4096, layer_counts=counts)


def test_explicit_counts_accept_united_strings_and_gpu_numbers() -> None:
    dm = plan_device_map(config_of("7b"), None, 4096, layer_counts={0: "20", "1": 4, "cpu": 8.0})
    assert dm.layer_devices == ["cpu"] * 8 + ["cuda:0"] * 20 + ["cuda:1"] * 4


def _short_by(message: str) -> float:
    return float(re.search(r"short by (\d+\.\d\d) GiB", message).group(1))  # type: ignore[union-attr]


def test_explicit_counts_over_a_gpu_budget_name_the_device_and_shortfall() -> None:
    counts = {"cuda:0": 28, "cuda:1": 4}
    unchecked = plan_device_map(config_of("7b"), None, 4096, layer_counts=counts)
    need = next(u for u in unchecked.usage if u.device == "cuda:0").used_bytes
    assert need > 4 * GIB
    with pytest.raises(PlanError) as info:
        plan_device_map(config_of("7b"), {"cuda:0": 4, "cuda:1": 4}, 4096, layer_counts=counts)
    text = str(info.value)
    assert text.startswith("cuda:0 needs") and "28 layers" in text
    assert _short_by(text) == pytest.approx((need - 4 * GIB) / GIB, abs=0.006)


def test_cpu_ram_shortfall_is_named() -> None:
    with pytest.raises(PlanError, match=r"^cpu needs .* but its budget is 8\.00 GiB: short by") as info:
        plan_device_map(config_of("13b"), {"cpu": 8}, 4096, layer_counts={"cpu": 40})
    # 40 layers in float32 alone exceed 8 GiB by roughly this much.
    floor = 40 * (hand_layer_bytes("13b", elem=4) + hand_cache_bytes("13b", 4096, elem=4)) / GIB - 8
    assert _short_by(str(info.value)) > floor


def test_auto_spill_checks_system_ram_too() -> None:
    with pytest.raises(PlanError, match=r"^cpu needs .* short by"):
        plan_device_map(config_of("70b"), {"cuda:0": 24, "cpu": 8}, 4096, cpu_layers="auto")


def test_a_head_that_does_not_fit_is_named() -> None:
    with pytest.raises(PlanError, match=r"cuda:0 cannot hold even the embeddings, norm and lm_head .* short by"):
        plan_device_map(config_of("llama3-8b"), {"cuda:0": 0.5}, 4096)


def test_error_shortfall_matches_hand_arithmetic() -> None:
    """7B at 4096 tokens on 4 GiB without offload: the shortfall is the remaining layers' hand-computed bytes
    minus the room left on the GPU."""
    with pytest.raises(PlanError) as info:
        plan_device_map(config_of("7b"), {"cuda:0": 4}, 4096)
    text = str(info.value)
    left = int(re.search(r"(\d+) of 32 layers are left", text).group(1))  # type: ignore[union-attr]
    dm = plan_device_map(config_of("7b"), {"cuda:0": 4}, 4096, cpu_layers="auto")
    assert dm.layers_on("cpu") == left
    room = next(u for u in dm.usage if u.device == "cuda:0").free_bytes
    expected = (left * (hand_layer_bytes("7b") + hand_cache_bytes("7b", 4096)) - room) / GIB
    assert _short_by(text) == pytest.approx(expected, abs=0.006)


@pytest.mark.parametrize("text, message", [("20,abc", "'abc' is not a number"), ("20,-1", "'-1' must be"),
                                           ("nan", "must be")])
def test_bad_gpu_split_text(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_gpu_split(text)


def test_gpu_split_text() -> None:
    assert parse_gpu_split("17.2, 24") == {"cuda:0": 17.2, "cuda:1": 24.0}
    assert parse_gpu_split(" AUTO ") == "auto"


# ---------------------------------------------------------------------------------------------------------------
# Command-line wiring, on 7B/13B-shaped folders whose safetensors files hold headers and no data (sparse files).

DTYPE_NAMES = {"qweight": "I32", "qzeros": "I32", "g_idx": "I32"}


def write_header_only_checkpoint(folder: Path, config: Dict[str, Any]) -> Path:
    """config.json plus a model.safetensors whose header lists every tensor and whose data is a sparse hole."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = config_shapes(ModelConfig.from_dict(config))
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        dtype = DTYPE_NAMES.get(name.rsplit(".", 1)[-1], "F16")
        size = math.prod(shape) * (4 if dtype == "I32" else 2)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return folder


@pytest.fixture(scope="module")
def big_folders(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("header_only")
    return {s: write_header_only_checkpoint(root / s, llama_config(s)) for s in ("7b", "13b")}


def test_header_only_folder_plans_like_its_config(big_folders: Dict[str, Path]) -> None:
    from_folder = plan_device_map(big_folders["13b"], {"cuda:0": 8}, 4096, cpu_layers="auto")
    from_config = plan_device_map(config_of("13b"), {"cuda:0": 8}, 4096, cpu_layers="auto")
    assert from_folder.layer_devices == from_config.layer_devices
    assert [u.used_bytes for u in from_folder.usage] == [u.used_bytes for u in from_config.usage]
    assert from_folder.name == "13b"


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--embed-on-cpu", action="store_true")
    add_split_arguments(p)
    return p.parse_args(argv)


def probe(*free_gib: float, ram_gib: Optional[float] = 64) -> HardwareProbe:
    return HardwareProbe(gpu_free=[int(g * GIB) for g in free_gib],
                         cpu_available=None if ram_gib is None else int(ram_gib * GIB))


def test_no_split_options_leave_loading_alone(big_folders: Dict[str, Path]) -> None:
    args = parse([])
    assert split_from_args(args, big_folders["7b"], 4096, probe(24)) is None
    assert args.device == "auto"


def test_gpu_split_over_two_gpus(big_folders: Dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    args = parse(["--gpu-split", "3,8"])
    with caplog.at_level("INFO", logger="kobold_backend.engine.device_map"):
        devices = split_from_args(args, big_folders["7b"], 4096, probe(24, 24))
    assert devices is not None and set(devices) == {"cuda:0", "cuda:1"}
    assert devices == sorted(devices) and 0 < devices.count("cuda:0") < 32
    assert args.device == "cuda:0"
    assert "layer split of 7b" in caplog.text and "cuda:1" in caplog.text


def test_gpu_split_naming_a_missing_gpu(big_folders: Dict[str, Path]) -> None:
    with pytest.raises(PlanError, match="cuda:1 but torch sees 1 GPU"):
        split_from_args(parse(["--gpu-split", "20,24"]), big_folders["7b"], 4096, probe(24))
    with pytest.raises(PlanError, match="torch sees no CUDA GPU"):
        split_from_args(parse(["--gpu-split", "auto"]), big_folders["7b"], 4096, probe())


def test_gpu_split_auto_uses_free_memory_and_spills_when_asked(big_folders: Dict[str, Path]) -> None:
    with pytest.raises(PlanError, match=r"cuda:0 would need .* short by"):
        split_from_args(parse(["--gpu-split", "auto"]), big_folders["13b"], 4096, probe(6))
    devices = split_from_args(parse(["--gpu-split", "auto", "--cpu-layers", "auto"]), big_folders["13b"], 4096,
                              probe(6))
    assert devices is not None and devices[0] == "cpu" and devices[-1] == "cuda:0"
    fits = split_from_args(parse(["--gpu-split", "auto"]), big_folders["13b"], 4096, probe(16))
    assert fits is None  # everything on cuda:0: plain loading


def test_cpu_layers_on_the_main_gpu(big_folders: Dict[str, Path]) -> None:
    args = parse(["--cpu-layers", "8", "--device", "cuda:1"])
    assert split_from_args(args, big_folders["7b"], 4096, probe(2, 24)) == ["cpu"] * 8 + ["cuda:1"] * 24
    assert args.device == "cuda:1"
    with pytest.raises(PlanError, match=r"^cuda:0 needs .* short by"):
        split_from_args(parse(["--cpu-layers", "8"]), big_folders["7b"], 4096, probe(2))
    with pytest.raises(PlanError, match=r"--cpu-layers 40 but the model has 32 layers"):
        split_from_args(parse(["--cpu-layers", "40"]), big_folders["7b"], 4096, probe(24))


def test_cpu_layers_without_a_gpu_is_plain_cpu_loading(big_folders: Dict[str, Path]) -> None:
    assert split_from_args(parse(["--cpu-layers", "8"]), big_folders["7b"], 4096, probe()) is None
    with pytest.raises(PlanError, match="--device cpu"):
        split_from_args(parse(["--gpu-split", "8", "--device", "cpu"]), big_folders["7b"], 4096, probe(24))


def test_system_ram_is_checked_for_cpu_layers(big_folders: Dict[str, Path]) -> None:
    with pytest.raises(PlanError, match=r"^cpu needs .* short by"):
        split_from_args(parse(["--cpu-layers", "24"]), big_folders["13b"], 4096, probe(24, ram_gib=4))
    unknown_ram = split_from_args(parse(["--cpu-layers", "24"]), big_folders["13b"], 4096, probe(24, ram_gib=None))
    assert unknown_ram is not None and unknown_ram.count("cpu") == 24


def test_united_layer_sliders(big_folders: Dict[str, Path]) -> None:
    """United's sliders go through the same memory-checked plan as --gpu-split/--cpu-layers."""

    def united(values: Dict[str, Any], folder: Path, *free_gib: float) -> LoadOptions:
        gpus = [f"GPU {i}" for i in range(len(free_gib))]
        return planned_load_options(values, folder, gpus=gpus, probe=probe(*free_gib))

    values = {"0_Layers": "20", "1_Layers": "4", "CPU_Layers": "8", "max_ctx": 2048, "embed_on_cpu": False}
    opts = united(values, big_folders["7b"], 24, 24)
    assert opts.layer_devices == ["cpu"] * 8 + ["cuda:0"] * 20 + ["cuda:1"] * 4
    assert opts.device == "cuda:0" and opts.max_seq_len == 2048
    opts = united({"0_Layers": 32, "CPU_Layers": 0}, big_folders["7b"], 24)
    assert (opts.device, opts.layer_devices) == ("cuda:0", None)
    with pytest.raises(RequestError, match="add up to 31"):
        united({"0_Layers": 23, "CPU_Layers": 8}, big_folders["7b"], 24)
    with pytest.raises(PlanError, match=r"^cuda:0 needs"):
        united({"0_Layers": 40, "max_ctx": 4096}, big_folders["13b"], 6)
    fits = united({"0_Layers": 16, "CPU_Layers": 24, "max_ctx": 4096}, big_folders["13b"], 24)
    assert fits.layer_devices == ["cpu"] * 24 + ["cuda:0"] * 16
    with pytest.raises(PlanError, match=r"^cpu needs .* short by"):
        planned_load_options({"0_Layers": 16, "CPU_Layers": 24, "max_ctx": 4096}, big_folders["13b"],
                             gpus=["GPU 0"], probe=probe(24, ram_gib=4))


def test_plan_has_a_load_kwargs_view() -> None:
    dm: DeviceMap = plan_device_map(config_of("7b"), None, 4096, layer_counts={"cuda:1": 24, "cpu": 8})
    kwargs = dm.load_kwargs()
    assert kwargs["device"] == "cuda:1"
    assert kwargs["layer_devices"] == ["cpu"] * 8 + ["cuda:1"] * 24
    assert kwargs["max_seq_len"] == 4096
