"""Issue 17's reproducers against the server: invalid text, model names and cross-site or rebinding requests are
refused with one message; model management needs --models-dir; a failed load keeps the previous model and frees its
memory; config sizes are checked against the weights before allocation; tokencount is bounded; idle half-open
sockets do not lock clients out."""

from __future__ import annotations

import json
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any, List

import pytest
import requests
import torch

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.loader import load_model
from kobold_backend.errors import ModelFormatError
from kobold_backend.server import ServerConfig, api_extra, create_app
from kobold_backend.server.engine_holder import EngineHolder
from tests.server_helpers import live_server, make_app, make_holder

SURROGATE = "\\ud800"  # the JSON escape of a lone UTF-16 surrogate, as a client sends it


@pytest.fixture(scope="module")
def ckpt(checkpoints: Any) -> Any:
    return checkpoints.get("dense_fp32")


@pytest.fixture(scope="module")
def app(ckpt: Any) -> Any:
    app = make_app(ckpt.path)
    yield app
    app.extensions["kobold_backend"].close()


@pytest.fixture()
def models_app(ckpt: Any, tmp_path: Path) -> Any:
    models = tmp_path / "models"
    shutil.copytree(ckpt.path, models / "tiny")
    app = create_app(ServerConfig(models_dir=models), make_holder(ckpt.path))
    yield app, models
    app.extensions["kobold_backend"].close()


# -- D1: lone surrogates in any text field ---------------------------------------------------------------------

TEXT_CASES = [
    ("/api/v1/generate", '{"prompt": "%s"}', "prompt"),
    ("/api/v1/generate", '{"prompt": "a", "memory": "%s"}', "memory"),
    ("/api/v1/generate", '{"prompt": "a", "negative_prompt": "%s", "guidance_scale": 2}', "negative_prompt"),
    ("/api/v1/generate", '{"prompt": "a", "stop_sequence": ["x", "%s"]}', "stop_sequence[1]"),
    ("/api/extra/generate/stream", '{"prompt": "%s"}', "prompt"),
    ("/api/extra/tokencount", '{"prompt": "%s"}', "prompt"),
    ("/api/extra/tokenize", '{"prompt": "%s"}', "prompt"),
    ("/v1/completions", '{"prompt": "%s"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "%s"]}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "a", "stop": "%s"}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}', "messages[0].content"),
]


@pytest.mark.parametrize("path,body,field", TEXT_CASES)
def test_lone_surrogate_is_refused_naming_the_field(app: Any, path: str, body: str, field: str) -> None:
    resp = app.test_client().post(path, data=body % SURROGATE, content_type="application/json")
    assert resp.status_code == (400 if path.startswith("/v1/") else 422), resp.get_data(as_text=True)
    data = resp.get_json()
    if path.startswith("/v1/"):
        assert data["error"]["param"] == field and "surrogate" in data["error"]["message"]
    else:
        assert list(data["detail"]) == [field] and "surrogate" in data["detail"][field][0]


# -- D2, D5, D6: model names, --models-dir, cross-site and rebinding requests -----------------------------------

def test_model_names_with_nul_or_invalid_unicode_are_422(models_app: Any) -> None:
    app, _ = models_app
    c = app.test_client()
    for name in ("x\\u0000", "a\\u0000b/c", SURROGATE, "tiny\\udfff"):
        body = '{"model": "' + name + '"}'
        for method, path in (("put", "/api/v1/model"), ("post", "/ui/load")):
            resp = getattr(c, method)(path, data=body, content_type="application/json")
            assert resp.status_code == 422, (path, name, resp.get_data(as_text=True))
    for query in ("a%00b", "x%01"):
        assert c.get(f"/ui/parameters?model={query}").status_code == 422, query
    # Invalid UTF-8 in a query string is decoded with replacement characters: simply no such folder.
    assert c.get("/ui/parameters?model=%ED%A0%80").status_code == 404
    assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/dense_fp32",
                                                 "architecture": "LlamaForCausalLM", "format": "float32",
                                                 "bits_per_weight": 32.0}


def test_model_management_needs_models_dir(ckpt: Any) -> None:
    app = make_app(ckpt.path)
    c = app.test_client()
    try:
        for method, path, body in (("put", "/api/v1/model", {"model": "ReadOnly"}),
                                   ("put", "/api/v1/model", {"model": "tiny"}),
                                   ("post", "/ui/load", {"model": "__demo__", "parameters": {"max_ctx": 300000}}),
                                   ("get", "/ui/parameters?model=__demo__", None)):
            resp = getattr(c, method)(path, json=body)
            assert resp.status_code == 501, (path, resp.get_data(as_text=True))
            assert resp.get_json()["detail"]["type"] == "not_implemented"
        assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/" + ckpt.path.name,
                                                     "architecture": "LlamaForCausalLM", "format": "float32",
                                                     "bits_per_weight": 32.0}
        assert c.post("/api/v1/generate", json={"prompt": "a", "max_length": 2}).status_code == 200
    finally:
        app.extensions["kobold_backend"].close()


def test_cross_site_simple_requests_cannot_load_models(models_app: Any) -> None:
    app, _ = models_app
    c = app.test_client()
    body = json.dumps({"model": "tiny", "parameters": {"max_ctx": 64}})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        resp = c.post("/ui/load", data=body, headers={"Content-Type": ctype, "Origin": "http://evil.example"})
        assert resp.status_code == 415, ctype
        resp = c.put("/api/v1/model", data=json.dumps({"model": "ReadOnly"}), headers={"Content-Type": ctype})
        assert resp.status_code == 415, ctype
    assert app.extensions["kobold_backend"].holder.active.max_context == 128
    ok = c.post("/ui/load", data=body, headers={"Content-Type": "text/plain", "X-Requested-With": "fetch"})
    assert ok.status_code == 200 and ok.get_json()["max_context"] == 64
    # With CORS open to every origin, a preflight never allows PUT (the model route); generation stays open.
    pre = c.options("/api/v1/model", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "PUT"})
    assert "PUT" not in pre.headers.get("Access-Control-Allow-Methods", "")
    assert "POST" in pre.headers.get("Access-Control-Allow-Methods", "")


def test_host_header_is_checked_on_loopback_binds(ckpt: Any) -> None:
    app = make_app(ckpt.path)
    c = app.test_client()
    try:
        for host in ("evil.example", "evil.example:5001", "192.168.1.5:5001", "localhost.evil.example"):
            resp = c.get("/api/extra/version", headers={"Host": host})
            assert resp.status_code == 403, host
            v1 = c.post("/v1/completions", json={"prompt": "a"}, headers={"Host": host})
            assert v1.status_code == 403 and v1.get_json()["error"]["code"] == "forbidden"
        for host in ("localhost", "localhost:5001", "127.0.0.1:5001", "[::1]:5001", "127.0.0.2", "app.localhost"):
            assert c.get("/api/extra/version", headers={"Host": host}).status_code == 200, host
    finally:
        app.extensions["kobold_backend"].close()
    open_app = create_app(ServerConfig(host="0.0.0.0"), EngineHolder())
    try:
        assert open_app.test_client().get("/api/extra/version", headers={"Host": "my-box:5001"}).status_code == 200
    finally:
        open_app.extensions["kobold_backend"].close()


def test_max_ctx_is_bounded_by_the_model(models_app: Any, ckpt: Any) -> None:
    app, _ = models_app
    c = app.test_client()
    limit = ModelConfig.from_dir(ckpt.path).max_position_embeddings
    for max_ctx in (300000, limit + 1, 0, -5):
        resp = c.post("/ui/load", json={"model": "tiny", "parameters": {"max_ctx": max_ctx}})
        assert resp.status_code == 422, max_ctx
        assert "max_ctx" in resp.get_data(as_text=True)
    # NTK alpha stretches the usable context, and so the bound.
    ok = c.post("/ui/load", json={"model": "tiny", "parameters": {"max_ctx": 2 * limit, "ntk_alpha": 2}})
    assert ok.status_code == 200 and ok.get_json()["max_context"] == 2 * limit


# -- D7, D8: failed loads ---------------------------------------------------------------------------------------

def test_a_failed_load_keeps_the_previous_model(models_app: Any, ckpt: Any) -> None:
    app, models = models_app
    broken = models / "broken"
    shutil.copytree(ckpt.path, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    c = app.test_client()
    resp = c.put("/api/v1/model", json={"model": "broken"})
    assert resp.status_code == 422 and resp.get_json()["detail"]["type"] == "load_error"
    assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/" + ckpt.path.name,
                                                 "architecture": "LlamaForCausalLM", "format": "float32",
                                                 "bits_per_weight": 32.0}
    assert c.post("/api/v1/generate", json={"prompt": "a", "max_length": 2}).status_code == 200


def test_a_load_failing_midway_restores_the_previous_model_and_frees_its_memory(ckpt: Any) -> None:
    """The loader allocates, then fails: nothing may keep that tensor alive (the traceback's frames held the
    partial model), and the previous model is loaded again with its own settings."""
    held: List[Any] = []

    def loader(path: Path, **kwargs: Any) -> Any:
        if kwargs.get("max_seq_len") == 77:
            partial = torch.zeros(1 << 20)
            held.append(weakref.ref(partial))
            raise RuntimeError("out of memory while building the cache")
        return load_model(path, **kwargs)

    holder = EngineHolder(loader=loader, load_kwargs={"device": "cpu", "max_seq_len": 96})
    holder.load(ckpt.path)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        holder.load(ckpt.path, max_seq_len=77)
    assert held and held[0]() is None
    del info
    assert holder.active is not None and holder.active.max_context == 96


def write_config(folder: Path, ckpt: Any, **changes: Any) -> Path:
    shutil.copytree(ckpt.path, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes,message", [
    ({"num_hidden_layers": 200_000_000}, "num_hidden_layers 200000000 is outside"),
    ({"num_hidden_layers": 1_000_000_000}, "num_hidden_layers 1000000000 is outside"),
    ({"hidden_size": 0}, "hidden_size 0 is outside"),
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"num_hidden_layers": 3}, "holds 2 layers"),
    ({"vocab_size": 999}, "model.embed_tokens.weight has shape"),
    ({"num_hidden_layers": "many"}, "num_hidden_layers is 'many'; a whole number is expected"),
])
def test_config_sizes_are_checked_before_anything_is_allocated(ckpt: Any, tmp_path: Path, changes: Any,
                                                               message: str) -> None:
    folder = write_config(tmp_path / "m", ckpt, **changes)
    with pytest.raises(ModelFormatError, match=message):
        load_model(folder, device="cpu")


# -- D4: tokencount is bounded ------------------------------------------------------------------------------------

def test_tokencount_takes_one_text_at_a_time(app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    state = app.extensions["kobold_backend"]
    monkeypatch.setattr(api_extra, "TOKENIZE_WAIT_SECONDS", 0.2)
    c = app.test_client()
    assert state.tokenize_slot.acquire(timeout=1)
    try:
        busy = c.post("/api/extra/tokencount", json={"prompt": "hello"})
        assert busy.status_code == 503
    finally:
        state.tokenize_slot.release()
    assert c.post("/api/extra/tokencount", json={"prompt": "hello"}).get_json()["value"] > 0


# -- D3: idle half-open sockets -------------------------------------------------------------------------------------

def test_idle_half_open_sockets_do_not_lock_clients_out(app: Any) -> None:
    """150 clients that send part of their headers and go quiet (slowloris); a real client is still answered
    at once (waitress's default limit of 100 connections made it wait for their 120 s timeout)."""
    with live_server(app, threads=4) as server:
        idle: List[socket.socket] = []
        try:
            for _ in range(150):
                s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                s.sendall(b"POST /api/v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n")
                idle.append(s)
            resp = requests.get(server.url + "/api/extra/version", timeout=5)
            assert resp.status_code == 200
            gen = requests.post(server.url + "/api/v1/generate", json={"prompt": "a", "max_length": 2}, timeout=5)
            assert gen.status_code == 200
        finally:
            for s in idle:
                s.close()



def test_a_huge_chat_is_refused_before_it_is_tokenized(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kobold_backend.engine.chat_template import ChatFormatter

    monkeypatch.setattr(ChatFormatter, "encode", lambda self, text: pytest.fail("the 10 MB chat was tokenized"))
    app = create_app(ServerConfig(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"),
                     make_holder(ckpt.path))
    try:
        body = {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 4}
        resp = app.test_client().post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "context_length_exceeded"
    finally:
        app.extensions["kobold_backend"].close()
