"""Passthrough over HTTP: 403 unless the server enables it, 422 with the field for a bad spec, capture results in
the JSON response against transformers, the perf flag, streaming, and no effect on concurrent or later requests
without passthrough."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import requests
import torch

from kobold_backend.engine.passthrough import PassthroughConfig
from kobold_backend.server import ServerConfig, create_app
from tests.fixtures.checkpoints import BuiltCheckpoint, CheckpointFactory
from tests.fixtures.hf_oracle import hf_load, row_rel_err
from tests.server_helpers import live_server, make_holder
from tests.test_passthrough import decode_capture, random_vectors, write_gguf_vector

PROMPT = "The weather today is"
GREEDY = {"temperature": 0, "top_k": 1, "rep_pen": 1.0, "max_length": 10}
DISABLED = {"detail": {"msg": "passthrough is disabled on this server; start it with --enable-passthrough",
                       "type": "forbidden"}}


@pytest.fixture(scope="module")
def built(checkpoints: CheckpointFactory) -> BuiltCheckpoint:
    return checkpoints.get("dense_fp32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("passthrough_server")
    out = {name: root / name for name in ("vectors", "captures")}
    for folder in out.values():
        folder.mkdir()
    write_gguf_vector(out["vectors"] / "happy.gguf", random_vectors([0, 1], 64, seed=21))
    return out


def make(built: BuiltCheckpoint, folders: Dict[str, Path], enabled: bool = True, delay: float = 0.0) -> Any:
    config = PassthroughConfig(vectors_dir=folders["vectors"], capture_output_dir=folders["captures"])
    return create_app(ServerConfig(passthrough=config if enabled else None), make_holder(built.path, delay))


@pytest.fixture(scope="module")
def app(built: BuiltCheckpoint, folders: Dict[str, Path]) -> Any:
    app = make(built, folders)
    yield app
    app.extensions["kobold_backend"].close()


def post(client: Any, **body: Any) -> Any:
    return client.post("/api/v1/generate", json=dict(GREEDY, prompt=PROMPT, **body))


def text(resp: Any) -> str:
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()["results"][0]["text"]


def test_disabled_server_answers_403(built, folders) -> None:
    app = make(built, folders, enabled=False)
    try:
        client = app.test_client()
        spec = {"steer": {"vector": "happy"}}
        for path in ("/api/v1/generate", "/api/extra/generate/stream"):
            resp = client.post(path, json=dict(GREEDY, prompt=PROMPT, passthrough=spec))
            assert resp.status_code == 403 and resp.get_json() == DISABLED
        assert post(client).status_code == 200
    finally:
        app.extensions["kobold_backend"].close()


def test_bad_spec_answers_422_with_its_field(app) -> None:
    client = app.test_client()
    resp = post(client, passthrough={"steer": {"vector": "happy", "layers": [0, 9]}})
    assert resp.status_code == 422
    assert resp.get_json() == {"detail": {"passthrough.steer.layers[1]": [
        "layer 9 is out of range; this model has layers 0..1"]}}
    resp = post(client, passthrough={"shout": {}})
    assert resp.get_json() == {"detail": {"passthrough.shout": [
        "unknown passthrough action 'shout'; known actions: capture, lora, steer"]}}


def test_capture_results_in_the_response_match_transformers(app, built) -> None:
    client = app.test_client()
    spec = {"capture": {"layers": [0], "phase": ["prompt", "generated"], "dtype": "float32"}}
    body = post(client, passthrough=spec).get_json()["results"][0]
    cap = body["passthrough_results"]["capture"]
    tokenizer = app.extensions["kobold_backend"].holder.active.tokenizer
    prompt = [tokenizer.bos_id] + tokenizer.encode(PROMPT)
    assert body["prompt_tokens"] == len(prompt)
    gen_entry = cap["generated"]["0"]
    assert gen_entry["positions"] == list(range(len(prompt), len(prompt) + body["completion_tokens"] - 1))
    with torch.no_grad():
        hs = hf_load(built.oracle_path)(torch.tensor([prompt]), output_hidden_states=True).hidden_states[1]
    assert cap["prompt"]["0"]["positions"] == [len(prompt) - 1]
    assert row_rel_err(decode_capture(cap["prompt"]["0"]), hs[:, -1:]) < 1e-4
    assert "passthrough_results" not in post(client).get_json()["results"][0]


def test_perf_reports_the_eager_run_and_streaming_steers_alike(app) -> None:
    client = app.test_client()
    spec = {"steer": {"vector": "happy", "strength": 4.0}}
    plain = text(post(client))
    assert client.get("/api/extra/perf").get_json()["passthrough"] is False
    steered = text(post(client, passthrough=spec))
    assert steered != plain
    assert client.get("/api/extra/perf").get_json()["passthrough"] is True
    resp = client.post("/api/extra/generate/stream", json=dict(GREEDY, prompt=PROMPT, passthrough=spec))
    assert resp.status_code == 200
    tokens = [json.loads(line[6:])["token"] for line in resp.get_data(as_text=True).splitlines()
              if line.startswith("data: ")]
    assert "".join(tokens) == steered


def test_passthrough_does_not_affect_concurrent_or_later_plain_requests(built, folders) -> None:
    fresh = make(built, folders)
    try:
        baseline = text(post(fresh.test_client()))
    finally:
        fresh.extensions["kobold_backend"].close()

    app = make(built, folders, delay=0.02)
    spec = {"steer": {"vector": "happy", "strength": 4.0}, "capture": {"layers": [1], "phase": "generated"}}
    answers: Dict[str, List[str]] = {"steered": [], "plain": []}
    try:
        with live_server(app) as server:
            url = f"{server.url}/api/v1/generate"

            def call(kind: str, body: Dict[str, Any]) -> None:
                resp = requests.post(url, json=dict(GREEDY, prompt=PROMPT, **body), timeout=60)
                answers[kind].append(resp.json()["results"][0]["text"])

            threads = [threading.Thread(target=call, args=("steered", {"passthrough": spec}))]
            threads += [threading.Thread(target=call, args=("plain", {})) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            call("plain", {})
    finally:
        app.extensions["kobold_backend"].close()
    assert answers["steered"][0] != baseline
    assert answers["plain"] == [baseline] * 3


def test_each_of_n_results_has_the_passthrough_of_its_own_run(app) -> None:
    """n=2 with a capture: the engine runs the two completions (seed, seed + 1), each with a passthrough of its
    own; each result equals the single request with its seed, captures included."""
    client = app.test_client()
    spec = {"capture": {"layers": [0], "phase": ["generated"], "dtype": "float32"}}
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "max_length": 6}
    many = post(client, passthrough=spec, n=2, sampler_seed=5, **hot).get_json()["results"]
    singles = [post(client, passthrough=spec, sampler_seed=5 + i, **hot).get_json()["results"][0] for i in range(2)]
    assert many == singles
    for result in many:
        positions = result["passthrough_results"]["capture"]["generated"]["0"]["positions"]
        assert len(positions) == result["completion_tokens"] - 1
    assert many[0]["text"] != many[1]["text"] or many[0]["passthrough_results"] != many[1]["passthrough_results"]
