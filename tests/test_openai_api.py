"""Flask test-client tests of the OpenAI-compatible routes (/v1): answers against transformers (greedy text, chat
template ids), OpenAI's SSE framing byte for byte, usage, n and prompt lists, the KoboldCpp fields SillyTavern mixes
in, and every error in OpenAI's shape (400 with the field, 401, 404, 405, 413, 500 without a traceback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import sentencepiece as spm
import torch

from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.engine_holder import EngineHolder
from tests.server_helpers import CONTEXT, hf_greedy, make_app, make_holder, text_of
from tests.test_openai_chat_template import LLAMA2, LLAMA3, with_template

PROMPT = "The old lighthouse keeper climbed the stairs"
MESSAGES = [{"role": "system", "content": "You keep the light."},
            {"role": "user", "content": "What do you see from the top?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(checkpoints: Any) -> Any:
    return checkpoints.get("dense_fp32")


@pytest.fixture(scope="module")
def chat_dir(ckpt: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 fixture model with Llama-2's chat template in its tokenizer_config.json."""
    return with_template(ckpt.path, tmp_path_factory.mktemp("openai") / "dense_chat", LLAMA2)


@pytest.fixture(scope="module")
def sp(ckpt: Any) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(ckpt.path / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf_model(ckpt: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(ckpt.oracle_path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def app(chat_dir: Path) -> Any:
    app = make_app(chat_dir)
    yield app
    app.extensions["kobold_backend"].close()


@pytest.fixture()
def client(app: Any) -> Any:
    return app.test_client()




def hf_chat_ids(folder: Path, messages: List[Dict[str, Any]], template: Any = None) -> List[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    return list(hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                       tokenize=True, return_dict=False))


def post(client: Any, route: str, **body: Any) -> Dict[str, Any]:
    resp = client.post(route, json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def complete(client: Any, **body: Any) -> Dict[str, Any]:
    body.setdefault("prompt", PROMPT)
    return post(client, "/v1/completions", **body)


def chat(client: Any, **body: Any) -> Dict[str, Any]:
    body.setdefault("messages", MESSAGES)
    return post(client, "/v1/chat/completions", **body)


def sse_chunks(raw: bytes) -> List[Dict[str, Any]]:
    """Parse an OpenAI SSE body strictly: `data: <json.dumps(chunk)>` + blank line each, `data: [DONE]` last."""
    assert raw.endswith(b"data: [DONE]\n\n")
    blocks = raw[: -len(b"data: [DONE]\n\n")].split(b"\n\n")
    assert blocks[-1] == b""
    chunks = []
    for block in blocks[:-1]:
        assert block.startswith(b"data: ") and b"\n" not in block, block
        chunk = json.loads(block[6:])
        assert block == b"data: " + json.dumps(chunk).encode()
        chunks.append(chunk)
    return chunks


def stream(client: Any, route: str, **body: Any) -> Tuple[Any, List[Dict[str, Any]]]:
    resp = client.post(route, json=dict(body, stream=True))
    assert resp.status_code == 200, resp.get_data(as_text=True)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Cache-Control"] == "no-cache"
    return resp, sse_chunks(resp.data)


def streamed_texts(chunks: List[Dict[str, Any]], chat_mode: bool) -> Dict[int, str]:
    texts: Dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            piece = choice["delta"].get("content", "") if chat_mode else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


# -- models -------------------------------------------------------------------------------------------------

def test_models_list_and_retrieve(client: Any) -> None:
    listing = client.get("/v1/models").get_json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert card["id"] == "dense_chat" and card["object"] == "model" and card["owned_by"] == "kobold_backend"
    assert isinstance(card["created"], int)
    assert client.get("/v1/models/dense_chat").get_json() == card
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404
    assert missing.get_json() == {"error": {"message": "The model 'gpt-4' does not exist.",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}


# -- completions against transformers ---------------------------------------------------------------------------

def test_completion_greedy_matches_transformers(client: Any, sp: spm.SentencePieceProcessor, hf_model: Any) -> None:
    prompt_ids = [1] + sp.encode(PROMPT)
    expect = hf_greedy(hf_model, prompt_ids, 10)
    out = complete(client, model="anything-goes", max_tokens=10, temperature=0)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "dense_chat"
    [choice] = out["choices"]
    assert choice == {"text": text_of(sp, prompt_ids, expect), "index": 0, "logprobs": None,
                      "finish_reason": "stop" if expect[-1] == 2 else "length"}
    assert out["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expect),
                            "total_tokens": len(prompt_ids) + len(expect)}


def test_token_prompts_lists_and_n(client: Any, sp: spm.SentencePieceProcessor, hf_model: Any) -> None:
    ids_a = [1] + sp.encode(PROMPT)
    ids_b = [1] + sp.encode("Far away, the sea")
    expect_a = text_of(sp, ids_a, hf_greedy(hf_model, ids_a, 6, eos=False))
    expect_b = text_of(sp, ids_b, hf_greedy(hf_model, ids_b, 6, eos=False))
    assert complete(client, prompt=ids_a, max_tokens=6, **GREEDY)["choices"][0]["text"] == expect_a
    out = complete(client, prompt=[PROMPT, ids_b], max_tokens=6, n=2, **GREEDY)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, expect_a), (1, expect_a), (2, expect_b),
                                                                 (3, expect_b)]
    # Each prompt counts once in the usage, each choice's tokens count.
    assert out["usage"] == {"prompt_tokens": len(ids_a) + len(ids_b), "completion_tokens": 24, "total_tokens":
                            len(ids_a) + len(ids_b) + 24}
    lists = complete(client, prompt=[ids_a, ids_b], max_tokens=6, **GREEDY)
    assert [c["text"] for c in lists["choices"]] == [expect_a, expect_b]


def test_chat_greedy_matches_transformers(client: Any, chat_dir: Path, sp: spm.SentencePieceProcessor,
                                          hf_model: Any) -> None:
    ids = hf_chat_ids(chat_dir, MESSAGES)
    assert ids[0] == 1 and sp.decode(ids).startswith("[INST] <<SYS>>")
    expect = hf_greedy(hf_model, ids, 12)
    out = chat(client, model="gpt-4o", max_tokens=12, temperature=0)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": text_of(sp, ids, expect)},
                               "logprobs": None, "finish_reason": "stop" if expect[-1] == 2 else "length"}]
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == len(expect)
    pieces = [{"type": "text", "text": "You keep"}, {"type": "text", "text": "the light."}]
    parts = [{"role": "system", "content": pieces}, MESSAGES[1], {"role": "assistant", "content": "The sea."},
             {"role": "user", "content": "And?"}]
    joined = [dict(parts[0], content="You keep\nthe light.")] + parts[1:]
    ids = hf_chat_ids(chat_dir, joined)
    out = chat(client, messages=parts, max_tokens=6, **GREEDY)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == text_of(sp, ids, hf_greedy(hf_model, ids, 6, eos=False))


def test_max_tokens_defaults_and_clamps(client: Any, chat_dir: Path) -> None:
    assert complete(client, **GREEDY)["usage"]["completion_tokens"] == 16  # OpenAI's default
    assert complete(client, max_new_tokens=3, **GREEDY)["usage"]["completion_tokens"] == 3
    # At least min(context - 4, 16) tokens stay for the prompt, as on the KoboldAI routes.
    assert complete(client, max_tokens=10**6, **GREEDY)["usage"]["completion_tokens"] == CONTEXT - 16
    # Chat answers may use the rest of the context.
    out = chat(client, **GREEDY)["usage"]
    assert out["completion_tokens"] == CONTEXT - len(hf_chat_ids(chat_dir, MESSAGES)) == CONTEXT - out[
        "prompt_tokens"]


def test_stop_strings_are_cut_and_never_streamed(client: Any) -> None:
    base = complete(client, max_tokens=16, **GREEDY)["choices"][0]["text"]
    stop = base.strip()[2:5]
    assert stop.strip()
    cut = base[: base.index(stop)]
    for key, value in (("stop", stop), ("stop", [stop, "zzzz"]), ("stopping_strings", [stop])):
        out = complete(client, max_tokens=16, **{key: value}, **GREEDY)
        assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
        _, chunks = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=16, **{key: value}, **GREEDY)
        assert streamed_texts(chunks, False) == {0: cut}
        assert all(stop not in c["choices"][0]["text"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_eos_finishes_with_stop(client: Any) -> None:
    out = complete(client, max_tokens=8, temperature=0, logit_bias={"2": 100})
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["text"] == ""
    assert out["usage"]["completion_tokens"] == 1
    banned = complete(client, max_tokens=4, temperature=0, logit_bias={"2": 100}, ban_eos_token=True)
    assert banned["choices"][0]["finish_reason"] == "length" and banned["usage"]["completion_tokens"] == 4


def test_seeds_n_and_stream_agree(client: Any) -> None:
    body = {"max_tokens": 10, "temperature": 1.5, "ignore_eos": True}
    many = [c["text"] for c in complete(client, n=3, seed=1234, **body)["choices"]]
    singles = [complete(client, seed=1234 + i, **body)["choices"][0]["text"] for i in range(3)]
    assert many == singles and len(set(singles)) > 1
    assert complete(client, sampler_seed=1234, **body)["choices"][0]["text"] == singles[0]
    _, chunks = stream(client, "/v1/completions", prompt=PROMPT, n=3, seed=1234, **body)
    assert streamed_texts(chunks, False) == dict(enumerate(singles))
    chats = [c["message"]["content"] for c in chat(client, n=2, seed=99, **body)["choices"]]
    _, chunks = stream(client, "/v1/chat/completions", messages=MESSAGES, n=2, seed=99, **body)
    assert streamed_texts(chunks, True) == dict(enumerate(chats))
    assert chats[0] != chats[1]


def test_sillytavern_koboldcpp_text_completion_body(client: Any) -> None:
    """The body SillyTavern's "KoboldCpp" Text Completion mode posts, OpenAI and KoboldCpp names mixed."""
    body = {
        "prompt": PROMPT, "model": "koboldcpp/dense_chat", "max_new_tokens": 5, "max_tokens": 5,
        "temperature": 0.7, "top_p": 0.9, "typical_p": 1, "typical": 1, "sampler_seed": 42, "seed": 42,
        "min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": 0.1, "presence_penalty": 0.2, "top_k": 40,
        "skew": 0, "min_tokens": 0, "length_penalty": 1, "early_stopping": False, "add_bos_token": True,
        "smoothing_factor": 0.1, "smoothing_curve": 1, "dry_allowed_length": 2, "dry_multiplier": 0.8,
        "dry_base": 1.75, "dry_sequence_breakers": json.dumps(["\n", ":", "\"", "*"]), "dry_penalty_last_n": 64,
        "max_tokens_second": 0, "stopping_strings": ["\nUser:"], "stop": ["\nUser:"], "truncation_length": 128,
        "ban_eos_token": False, "skip_special_tokens": True, "include_reasoning": True, "top_a": 0, "tfs": 1,
        "mirostat_mode": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "custom_token_bans": "", "banned_strings": [],
        "api_type": "koboldcpp", "api_server": "http://127.0.0.1:5001/v1", "sampler_order": [6, 0, 1, 3, 4, 2, 5],
        "xtc_threshold": 0.1, "xtc_probability": 0, "dynatemp_range": 0, "dynatemp_exponent": 1,
        "rep_pen": 1.1, "rep_pen_range": 320, "rep_pen_slope": 1, "logit_bias": {}, "n": 1, "grammar": "",
        "stream": False,
    }
    out = complete(client, **body)
    assert out["usage"]["completion_tokens"] <= 5
    again = complete(client, **body)
    assert again["choices"] == out["choices"]  # seeded
    resp = client.post("/v1/completions", json=dict(body, dry_sequence_breakers="[\"\\n\", "))
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "dry_sequence_breakers"


# -- validation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "typical_p": "a"}, "typical_p"),
    ({"prompt": "x", "n": 6}, "n"),
    ({"prompt": "x", "seed": -5}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "repetition_penalty": 0.5}, "repetition_penalty"),
    ({"prompt": "x", "mirostat_mode": 3}, "mirostat_mode"),
    ({"prompt": "x", "sampler_order": [0, 0]}, "sampler_order"),
    ({"prompt": "x", "custom_token_bans": "1,x"}, "custom_token_bans"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": "5"}, "logprobs"),
    ({"prompt": "x", "logprobs": 2, "num_beams": 2}, "logprobs"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "model": 5}, "model"),
    (["x"], "body"),
])
def test_completion_validation_400(client: Any, body: Any, param: str) -> None:
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.get_data(as_text=True)
    error = resp.get_json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("messages,param", [
    (None, "messages"),
    ([], "messages"),
    (["hi"], "messages[0]"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "x", "name": 3}], "messages[0].name"),
])
def test_chat_validation_400(client: Any, messages: Any, param: str) -> None:
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.get_json()["error"]["param"] == param


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
])
def test_chat_logprobs_validation_400(client: Any, extra: Dict[str, Any], param: str) -> None:
    body = dict({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, **extra)
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.get_json()["error"]["param"] == param


@pytest.mark.parametrize("stream_flag", [False, True])
def test_token_ids_outside_the_vocabulary(client: Any, stream_flag: bool) -> None:
    for ids in ([1, 5, 1000], [1, -3], [1, 2**70]):
        resp = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "stream": stream_flag})
        error = error_of(resp, 400)
        assert error["param"] == "prompt" and "outside the vocabulary" in error["message"]


def test_echo_false_and_accepted_extras(client: Any) -> None:
    out = complete(client, echo=False, max_tokens=2, logprobs=None, best_of=1, user="u", suffix="",
                   response_format={"type": "text"}, tools=[], **GREEDY)
    assert out["usage"]["completion_tokens"] == 2
    out = chat(client, messages=[{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
               max_tokens=2, logprobs=False, **GREEDY)
    assert out["usage"]["completion_tokens"] == 2


def test_chat_template_errors(client: Any) -> None:
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"},
                                                                  {"role": "user", "content": "b"}]})
    assert resp.status_code == 400
    error = resp.get_json()["error"]
    assert error["code"] == "chat_template_error" and error["param"] == "messages"
    assert "Conversation roles must alternate" in error["message"]
    long = [{"role": "user", "content": "word " * 400}]
    resp = client.post("/v1/chat/completions", json={"messages": long})
    assert resp.status_code == 400
    assert resp.get_json()["error"]["code"] == "context_length_exceeded"


def test_no_chat_template_and_configured_template(ckpt: Any, hf_model: Any, sp: spm.SentencePieceProcessor) -> None:
    holder = make_holder(ckpt.path)
    app = create_app(ServerConfig(), holder)
    try:
        resp = app.test_client().post("/v1/chat/completions", json={"messages": MESSAGES})
        assert resp.status_code == 400
        error = resp.get_json()["error"]
        assert error["code"] == "no_chat_template" and error["type"] == "invalid_request_error"
        assert "--chat-template" in error["message"]
    finally:
        app.extensions["kobold_backend"].close()
    app = create_app(ServerConfig(chat_template=LLAMA3), holder)
    try:
        short = [{"role": "user", "content": "Hi"}]
        ids = hf_chat_ids(ckpt.path, short, template=LLAMA3)
        out = app.test_client().post("/v1/chat/completions", json={"messages": short, "max_tokens": 5,
                                                                   **GREEDY}).get_json()
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["message"]["content"] == text_of(sp, ids, hf_greedy(hf_model, ids, 5, eos=False))
    finally:
        app.extensions["kobold_backend"].close()


# -- SSE --------------------------------------------------------------------------------------------------------

def test_completion_stream_framing(client: Any) -> None:
    sync = complete(client, max_tokens=10, **GREEDY)
    _, chunks = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=10, **GREEDY)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert list(c) == ["id", "object", "created", "model", "choices"]  # no usage key unless asked for
        assert c["object"] == "text_completion" and c["model"] == "dense_chat"
        [choice] = c["choices"]
        assert list(choice) == ["text", "index", "logprobs", "finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None and c["choices"][0]["text"] for c in chunks[:-1])
    assert chunks[-1]["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
    assert streamed_texts(chunks, False) == {0: sync["choices"][0]["text"]}
    assert len(chunks) >= 3


def test_chat_stream_framing_and_usage(client: Any) -> None:
    sync = chat(client, max_tokens=10, **GREEDY)
    _, chunks = stream(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=10,
                       stream_options={"include_usage": True}, **GREEDY)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    body = chunks[1:-2]
    assert body and all(list(c["choices"][0]["delta"]) == ["content"] for c in body)
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == sync["usage"]
    assert streamed_texts(chunks, True) == {0: sync["choices"][0]["message"]["content"]}


def test_stream_eos_byte_for_byte(client: Any) -> None:
    resp = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                     "logit_bias": {"2": 100}, "stream": True})
    first = json.loads(resp.data.split(b"\n\n")[0][6:])
    head = f'{{"id": "{first["id"]}", "object": "chat.completion.chunk", "created": {first["created"]}, ' \
           f'"model": "dense_chat", "choices": [{{"index": 0, '
    assert resp.data == (
        b"data: " + head.encode() + b'"delta": {"role": "assistant", "content": ""}, "logprobs": null, '
        b'"finish_reason": null}]}\n\n'
        b"data: " + head.encode() + b'"delta": {}, "logprobs": null, "finish_reason": "stop"}]}\n\n'
        b"data: [DONE]\n\n")


def test_stream_non_ascii_is_escaped_json(client: Any) -> None:
    from kobold_backend.server.openai_api import Meta, format_chunk

    meta = Meta("cmpl-1", 7, "m", chat=False, include_usage=False)
    assert format_chunk(meta, [{"text": "é\n\"", "index": 0}]) == (
        b'data: {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", '
        b'"choices": [{"text": "\\u00e9\\n\\"", "index": 0}]}\n\n')


# -- errors -----------------------------------------------------------------------------------------------------

def error_of(resp: Any, status: int) -> Dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert b"Traceback" not in resp.data
    return body["error"]


def test_http_errors_in_openai_shape(client: Any) -> None:
    bad = error_of(client.post("/v1/completions", data=b'{"prompt": ', content_type="application/json"), 400)
    assert bad["type"] == "invalid_request_error" and "JSON" in bad["message"]
    assert error_of(client.get("/v1/nothing/here"), 404)["type"] == "invalid_request_error"
    assert error_of(client.post("/v1/models"), 405)
    na = client.get("/v1/chat/completions")
    assert error_of(na, 405) and "POST" in na.headers["Allow"]


def test_413_body_too_large(ckpt: Any) -> None:
    app = make_app(ckpt.path, max_content_length=1000)
    try:
        resp = app.test_client().post("/v1/completions", json={"prompt": "x" * 5000})
        assert error_of(resp, 413)["type"] == "invalid_request_error"
    finally:
        app.extensions["kobold_backend"].close()


def test_no_model_loaded() -> None:
    app = create_app(ServerConfig(), EngineHolder())
    try:
        c = app.test_client()
        assert c.get("/v1/models").get_json() == {"object": "list", "data": []}
        for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            error = error_of(c.post(route, json=body), 501)
            assert error == {"message": "No model is loaded.", "type": "server_error", "param": None,
                             "code": "not_implemented"}
    finally:
        app.extensions["kobold_backend"].close()


def test_unexpected_errors_are_500_without_traceback(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(ckpt.path)
    try:
        gen = app.extensions["kobold_backend"].holder.active.generator

        def broken(req: Any) -> Any:
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(gen, "stream", broken)
        c = app.test_client()
        for stream_flag in (False, True):
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": stream_flag})
            assert error_of(resp, 500) == {"message": "Internal server error.", "type": "server_error",
                                           "param": None, "code": None}
            assert b"secret" not in resp.data

        def breaks_later(req: Any) -> Any:
            from kobold_backend.engine.generator import TokenEvent

            yield TokenEvent("Hello", 5)
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(gen, "stream", breaks_later)
        resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert resp.status_code == 200 and b"secret" not in resp.data
        raw = resp.data
        assert raw.endswith(b'data: {"error": {"message": "Internal server error.", "type": "server_error", '
                            b'"param": null, "code": null}}\n\ndata: [DONE]\n\n')
        assert json.loads(raw.split(b"\n\n")[0][6:])["choices"][0]["text"] == "Hello"
    finally:
        app.extensions["kobold_backend"].close()


# -- key, CORS, genkey --------------------------------------------------------------------------------------------

def test_api_key_and_cors(ckpt: Any) -> None:
    app = make_app(ckpt.path, api_key="s3cret")
    try:
        c = app.test_client()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, route in (("get", "/v1/models"), ("post", "/v1/completions"), ("get", "/v1/nothing")):
                resp = getattr(c, method)(route, json={"prompt": "x", "max_tokens": 1}, headers=headers)
                assert error_of(resp, 401) == {"message": "Incorrect API key provided.",
                                               "type": "invalid_request_error", "param": None,
                                               "code": "invalid_api_key"}
                assert resp.headers["WWW-Authenticate"] == "Bearer"
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                    headers={"Authorization": "Bearer s3cret", "Origin": "http://ui.example"})
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "*"
        assert c.get("/v1/models", headers={"apikey": "s3cret"}).status_code == 200
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os"})
        assert pre.status_code == 200
        assert pre.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in pre.headers["Access-Control-Allow-Methods"]
        assert pre.headers["Access-Control-Allow-Headers"] == "authorization,content-type,x-stainless-os"
    finally:
        app.extensions["kobold_backend"].close()
    app = make_app(ckpt.path, cors_origins=("http://a.example",))
    try:
        c = app.test_client()
        assert c.get("/v1/models", headers={"Origin": "http://a.example"}).headers[
            "Access-Control-Allow-Origin"] == "http://a.example"
        assert "Access-Control-Allow-Origin" not in c.get("/v1/models", headers={"Origin": "http://b.example"}).headers
    finally:
        app.extensions["kobold_backend"].close()


def test_genkey_check_and_perf(client: Any) -> None:
    out = complete(client, max_tokens=5, genkey="KCPP9876", **GREEDY)
    check = client.post("/api/extra/generate/check", json={"genkey": "KCPP9876"}).get_json()
    assert check == {"results": [{"text": out["choices"][0]["text"]}]}
    perf = client.get("/api/extra/perf").get_json()
    assert perf["last_token_count"] == 5 and perf["last_input_count"] == out["usage"]["prompt_tokens"]


# -- passthrough --------------------------------------------------------------------------------------------------

def test_passthrough_like_the_kobold_routes(ckpt: Any, chat_dir: Path, hf_model: Any,
                                            sp: spm.SentencePieceProcessor) -> None:
    from kobold_backend.engine.passthrough import PassthroughConfig
    from tests.fixtures.hf_oracle import row_rel_err
    from tests.test_passthrough import decode_capture

    spec = {"capture": {"layers": [0], "phase": "prompt", "dtype": "float32"}}
    disabled = make_app(chat_dir)
    try:
        resp = disabled.test_client().post("/v1/completions", json={"prompt": PROMPT, "passthrough": spec})
        assert error_of(resp, 403)["code"] == "forbidden"
    finally:
        disabled.extensions["kobold_backend"].close()
    app = create_app(ServerConfig(passthrough=PassthroughConfig()), make_holder(chat_dir))
    try:
        c = app.test_client()
        bad = c.post("/v1/chat/completions", json={"messages": MESSAGES, "passthrough": {"shout": {}}})
        assert error_of(bad, 400)["param"] == "passthrough.shout"
        out = complete(c, max_tokens=3, passthrough=spec, n=2, **GREEDY)
        prompt_ids = [1] + sp.encode(PROMPT)
        with torch.no_grad():
            hidden = hf_model(torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states[1]
        for choice in out["choices"]:
            entry = choice["passthrough_results"]["capture"]["prompt"]["0"]
            assert entry["positions"] == [len(prompt_ids) - 1]
            assert row_rel_err(decode_capture(entry), hidden[:, -1:]) < 1e-4
        assert c.get("/api/extra/perf").get_json()["passthrough"] is True
        assert "passthrough_results" not in chat(c, max_tokens=2, **GREEDY)["choices"][0]
    finally:
        app.extensions["kobold_backend"].close()
