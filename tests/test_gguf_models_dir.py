"""A .gguf file is a model wherever a model folder is: listed and loaded from --models-dir (paths confined to it),
offered by the United plugin's folder check, and planned from its metadata (ModelConfig.from_dir)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kobold_backend.doctor import model_line
from kobold_backend.engine.config import ModelConfig
from kobold_backend.host.backend import check_model_folder, make_model_backend, resolve_model_path
from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.errors import ApiError
from kobold_backend.server.models import list_models, resolve_model
from tests.fixtures.checkpoints import CheckpointSpec, build_checkpoint
from tests.fixtures.gguf_files import write_gguf
from tests.server_helpers import make_holder

SPEC = CheckpointSpec("gguf_dir", seed=41, dtype="float32")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf_dir")
    hf = build_checkpoint(SPEC, root / "hf").path
    write_gguf(hf, root / "written", {"token_embd": "F16", "*": "Q8_0"})
    return root / "written" / "model.gguf"


@pytest.fixture()
def models(gguf_file: Path, tmp_path: Path) -> Path:
    models = tmp_path / "models"
    (models / "org").mkdir(parents=True)
    shutil.copy(gguf_file, models / "tiny-Q8_0.gguf")
    shutil.copy(gguf_file, models / "org" / "other.gguf")
    (models / "notes.gguf").mkdir()  # a folder named .gguf is not a model file
    (tmp_path / "outside").mkdir()
    shutil.copy(gguf_file, tmp_path / "outside" / "secret.gguf")
    os.symlink(tmp_path / "outside" / "secret.gguf", models / "link.gguf")
    return models


def test_gguf_files_are_listed_and_confined(models: Path) -> None:
    names = [m["id"] for m in list_models(models)]
    assert "tiny-Q8_0.gguf" in names and "org/other.gguf" in names and "notes.gguf" not in names
    assert resolve_model(models, "tiny-Q8_0.gguf") == Path(os.path.realpath(models / "tiny-Q8_0.gguf"))
    assert resolve_model(models, "org/other.gguf").name == "other.gguf"
    for name in ("../outside/secret.gguf", "link.gguf", str(models.parent / "outside" / "secret.gguf")):
        with pytest.raises(ApiError) as err:
            resolve_model(models, name)
        assert err.value.status == 403, name
    with pytest.raises(ApiError) as err:
        resolve_model(models, "absent.gguf")
    assert err.value.status == 404


def test_put_model_loads_a_gguf_file(models: Path, gguf_file: Path) -> None:
    app = create_app(ServerConfig(models_dir=models), make_holder(build_checkpoint(
        CheckpointSpec("gguf_dir_start", seed=42, dtype="float32"), models.parent / "start").path))
    try:
        c = app.test_client()
        assert c.put("/api/v1/model", json={"model": "tiny-Q8_0.gguf"}).get_json() == {}
        assert c.get("/api/v1/model").get_json()["result"] == "kobold_backend/tiny-Q8_0.gguf"
        assert c.put("/api/v1/model", json={"model": "link.gguf"}).status_code == 403
    finally:
        app.extensions["kobold_backend"].close()


def test_config_from_gguf_file_alone(gguf_file: Path) -> None:
    config = ModelConfig.from_dir(gguf_file)
    assert (config.hidden_size, config.num_layers, config.model_type) == (SPEC.hidden_size, SPEC.num_layers, "llama")


def test_united_folder_check_accepts_gguf_files(gguf_file: Path, tmp_path: Path) -> None:
    assert check_model_folder(gguf_file) is None
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    assert "not a GGUF file" in str(check_model_folder(fake))
    assert resolve_model_path("model", str(gguf_file)) == gguf_file
    backend = make_model_backend(None)()
    backend.settings_dir = tmp_path
    assert backend.is_valid("model", str(gguf_file), "Custom")
    assert not backend.is_valid("fake", str(fake), "Custom")


def test_model_routes_name_the_gguf_format(models: Path) -> None:
    """/api/v1/model keeps KoboldAI's "result" and adds the format and bits per weight; /ui/status (the page's
    status line) carries the same."""
    app = create_app(ServerConfig(models_dir=models), make_holder(build_checkpoint(
        CheckpointSpec("gguf_dir_fmt", seed=43, dtype="float32"), models.parent / "start").path))
    try:
        c = app.test_client()
        assert c.put("/api/v1/model", json={"model": "tiny-Q8_0.gguf"}).get_json() == {}
        body = c.get("/api/v1/model").get_json()
        # Q8_0 is 34 bytes per 32 weights: 8.5 bits per weight
        assert body == {"result": "kobold_backend/tiny-Q8_0.gguf", "architecture": "LlamaForCausalLM",
                        "format": "GGUF Q8_0", "bits_per_weight": 8.5}
        status = c.get("/ui/status").get_json()
        assert status["weight_format"] == {"format": "GGUF Q8_0", "bits_per_weight": 8.5}
    finally:
        app.extensions["kobold_backend"].close()


def test_doctor_names_the_stored_format(gguf_file: Path, tmp_path: Path) -> None:
    """`kobold-backend doctor --model` reads headers only; for GGUF the figure is the one the loaded model reports."""
    from kobold_backend.cli.main import main
    from kobold_backend.engine.loader import load_model

    loaded = load_model(gguf_file, device="cpu").weight_format
    line = model_line(str(gguf_file))
    assert line == f"model: model.gguf: LlamaForCausalLM, {loaded} as stored"
    assert str(loaded) == "GGUF Q8_0, 8.50 bpw"
    dense = build_checkpoint(CheckpointSpec("gguf_dir_dense", seed=44, dtype="bfloat16"), tmp_path).path
    assert model_line(str(dense)).endswith("LlamaForCausalLM, bfloat16, 16.00 bpw as stored")
    assert "cannot be read" in model_line(str(tmp_path / "absent.gguf"))
    assert main(["doctor", "--model", str(gguf_file)]) == 0
