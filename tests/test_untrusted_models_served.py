"""Malformed model files dropped into --models-dir or picked in United's folder browser: each load is refused with
one sentence naming the file, and the model already loaded keeps answering /api/v1/generate (United: keeps
generating) with the same tokens, its memory where it was."""

from __future__ import annotations

import gc
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Dict

import gguf
import pytest

from kobold_backend.server import ServerConfig, create_app
from tests.fixtures import fuzz_files as ff
from tests.fixtures.checkpoints import CheckpointFactory
from tests.server_helpers import make_holder
from tests.united_harness import UnitedHost

GREEDY = {"prompt": "Hello there", "max_length": 6, "temperature": 1.0, "top_k": 1, "rep_pen": 1.0,
          "sampler_seed": 1}
RSS_GROWTH_MB = 96


def malformed(models: Path, good: Path) -> Dict[str, str]:
    """Model name -> what the refusal must name: GGUF files broken in the container, the metadata and the tensors,
    folders with a broken config.json and a broken safetensors header."""
    seed = ff.gguf_seed("llama")
    (models / "truncated.gguf").write_bytes(seed[: len(seed) // 2])
    (models / "counts.gguf").write_bytes(seed[:16] + struct.pack("<Q", 2**63) + seed[24:])
    no_heads = {"llama.attention.head_count": (0, gguf.GGUFValueType.UINT32)}
    (models / "heads.gguf").write_bytes(ff.gguf_seed("llama", no_heads))
    (models / "incomplete.gguf").write_bytes(seed)  # a valid container without the model's tensors
    config = json.loads((good / "config.json").read_text())
    shutil.copytree(good, models / "badconfig")
    (models / "badconfig" / "config.json").write_text(json.dumps(dict(config, eos_token_id=[None])))
    shutil.copytree(good, models / "badheader")
    weights = models / "badheader" / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 2**63) + weights.read_bytes()[8:])
    return {"truncated.gguf": "truncated.gguf: tensor", "counts.gguf": "counts.gguf: the header claims",
            "heads.gguf": "heads.gguf: metadata llama.attention.head_count", "incomplete.gguf": "is missing",
            "badconfig": "eos_token_id is None", "badheader": "model.safetensors"}


@pytest.fixture()
def models(checkpoints: CheckpointFactory, tmp_path: Path) -> Any:
    good = checkpoints.get("dense_fp32").path
    root = tmp_path / "models"
    shutil.copytree(good, root / "good")
    return root, malformed(root, good)


def test_put_model_with_a_malformed_file_keeps_the_old_model_serving(models: Any) -> None:
    root, cases = models
    app = create_app(ServerConfig(models_dir=root), make_holder(root / "good"))
    try:
        c = app.test_client()
        before = c.post("/api/v1/generate", json=GREEDY).get_json()
        rss = None
        for _ in range(2):  # the first round warms up what the refusal paths import and allocate
            for name, message in cases.items():
                resp = c.put("/api/v1/model", json={"model": name})
                assert resp.status_code == 422, (name, resp.get_json())
                text = json.dumps(resp.get_json())
                assert f"Loading {name} failed" in text and message in text, text
                assert c.get("/api/v1/model").get_json()["result"] == "kobold_backend/good"
                assert c.post("/api/v1/generate", json=GREEDY).get_json() == before, name
            gc.collect()
            if rss is None:
                rss = ff.rss_mb()
        growth = ff.rss_mb() - rss
        assert growth < RSS_GROWTH_MB, f"RSS grew by {growth:.0f} MiB over a round of malformed loads"
    finally:
        app.extensions["kobold_backend"].close()


def test_united_does_not_offer_malformed_files_and_keeps_generating(models: Any, united: UnitedHost) -> None:
    from tests.test_host_backend import GREEDY as UNITED_GREEDY
    from tests.test_host_backend import PLUGIN, load, sample_with

    root, cases = models
    backend = load(united, root / "good")
    sample_with(united, **UNITED_GREEDY)
    before = backend.raw_generate("Hello", max_new=4).encoded[0].tolist()
    for name in cases:
        if name == "incomplete.gguf":  # only its tensors are missing: the folder check reads headers only
            continue
        path = root / name
        assert united.select_folder(name, str(path)) == {"model_backends": {}}, name
        assert not united.registry.model_backends[PLUGIN].is_valid(name, str(path), "Custom")
        assert united.model.raw_generate("Hello", max_new=4).encoded[0].tolist() == before
