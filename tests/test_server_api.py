"""Flask test-client tests of every server route, status and error shape, checked against independent oracles:
sentencepiece for token ids, transformers (fp32, greedy) for generated text, KoboldCpp's documented shapes."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import sentencepiece as spm
import torch

from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.engine_holder import EngineHolder
from tests.server_helpers import CONTEXT, hf_greedy, make_app, make_holder, text_of

CHECKPOINT = "dense_fp32"
PROMPT = "The old lighthouse keeper climbed the stairs"
LITE_SSE = re.compile(r"^event: (.*)\ndata: (.*)(\r?\n){2}")


@pytest.fixture(scope="module")
def ckpt(checkpoints: Any) -> Any:
    return checkpoints.get(CHECKPOINT)


@pytest.fixture(scope="module")
def sp(ckpt: Any) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(ckpt.path / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf_model(ckpt: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt.oracle_path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def app(ckpt: Any) -> Any:
    app = make_app(ckpt.path)
    yield app
    app.extensions["kobold_backend"].close()


@pytest.fixture()
def client(app: Any) -> Any:
    return app.test_client()




def generate(client: Any, **body: Any) -> Dict[str, Any]:
    body.setdefault("prompt", PROMPT)
    resp = client.post("/api/v1/generate", json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def sse_events(raw: bytes) -> List[Dict[str, Any]]:
    """Parse a KoboldCpp SSE body strictly: every event is exactly `event: message` + one data line."""
    text = raw.decode("utf-8")
    events = []
    while text:
        m = LITE_SSE.match(text)
        assert m is not None, text[:200]
        assert m.group(1) == "message"
        data = json.loads(m.group(2))
        assert m.group(0) == "event: message\ndata: " + json.dumps(data) + "\n\n"
        assert list(data) == ["token", "finish_reason"]
        events.append(data)
        text = text[m.end():]
    return events


# -- informational routes ----------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["/api/v1", "/api/latest"])
def test_v1_info_routes(client: Any, prefix: str) -> None:
    assert client.get(f"{prefix}/model").get_json() == {"result": f"kobold_backend/{CHECKPOINT}",
                                                        "architecture": "LlamaForCausalLM",
                                                        "format": "float32", "bits_per_weight": 32.0}
    assert client.get(f"{prefix}/info/version").get_json() == {"result": "1.2.5"}
    assert client.get(f"{prefix}/info/version/latest").get_json() == {"result": "1.2.5"}
    assert client.get(f"{prefix}/info/version/list").get_json() == {"results": ["1.2.5"]}
    assert client.get(f"{prefix}/config/max_context_length").get_json() == {"value": CONTEXT}
    assert client.get(f"{prefix}/config/max_length").get_json() == {"value": CONTEXT // 2}
    assert client.get(f"{prefix}/config/soft_prompt").get_json() == {"value": ""}
    assert client.get(f"{prefix}/config/soft_prompts_list").get_json() == {"values": []}
    assert client.put(f"{prefix}/config/soft_prompt", json={"value": ""}).get_json() == {}
    bad = client.put(f"{prefix}/config/soft_prompt", json={"value": "nope.zip"})
    assert bad.status_code == 422 and list(bad.get_json()["detail"]) == ["value"]


def test_extra_info_routes(client: Any) -> None:
    v = client.get("/api/extra/version").get_json()
    assert v["result"] == "KoboldCpp"
    assert tuple(int(x) for x in v["version"].split(".")) >= (1, 76)
    for flag in ("protected", "txt2img", "vision", "transcribe"):
        assert v[flag] is False
    assert client.get("/api/extra/true_max_context_length").get_json() == {"value": CONTEXT}
    assert client.get("/api/extra/preloadstory").get_json() == {}


def test_trailing_slash_is_tolerated(client: Any) -> None:
    assert client.get("/api/latest/config/max_context_length/").get_json() == {"value": CONTEXT}
    resp = client.post("/api/latest/generate/", json={"prompt": "Hi", "max_length": 2, "quiet": True})
    assert resp.status_code == 200 and len(resp.get_json()["results"]) == 1


# -- tokens --------------------------------------------------------------------------------------------

def test_tokencount_matches_sentencepiece(client: Any, sp: spm.SentencePieceProcessor) -> None:
    text = "Ünïcode, numbers 12345 and\nnew lines"
    expect = [1] + sp.encode(text)
    for route in ("/api/extra/tokencount", "/api/extra/tokenize"):
        assert client.post(route, json={"prompt": text}).get_json() == {"value": len(expect), "ids": expect}
        no_special = client.post(route, json={"prompt": text, "special": False}).get_json()
        assert no_special == {"value": len(expect) - 1, "ids": expect[1:]}
    assert client.post("/api/extra/tokencount", json={"text": "x"}).status_code == 400
    bad = client.post("/api/extra/tokencount", data=b"{not json")
    assert bad.status_code == 400 and bad.get_json()["value"] == -1


def test_detokenize_matches_sentencepiece(client: Any, sp: spm.SentencePieceProcessor) -> None:
    ids = sp.encode("a small test of detokenize")
    assert client.post("/api/extra/detokenize", json={"ids": ids}).get_json() == {
        "result": sp.decode(ids), "success": True}
    bad = client.post("/api/extra/detokenize", json={"ids": "1,2"})
    assert bad.status_code == 400 and bad.get_json() == {"result": "", "success": False}


# -- generation against transformers -------------------------------------------------------------------

def test_greedy_generate_matches_transformers(client: Any, sp: spm.SentencePieceProcessor, hf_model: Any) -> None:
    prompt_ids = [1] + sp.encode(PROMPT)
    expect_ids = hf_greedy(hf_model, prompt_ids, 10)
    out = generate(client, max_length=10, temperature=0, rep_pen=1.0)
    result = out["results"][0]
    assert result["text"] == text_of(sp, prompt_ids, expect_ids)
    assert result["finish_reason"] == ("stop" if expect_ids[-1] == 2 else "length")
    assert result["prompt_tokens"] == len(prompt_ids)
    perf = client.get("/api/extra/perf").get_json()
    assert perf["last_token_count"] == len(expect_ids)
    assert perf["last_input_count"] == len(prompt_ids)
    assert perf["stop_reason"] == (1 if expect_ids[-1] == 2 else 0)
    assert perf["idle"] == 1 and perf["queue"] == 0


def test_prompt_trimmed_from_front_with_memory_kept(client: Any, sp: spm.SentencePieceProcessor,
                                                    hf_model: Any) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(80))
    memory = "Memory: the keeper is called Ada. "
    ctx, n = 48, 6
    body_ids = sp.encode(long_prompt)
    mem_ids = sp.encode(memory)
    kept = [1] + mem_ids + body_ids[len(body_ids) - (ctx - n - 1 - len(mem_ids)):]
    assert len(kept) == ctx - n
    expect = hf_greedy(hf_model, kept, n, eos=False)
    out = generate(client, prompt=long_prompt, memory=memory, max_context_length=ctx, max_length=n,
                   temperature=0, use_default_badwordsids=True)
    assert out["results"][0]["prompt_tokens"] == ctx - n
    assert out["results"][0]["text"] == text_of(sp, kept, expect)

    no_memory = [1] + body_ids[len(body_ids) - (ctx - n - 1):]
    expect = hf_greedy(hf_model, no_memory, n, eos=False)
    out = generate(client, prompt=long_prompt, max_context_length=ctx, max_length=n, temperature=0,
                   use_default_badwordsids=True)
    assert out["results"][0]["text"] == text_of(sp, no_memory, expect)


def test_max_length_and_context_are_clamped(client: Any) -> None:
    out = generate(client, prompt="Hi", max_length=100000, max_context_length=10**9, temperature=0,
                   use_default_badwordsids=True)
    # The server context is CONTEXT; min(ctx - 4, 16) tokens stay for the prompt.
    assert out["results"][0]["completion_tokens"] == CONTEXT - 16
    out = generate(client, prompt="Hi", max_length=50, max_context_length=20, temperature=0,
                   use_default_badwordsids=True)
    assert out["results"][0]["completion_tokens"] == 20 - 16


def test_stop_sequence_and_trim_stop(client: Any) -> None:
    base = generate(client, max_length=16, temperature=0, use_default_badwordsids=True)["results"][0]["text"]
    stop = base.strip()[2:5]
    assert stop.strip()
    at = base.index(stop)
    kept = generate(client, max_length=16, temperature=0, use_default_badwordsids=True, stop_sequence=[stop])
    assert kept["results"][0]["text"] == base[: at + len(stop)]
    assert kept["results"][0]["finish_reason"] == "length"  # KoboldCpp reports stop strings as "length"
    trimmed = generate(client, max_length=16, temperature=0, use_default_badwordsids=True, stop_sequence=[stop],
                       trim_stop=True)
    assert trimmed["results"][0]["text"] == base[:at]


def test_eos_finish_reason_and_logit_bias(client: Any) -> None:
    out = generate(client, max_length=8, temperature=0, logit_bias={"2": 100})
    assert out["results"][0] == {"text": "", "finish_reason": "stop", "prompt_tokens": out["results"][0][
        "prompt_tokens"], "completion_tokens": 1}
    banned = generate(client, max_length=4, temperature=0, logit_bias={"2": 100}, use_default_badwordsids=True)
    assert banned["results"][0]["completion_tokens"] == 4
    assert banned["results"][0]["finish_reason"] == "length"


def test_singleline_and_newline_bias(client: Any, sp: spm.SentencePieceProcessor) -> None:
    newline = sp.piece_to_id("<0x0A>")
    lines = generate(client, max_length=3, temperature=0, logit_bias={str(newline): 100})
    assert lines["results"][0]["text"] == "\n\n\n"
    single = generate(client, max_length=3, temperature=0, logit_bias={str(newline): 100}, singleline=True)
    assert single["results"][0]["text"] == ""


def test_seeds_and_sequential_n(client: Any) -> None:
    body = {"max_length": 12, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "use_default_badwordsids": True}
    many = generate(client, n=3, sampler_seed=1234, **body)["results"]
    assert len(many) == 3
    singles = [generate(client, sampler_seed=1234 + i, **body)["results"][0]["text"] for i in range(3)]
    assert [r["text"] for r in many] == singles
    assert len(set(singles)) > 1


def test_custom_token_bans_and_banned_strings(client: Any, sp: spm.SentencePieceProcessor) -> None:
    base = generate(client, max_length=6, temperature=0, use_default_badwordsids=True)["results"][0]["text"]
    first = sp.encode(PROMPT + base)[len(sp.encode(PROMPT))]
    out = generate(client, max_length=6, temperature=0, use_default_badwordsids=True,
                   custom_token_bans=f"{first}")
    assert out["results"][0]["text"] != base
    phrase = base.strip()[:3]
    out = generate(client, max_length=6, temperature=0, use_default_badwordsids=True, banned_tokens=[phrase])
    assert phrase.lower() not in out["results"][0]["text"].lower()


def test_every_documented_field_and_unknown_keys_accepted(client: Any) -> None:
    from kobold_backend.server.schemas import FIELDS

    body: Dict[str, Any] = {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
                            for f in FIELDS if f.default is not None}
    body.update({
        "prompt": "Hello", "max_length": 3, "max_context_length": 64, "sampler_seed": 7, "min_p": 0.05,
        "mirostat": 2, "dry_multiplier": 0.8, "dry_sequence_breakers": json.dumps(["\n", ":"]),
        "xtc_probability": 0.5, "dynatemp_range": 0.2, "smoothing_factor": 0.1, "presence_penalty": 0.3,
        "repeat_penalty": 1.1, "repetition_penalty": 1.2, "ban_eos_token": True, "banned_strings": ["zzz"],
        "models": ["x"], "workers": [], "something_new": {"a": 1}, "grammar": "root ::= \"a\"",
        "images": [], "logprobs": False, "genkey": "KCPP1234", "n": 1,
    })
    out = client.post("/api/v1/generate", json=body)
    assert out.status_code == 200, out.get_data(as_text=True)
    nulls = client.post("/api/v1/generate", json={"prompt": "Hi", "max_length": 2, "temperature": None,
                                                  "stop_sequence": None})
    assert nulls.status_code == 200


# -- validation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,detail", [
    ({}, {"prompt": ["Missing data for required field."]}),
    ({"prompt": 3}, {"prompt": ["Not a valid string."]}),
    ({"prompt": "x", "max_length": 0}, {"max_length": ["Must be greater than or equal to 1."]}),
    ({"prompt": "x", "max_length": 2.5}, {"max_length": ["Not a valid integer."]}),
    ({"prompt": "x", "temperature": "hot"}, {"temperature": ["Not a valid number."]}),
    ({"prompt": "x", "temperature": -1}, {"temperature": ["Must be greater than or equal to 0."]}),
    ({"prompt": "x", "top_p": 1.5},
     {"top_p": ["Must be greater than or equal to 0 and less than or equal to 1."]}),
    ({"prompt": "x", "n": 6}, {"n": ["Must be greater than or equal to 1 and less than or equal to 5."]}),
    ({"prompt": "x", "rep_pen": 0.5}, {"rep_pen": ["Must be greater than or equal to 1."]}),
    ({"prompt": "x", "repetition_penalty": "a"}, {"repetition_penalty": ["Not a valid number."]}),
    ({"prompt": "x", "stop_sequence": [1]}, {"stop_sequence": ["Item 0: Not a valid string."]}),
    ({"prompt": "x", "sampler_order": [0, 0, 1]}, {"sampler_order": ["Sampler ids must not repeat."]}),
    ({"prompt": "x", "sampler_order": [7]},
     {"sampler_order": ["Item 0: Must be greater than or equal to 0 and less than or equal to 6."]}),
    ({"prompt": "x", "sampler_seed": -2},
     {"sampler_seed": [f"Must be greater than or equal to -1 and less than or equal to {2**64 - 1}."]}),
    ({"prompt": "x", "use_default_badwordsids": "maybe"}, {"use_default_badwordsids": ["Not a valid boolean."]}),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, {"logit_bias": ["Key 'abc': Not a valid token id."]}),
    ({"prompt": "x", "logit_bias": [1]}, {"logit_bias": ["Not a valid mapping type."]}),
    ({"prompt": "x", "custom_token_bans": "1,x"},
     {"custom_token_bans": ["Not a valid comma-separated list of token ids."]}),
    ({"prompt": "x", "dry_sequence_breakers": "[unclosed"},
     {"dry_sequence_breakers": ["Not a valid list or JSON string of a list."]}),
    ({"prompt": "x", "mirostat": 3}, {"mirostat": ["Must be greater than or equal to 0 and less than or equal to 2."]}),
    ({"prompt": "x", "max_length": 0, "top_k": -1}, {"max_length": ["Must be greater than or equal to 1."],
                                                     "top_k": ["Must be greater than or equal to 0."]}),
    (["prompt"], {"_schema": ["Invalid input type."]}),
])
@pytest.mark.parametrize("route", ["/api/v1/generate", "/api/extra/generate/stream"])
def test_invalid_bodies_get_422_per_field(client: Any, body: Any, detail: Dict[str, List[str]], route: str) -> None:
    resp = client.post(route, json=body)
    assert resp.status_code == 422
    assert resp.get_json() == {"detail": detail}


def test_bad_json_is_400(client: Any) -> None:
    resp = client.post("/api/v1/generate", data=b'{"prompt": ', content_type="application/json")
    assert resp.status_code == 400
    assert resp.get_json() == {"detail": {"msg": "The request body is not valid JSON.", "type": "bad_input"}}
    deep = client.post("/api/v1/generate", data=b"[" * 100000 + b"]" * 100000)
    assert deep.status_code in (400, 422)


# -- SSE -----------------------------------------------------------------------------------------------

def test_sse_framing_byte_for_byte(client: Any) -> None:
    sync = generate(client, max_length=10, temperature=0, use_default_badwordsids=True)["results"][0]["text"]
    resp = client.post("/api/extra/generate/stream", json={"prompt": PROMPT, "max_length": 10, "temperature": 0,
                                                           "use_default_badwordsids": True})
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache"
    events = sse_events(resp.data)
    assert all(e["finish_reason"] == "null" for e in events[:-1])
    assert all(e["token"] for e in events[:-1])
    assert events[-1]["finish_reason"] == "length"
    assert "".join(e["token"] for e in events) == sync
    assert len(events) >= 2


def test_sse_eos_final_event_is_stop(client: Any) -> None:
    resp = client.post("/api/extra/generate/stream", json={"prompt": PROMPT, "max_length": 5, "temperature": 0,
                                                           "logit_bias": {"2": 100}})
    assert resp.data == b'event: message\ndata: {"token": "", "finish_reason": "stop"}\n\n'


def test_sse_non_ascii_is_escaped_json(client: Any) -> None:
    from kobold_backend.server.sse import format_event

    expect = b'event: message\ndata: {"token": "\\u00e9\\n\\"", "finish_reason": "null"}\n\n'
    assert format_event("é\n\"", "null") == expect


# -- check / abort without a running generation ---------------------------------------------------------

def test_check_and_abort_when_idle(client: Any) -> None:
    # the worker may still be retiring the previous test's streamed job for a moment on a loaded machine
    deadline = time.monotonic() + 5
    while client.get("/api/extra/perf").get_json()["idle"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.get("/api/extra/generate/check").get_json() == {"results": [{"text": ""}]}
    assert client.post("/api/extra/generate/check", json={"genkey": "KCPP0000"}).get_json() == {
        "results": [{"text": ""}]}
    assert client.post("/api/extra/abort").get_json() == {"success": "false", "done": "false"}
    assert client.post("/api/extra/abort", json={"genkey": "KCPP0000"}).get_json() == {
        "success": "false", "done": "false"}


def test_check_returns_text_of_finished_genkey(client: Any) -> None:
    out = generate(client, max_length=5, temperature=0, genkey="KCPP4321")
    check = client.post("/api/extra/generate/check", json={"genkey": "KCPP4321"}).get_json()
    assert check == {"results": [{"text": out["results"][0]["text"]}]}


# -- errors ----------------------------------------------------------------------------------------------

def test_404_and_405_shapes(client: Any) -> None:
    nf = client.get("/api/v1/nothing")
    assert nf.status_code == 404 and nf.get_json()["detail"]["type"] == "generic.error_404"
    na = client.get("/api/v1/generate")
    assert na.status_code == 405
    assert na.get_json()["detail"]["type"] == "generic.error_405"
    assert "POST" in na.headers["Allow"]


def test_413_body_too_large(ckpt: Any) -> None:
    app = make_app(ckpt.path, max_content_length=1000)
    try:
        resp = app.test_client().post("/api/v1/generate", json={"prompt": "x" * 5000})
        assert resp.status_code == 413
        assert resp.get_json()["detail"]["type"] == "generic.error_413"
        assert isinstance(resp.get_json()["detail"]["msg"], str)
    finally:
        app.extensions["kobold_backend"].close()


def test_no_model_loaded() -> None:
    app = create_app(ServerConfig(), EngineHolder())
    try:
        c = app.test_client()
        assert c.get("/api/v1/model").get_json() == {"result": "ReadOnly"}
        for method, route, body in [("post", "/api/v1/generate", {"prompt": "x"}),
                                    ("post", "/api/extra/generate/stream", {"prompt": "x"}),
                                    ("post", "/api/extra/tokencount", {"prompt": "x"}),
                                    ("get", "/api/extra/true_max_context_length", None)]:
            resp = getattr(c, method)(route, json=body)
            assert resp.status_code == 501
            assert resp.get_json() == {"detail": {"msg": "No model is loaded.", "type": "not_implemented"}}
    finally:
        app.extensions["kobold_backend"].close()


def test_unexpected_error_is_500_without_traceback(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(ckpt.path)
    try:
        gen = app.extensions["kobold_backend"].holder.active.generator

        def broken(req: Any) -> Any:
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(gen, "stream", broken)
        c = app.test_client()
        for route in ("/api/v1/generate", "/api/extra/generate/stream"):
            resp = c.post(route, json={"prompt": "x", "max_length": 2})
            assert resp.status_code == 500
            assert resp.get_json() == {"detail": {"msg": "Internal server error.", "type": "generic.error_500"}}
            assert b"secret" not in resp.data and b"Traceback" not in resp.data
    finally:
        app.extensions["kobold_backend"].close()


# -- auth and CORS -------------------------------------------------------------------------------------

def test_api_key(ckpt: Any) -> None:
    app = make_app(ckpt.path, api_key="s3cret")
    try:
        c = app.test_client()
        unauthorized = {"detail": {"error": "Unauthorized", "msg": "Authentication key is missing or invalid.",
                                   "type": "unauthorized"}}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = c.post("/api/v1/generate", json={"prompt": "x", "max_length": 1}, headers=headers)
            assert resp.status_code == 401 and resp.get_json() == unauthorized
            assert c.get("/api/v1/model", headers=headers).status_code == 401
            assert c.get("/ui/status", headers=headers).status_code == 401
        ok = c.post("/api/v1/generate", json={"prompt": "x", "max_length": 1},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/api/v1/model", headers={"apikey": "s3cret"}).status_code == 200
        public = c.get("/api/extra/version").get_json()
        assert public["protected"] is True
        assert c.get("/api/v1/info/version").status_code == 200
        assert c.get("/").status_code == 200
        pre = c.options("/api/v1/generate", headers={"Origin": "http://x.example",
                                                    "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert "Authorization" in pre.headers["Access-Control-Allow-Headers"]
    finally:
        app.extensions["kobold_backend"].close()


def test_cors_default_and_preflight(client: Any) -> None:
    resp = client.get("/api/v1/model", headers={"Origin": "http://lite.example"})
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    err = client.get("/api/v1/nothing", headers={"Origin": "http://lite.example"})
    assert err.headers["Access-Control-Allow-Origin"] == "*"
    pre = client.options("/api/extra/generate/stream", headers={"Origin": "http://lite.example",
                                                                "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "Content-Type" in pre.headers["Access-Control-Allow-Headers"]
    assert "Access-Control-Allow-Origin" not in client.get("/").headers


def test_cors_configured_origins(ckpt: Any) -> None:
    for origins, origin, expect in [(("http://a.example",), "http://a.example", "http://a.example"),
                                    (("http://a.example",), "http://b.example", None),
                                    ((), "http://a.example", None)]:
        app = create_app(ServerConfig(cors_origins=origins), EngineHolder())
        try:
            resp = app.test_client().get("/api/extra/version", headers={"Origin": origin})
            assert resp.headers.get("Access-Control-Allow-Origin") == expect
        finally:
            app.extensions["kobold_backend"].close()


# -- models folder, PUT /api/v1/model and the web routes -------------------------------------------------

@pytest.fixture()
def models_app(ckpt: Any, tmp_path: Path) -> Any:
    models = tmp_path / "models"
    shutil.copytree(ckpt.path, models / "tiny")
    (tmp_path / "outside").mkdir()
    shutil.copy(ckpt.path / "config.json", tmp_path / "outside" / "config.json")
    app = create_app(ServerConfig(models_dir=models), make_holder(ckpt.path))
    yield app, models, tmp_path
    app.extensions["kobold_backend"].close()


def test_put_model_confined_to_models_dir(models_app: Any) -> None:
    app, models, root = models_app
    c = app.test_client()
    assert c.put("/api/v1/model", json={"model": "tiny"}).get_json() == {}
    assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/tiny", "architecture": "LlamaForCausalLM",
                                                 "format": "float32", "bits_per_weight": 32.0}
    for name in ("../outside", str(root / "outside"), "/etc", ".", "tiny/../../outside"):
        resp = c.put("/api/v1/model", json={"model": name})
        assert resp.status_code == 403, name
        assert resp.get_json()["detail"]["type"] == "forbidden"
    missing = c.put("/api/v1/model", json={"model": "absent"})
    assert missing.status_code == 404 and missing.get_json()["detail"]["type"] == "key_error"
    assert c.put("/api/v1/model", json={}).status_code == 422
    assert c.get("/api/v1/model").get_json() == {"result": "kobold_backend/tiny", "architecture": "LlamaForCausalLM",
                                                 "format": "float32", "bits_per_weight": 32.0}
    assert c.put("/api/v1/model", json={"model": "ReadOnly"}).get_json() == {}
    assert c.get("/api/v1/model").get_json() == {"result": "ReadOnly"}


def test_put_model_without_models_dir_is_501(client: Any) -> None:
    resp = client.put("/api/v1/model", json={"model": "tiny"})
    assert resp.status_code == 501 and resp.get_json()["detail"]["type"] == "not_implemented"


def test_web_page_and_ui_routes(models_app: Any) -> None:
    app, models, root = models_app
    c = app.test_client()
    page = c.get("/")
    assert page.status_code == 200 and b"<title>kobold_backend</title>" in page.data
    for asset in ("app.js", "style.css"):
        assert c.get(f"/static/{asset}").status_code == 200
    ids = [m["id"] for m in c.get("/ui/models").get_json()["models"]]
    assert ids == ["__demo__", "tiny"]
    params = c.get("/ui/parameters?model=tiny").get_json()["parameters"]
    assert "max_ctx" in [p["id"] for p in params]
    assert c.get("/ui/parameters?model=../outside").status_code == 403
    status = c.post("/ui/load", json={"model": "tiny", "parameters": {"max_ctx": 256}}).get_json()
    assert status["model"] == "tiny" and status["max_context"] == 256 and status["is_demo"] is False
    assert app.extensions["kobold_backend"].holder.active.lm.model.max_seq_len == 256
    bad = c.post("/ui/load", json={"model": "tiny", "parameters": {"max_ctx": "lots"}})
    assert bad.status_code == 422


def test_openapi_lists_every_api_route(app: Any, client: Any) -> None:
    doc = client.get("/api/v1/openapi.json").get_json()
    assert doc == client.get("/api/latest/openapi.json").get_json()
    assert doc["openapi"].startswith("3.")
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        served = path.startswith(("/api/v1/", "/api/extra/", "/v1/")) and path != "/v1/{rest}"
        if not served or path.endswith("openapi.json"):
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert (path, method) in documented, (path, method)
    props = doc["components"]["schemas"]["GenerationInput"]["properties"]
    for name in ("prompt", "max_length", "min_p", "dry_multiplier", "xtc_probability", "stop_sequence",
                 "sampler_seed", "trim_stop", "memory", "genkey", "banned_tokens", "logit_bias"):
        assert name in props
    # What the server accepts: null for any field, bodies required only where they carry required fields.
    assert all(p.get("nullable") is True for p in props.values())
    abort = doc["paths"]["/api/extra/abort"]["post"]["requestBody"]
    assert abort["required"] is False and abort["content"]["application/json"]["schema"]["required"] == []
    assert doc["paths"]["/api/v1/generate"]["post"]["requestBody"]["required"] is True
    v1 = doc["components"]["schemas"]["CompletionInput"]["properties"]
    for name in ("prompt", "max_tokens", "stop", "seed", "temperature", "min_p", "stream", "response_format"):
        assert name in v1
