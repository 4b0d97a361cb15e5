"""United's parameter dicts (kobold_backend.engine.load_options) and settings files: the exact keys koboldai.js
reads, the "Valid Display" layer check evaluated the way the page does, saved values, and the conversion of
submitted values into load_model arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.load_options import load_options, requested_parameters
from kobold_backend.errors import RequestError
from kobold_backend.host.settings import read_settings, settings_path, write_settings
from tests.fixtures.checkpoints import CheckpointFactory

COMMON_KEYS = {"uitype", "unit", "label", "id", "default", "tooltip", "menu_path", "extra_classes",
               "refresh_model_inputs"}
UITYPES = {"slider", "toggle", "dropdown", "password", "text", "Valid Display"}
UNITS = {"int", "float", "bool", "text", "string"}


def page_check(param: Dict[str, Any], values: Dict[str, Any]) -> bool:
    """koboldai.js: a parameter with `check` is valid when (sum of check.sum values, else its own value)
    compares to check.value with "=", "!=", ">=" or "<="."""
    check = param["check"]
    value = sum(float(values[i]) for i in check["sum"]) if "sum" in check else values[param["id"]]
    op = check["check"]
    return {"=": value == check["value"], "!=": value != check["value"], ">=": value >= check["value"],
            "<=": value <= check["value"]}[op]


def defaults(params: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {p["id"]: p["default"] for p in params}


@pytest.fixture(scope="module")
def model(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("dense_bf16").path  # 3 layers


@pytest.mark.parametrize("gpus", [[], ["NVIDIA H200"], ["GPU A", "GPU B"]])
def test_keys_and_layer_check(model: Path, gpus: List[str]) -> None:
    params = requested_parameters(model, gpus=gpus)
    n = ModelConfig.from_dir(model).num_layers
    ids = [p["id"] for p in params]
    layer_ids = [f"{i}_Layers" for i in range(len(gpus))] + ["CPU_Layers"]
    assert ids == ["valid_layers", *layer_ids, "max_ctx", "compress_emb", "ntk_alpha", "cache_dtype", "kv_cache",
                   "embed_on_cpu", "threads", "speculative", "draft_model", "draft_tokens"]
    for p in params:
        assert COMMON_KEYS <= set(p), p["id"]
        assert p["uitype"] in UITYPES and p["unit"] in UNITS
        assert isinstance(p["refresh_model_inputs"], bool)
        if p["uitype"] == "slider":
            assert p["min"] <= p["default"] <= p["max"] and p["step"] > 0
        if p["uitype"] == "dropdown":
            assert p["default"] in [c["value"] for c in p["children"]]
            assert all(set(c) == {"text", "value"} for c in p["children"])
    display = params[0]
    assert display["uitype"] == "Valid Display" and "%1" in display["label"]
    assert display["check"] == {"sum": layer_ids, "value": n, "check": "="}
    values = defaults(params)
    assert page_check(display, values)
    assert values["0_Layers" if gpus else "CPU_Layers"] == n
    assert all(page_check(p, values) for p in params if "check" in p)
    values["CPU_Layers"] += 1
    assert not page_check(display, values)


def test_saved_and_submitted_values_become_defaults(model: Path) -> None:
    saved = {"0_Layers": 1, "1_Layers": 1, "CPU_Layers": 1, "max_ctx": 1024, "compress_emb": 2.0,
             "ntk_alpha": 2.5, "cache_dtype": "bfloat16", "embed_on_cpu": True}
    values = defaults(requested_parameters(model, saved, gpus=["A", "B"]))
    assert {k: values[k] for k in saved} == saved
    # a split that no longer adds up (other GPUs, other model) falls back to the default split
    values = defaults(requested_parameters(model, {"0_Layers": 7, "CPU_Layers": 0}, gpus=["A"]))
    assert (values["0_Layers"], values["CPU_Layers"]) == (3, 0)
    values = defaults(requested_parameters(model, {"max_ctx": "10", "cache_dtype": "int3"}, gpus=[]))
    assert values["max_ctx"] == 256 and values["cache_dtype"] == "auto"


def test_unusable_folder_keeps_load_disabled(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    for path in (tmp_path, None):
        params = requested_parameters(path)
        assert len(params) == 1 and params[0]["uitype"] == "Valid Display"
        assert not page_check(params[0], {})
    assert "gpt2" in requested_parameters(tmp_path)[0]["label"]


def test_load_options_from_submitted_values(model: Path) -> None:
    config = ModelConfig.from_dir(model)
    opts = load_options({"0_Layers": "1", "1_Layers": 0, "CPU_Layers": 2, "max_ctx": 512, "compress_emb": "2",
                         "ntk_alpha": 1.5, "cache_dtype": "float16", "kv_cache": "fp16", "embed_on_cpu": "true"},
                        config, gpus=["A", "B"])
    assert opts.device == "cuda:0"
    assert opts.layer_devices == ["cuda:0", "cpu", "cpu"]
    assert opts.load_kwargs() == {"device": "cuda:0", "layer_devices": ["cuda:0", "cpu", "cpu"], "max_seq_len": 512,
                                  "rope_alpha": 1.5, "compress_pos_emb": 2.0, "dtype": "float16",
                                  "embed_on_cpu": True, "cache_dtype": "fp16"}
    assert opts.values["CPU_Layers"] == 2 and opts.values["embed_on_cpu"] is True
    # everything on one device: no per-layer list
    opts = load_options({"0_Layers": 0, "1_Layers": 3, "CPU_Layers": 0}, config, gpus=["A", "B"])
    assert (opts.device, opts.layer_devices) == ("cuda:1", None)
    opts = load_options({}, config, gpus=[])
    assert (opts.device, opts.layer_devices, opts.dtype, opts.max_seq_len) == ("cpu", None, None, 512)


def test_threads_parameter_reaches_load_model(model: Path) -> None:
    """United's "threads" (0 = the engine's default) becomes load_model's `threads`; a bad one names the field."""
    config = ModelConfig.from_dir(model)
    threads = next(p for p in requested_parameters(model, gpus=[]) if p["id"] == "threads")
    assert threads["default"] == 0 and threads["min"] == 0 and threads["max"] >= 1
    assert "threads" not in load_options({}, config, gpus=[]).load_kwargs()  # the host's own setting stays
    opts = load_options({"threads": "1"}, config, gpus=[])
    assert opts.load_kwargs()["threads"] == 1 and opts.values["threads"] == 1
    with pytest.raises(RequestError, match="threads must be between 0") as err:
        load_options({"threads": -2}, config, gpus=[])
    assert err.value.field == "threads"


@pytest.mark.parametrize("values,field", [
    ({"CPU_Layers": 2}, "valid_layers"),
    ({"CPU_Layers": -1, "0_Layers": 4}, "CPU_Layers"),
    ({"max_ctx": "lots"}, "max_ctx"),
    ({"compress_emb": 0}, "compress_emb"),
    ({"cache_dtype": "int8"}, "cache_dtype"),
    ({"kv_cache": "q2"}, "kv_cache"),
])
def test_load_options_name_the_bad_field(model: Path, values: Dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as err:
        load_options(values, ModelConfig.from_dir(model), gpus=["A"])
    assert err.value.field == field


def test_settings_file_round_trip(tmp_path: Path) -> None:
    path = write_settings("org/My-Model", {"max_ctx": 4096, "CPU_Layers": 2}, tmp_path)
    assert path == tmp_path / "org_My-Model.kobold_backend.model_backend.settings"
    assert path == settings_path("org/My-Model", tmp_path)
    assert json.loads(path.read_text()) == {"max_ctx": 4096, "CPU_Layers": 2}
    assert read_settings("org/My-Model", tmp_path) == {"max_ctx": 4096, "CPU_Layers": 2}
    assert read_settings("missing", tmp_path) == {}
    path.write_text("{not json")
    assert read_settings("org/My-Model", tmp_path) == {}


def test_a_quantized_cache_is_refused_for_a_head_size_groups_of_32_do_not_divide(model: Path) -> None:
    with pytest.raises(RequestError, match="multiple of 32; this model's is 16") as err:
        load_options({"kv_cache": "q4"}, ModelConfig.from_dir(model), gpus=[])
    assert err.value.field == "kv_cache"
