"""Broken model folders: each must fail at load with a ModelFormatError whose message names its own problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch
from safetensors.torch import load_file, save_file

from kobold_backend.engine.loader import load_model
from kobold_backend.errors import ModelFormatError
from tests.fixtures.checkpoints import CheckpointFactory


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _edit_tensors(folder: Path, edit: Callable[[Dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def missing_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def missing_tensor(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def wrong_shape(folder: Path) -> None:
    def edit(t: Dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64, dtype=torch.float16)

    _edit_tensors(folder, edit)


def gpt2_model_type(folder: Path) -> None:
    _edit_json(folder / "config.json", model_type="gpt2", architectures=["GPT2LMHeadModel"])


def three_bit_gptq(folder: Path) -> None:
    _edit_json(folder / "quantize_config.json", bits=3)


def awq_gemv(folder: Path) -> None:
    (folder / "quantize_config.json").unlink()
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv", "zero_point": True}
    _edit_json(folder / "config.json", quantization_config=awq_config)


def exl2(folder: Path) -> None:
    (folder / "quantize_config.json").unlink()
    exl2_config = {"quant_method": "exl2", "version": "0.0.20", "bits": 4.65, "head_bits": 6,
                   "calibration": {"rows": 100, "length": 2048, "dataset": "(default)"}}
    _edit_json(folder / "config.json", quantization_config=exl2_config)


def gguf_only(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()
    (folder / "tiny-model.Q4_K_M.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + bytes(64))


def missing_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()


def corrupt_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 : 8 + header_len] = b"{not json" + b" " * (header_len - 9)
    path.write_bytes(bytes(data))


def missing_shard(folder: Path) -> None:
    (folder / "model-00002-of-00002.safetensors").unlink()


# case -> (fixture to break, how to break it, words the message must contain (lower case))
CASES = {
    "missing config": ("dense_fp16", missing_config, ["config.json"]),
    "missing tensor": ("dense_fp16", missing_tensor, ["model.layers.1.mlp.up_proj"]),
    "wrong shape": ("dense_fp16", wrong_shape, ["model.layers.0.self_attn.k_proj.weight", "shape"]),
    "unsupported model_type": ("dense_fp16", gpt2_model_type, ["gpt2"]),
    "3-bit GPTQ": ("gptq_v1_sym_g32", three_bit_gptq, ["3", "bits", "4 and 8"]),
    "AWQ GEMV": ("gptq_v1_sym_g32", awq_gemv, ["awq", "gemv"]),
    "EXL2": ("gptq_v1_sym_g32", exl2, ["exl2"]),
    "GGUF only": ("dense_fp16", gguf_only, ["gguf"]),
    "missing tokenizer": ("dense_fp16", missing_tokenizer, ["tokenizer"]),
    "corrupt safetensors header": ("dense_fp16", corrupt_header, ["model.safetensors"]),
    "missing shard": ("sharded", missing_shard, ["model-00002-of-00002.safetensors"]),
}


def load_error(case: str, checkpoints: CheckpointFactory, tmp_path: Path) -> str:
    base, breaker, _ = CASES[case]
    folder = tmp_path / case.replace(" ", "_")
    shutil.copytree(checkpoints.get(base).path, folder)
    breaker(folder)
    with pytest.raises(ModelFormatError) as info:
        load_model(folder, device="cpu")
    return str(info.value)


@pytest.mark.parametrize("case", list(CASES))
def test_broken_folder_names_its_problem(case: str, checkpoints: CheckpointFactory, tmp_path: Path) -> None:
    message = load_error(case, checkpoints, tmp_path)
    for word in CASES[case][2]:
        assert word.lower() in message.lower(), f"{case}: {word!r} not in {message!r}"
    assert "\n" not in message.strip() and len(message) < 400


def test_every_problem_has_its_own_message(checkpoints: CheckpointFactory, tmp_path: Path) -> None:
    messages: List[str] = [load_error(case, checkpoints, tmp_path) for case in CASES]
    assert len(set(messages)) == len(messages), messages
