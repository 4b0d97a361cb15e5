"""The official `openai` Python package against a real server on 127.0.0.1 (waitress, ephemeral port): models,
completions and chat completions streamed and not, stop strings, seeds, n, usage, the client's exception types
(400, 401, 503 for a full queue), a closed stream aborting its generation, and `serve --chat-template FILE`."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.server_helpers import live_server, make_app, perf, wait_for
from tests.test_openai_chat_template import LLAMA2, LLAMA3, with_template
from tests.test_server_cli import REPO, free_port, start_serve, stop

openai = pytest.importorskip("openai")
AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

PROMPT = "The old lighthouse keeper climbed the stairs"
MESSAGES: List[Dict[str, Any]] = [{"role": "system", "content": "You keep the light."},
                                  {"role": "user", "content": "What do you see from the top?"}]
DELAY = 0.05  # seconds added to every forward pass of the slow server
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def chat_dir(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(checkpoints.get("dense_fp32").path, tmp_path_factory.mktemp("openai_client") / "dense_chat",
                         LLAMA2)


@pytest.fixture(scope="module")
def server(chat_dir: Path) -> Any:
    with live_server(make_app(chat_dir)) as srv:
        yield srv


def client_for(srv: Any, key: str = "no-key-needed") -> Any:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return client_for(server)




def streamed_completion(client: Any, **kwargs: Any) -> Dict[int, str]:
    texts: Dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


def streamed_chat(client: Any, **kwargs: Any) -> List[Any]:
    return list(client.chat.completions.create(stream=True, **kwargs))


def chat_texts(chunks: List[Any]) -> Dict[int, str]:
    texts: Dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def test_models_list(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["dense_chat"]
    assert models.data[0].owned_by == "kobold_backend"
    assert client.models.retrieve("dense_chat").id == "dense_chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_streamed_and_not(client: Any) -> None:
    out = client.completions.create(model="dense_chat", prompt=PROMPT, max_tokens=12, **GREEDY)
    assert out.object == "text_completion" and len(out.choices) == 1
    text = out.choices[0].text
    assert text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert streamed_completion(client, model="dense_chat", prompt=PROMPT, max_tokens=12, **GREEDY) == {0: text}


def test_chat_streamed_and_not(client: Any) -> None:
    out = client.chat.completions.create(model="dense_chat", messages=MESSAGES, max_tokens=12, **GREEDY)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content and out.choices[0].finish_reason == "length"
    chunks = streamed_chat(client, model="dense_chat", messages=MESSAGES, max_tokens=12,
                           stream_options={"include_usage": True}, **GREEDY)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chat_texts(chunks) == {0: message.content}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens)


def test_stop_strings(client: Any) -> None:
    base = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    stop = base.strip()[2:5]
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].text == base[: base.index(stop)] and out.choices[0].finish_reason == "stop"
    assert streamed_completion(client, model="m", prompt=PROMPT, max_tokens=16, stop=stop, **GREEDY) == {
        0: base[: base.index(stop)]}
    reply = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, **GREEDY)
    content = reply.choices[0].message.content
    stop = content.strip()[1:4]
    cut = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, stop=stop, **GREEDY)
    assert cut.choices[0].message.content == content[: content.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeds_are_reproducible_streamed_or_not(client: Any) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.5, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(seed=7, **body).choices[0].text
    assert client.completions.create(seed=7, **body).choices[0].text == first
    assert streamed_completion(client, seed=7, **body) == {0: first}
    others = {client.completions.create(seed=s, **body).choices[0].text for s in (8, 9, 10)}
    assert len(others | {first}) > 1
    chat_body = {"model": "m", "messages": MESSAGES, "max_tokens": 10, "temperature": 1.5, "seed": 3,
                 "extra_body": {"ignore_eos": True}}
    reply = client.chat.completions.create(**chat_body).choices[0].message.content
    assert client.chat.completions.create(**chat_body).choices[0].message.content == reply
    assert chat_texts(streamed_chat(client, **chat_body)) == {0: reply}


def test_n_choices(client: Any) -> None:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.5, "seed": 100,
            "extra_body": {"ignore_eos": True}}
    out = client.completions.create(n=3, **body)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [client.completions.create(**dict(body, seed=100 + i)).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    assert streamed_completion(client, n=3, **body) == dict(enumerate(singles))
    chunks = streamed_chat(client, model="m", messages=MESSAGES, n=2, max_tokens=6, temperature=1.5, seed=5)
    assert sorted(chat_texts(chunks)) == [0, 1]
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"] * 2


def test_kobold_fields_through_extra_body(client: Any) -> None:
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1, extra_body={
        "min_p": 0.1, "top_k": 40, "rep_pen": 1.1, "dry_multiplier": 0.8, "dry_sequence_breakers": "[\"\\n\", \":\"]",
        "xtc_probability": 0.5, "xtc_threshold": 0.1, "banned_strings": ["zz"], "sampler_order": [6, 0, 1, 3, 4, 2, 5]})
    assert out.usage.completion_tokens <= 4


def test_errors_raise_the_clients_exception_types(client: Any, chat_dir: Path) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m", prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m", prompt=PROMPT, echo=True)
    assert bad.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"},
                                                            {"role": "user", "content": "b"}])
    assert bad.value.code == "chat_template_error"
    with live_server(make_app(chat_dir, api_key="k3y")) as srv:
        with pytest.raises(openai.AuthenticationError) as denied:
            client_for(srv, "wrong").models.list()
        assert denied.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client_for(srv, "wrong").completions.create(model="m", prompt="x", max_tokens=1)
        assert client_for(srv, "k3y").completions.create(model="m", prompt="x", max_tokens=1).choices


def test_full_queue_is_503_and_closing_a_stream_aborts(chat_dir: Path) -> None:
    with live_server(make_app(chat_dir, delay=DELAY, max_queue=0)) as srv:
        client = client_for(srv)
        stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100, stream=True,
                                                **GREEDY)
        received = []
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:
                break
        assert perf(srv)["idle"] == 0
        with pytest.raises(openai.APIStatusError) as busy:
            client.completions.create(model="m", prompt="x", max_tokens=1)
        assert isinstance(busy.value, openai.InternalServerError) and busy.value.status_code == 503
        assert busy.value.response.headers["Retry-After"] == "1"
        stream.close()
        t0 = time.monotonic()
        wait_for(lambda: perf(srv)["idle"] == 1, timeout=3)
        assert time.monotonic() - t0 < 2.0
        assert perf(srv)["last_token_count"] < 50
        # A synchronous client that gives up aborts its generation too.
        result: Dict[str, Any] = {}

        def slow_call() -> None:
            try:
                openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=0.5).completions.create(
                    model="m", prompt="x", max_tokens=100, **GREEDY)
            except openai.APITimeoutError as e:
                result["error"] = e

        worker = threading.Thread(target=slow_call)
        worker.start()
        worker.join(10)
        assert isinstance(result.get("error"), openai.APITimeoutError)
        wait_for(lambda: perf(srv)["idle"] == 1, timeout=3)
        assert perf(srv)["last_token_count"] < 50


def test_serve_chat_template_option(checkpoints: Any, tmp_path: Path) -> None:
    """`kobold-backend serve --chat-template FILE` on a model without a template; a broken file stops serve."""
    model = checkpoints.get("dense_fp32").path
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    run = subprocess.run([sys.executable, "-m", "kobold_backend.cli", "serve", "--model", str(model),
                          "--chat-template", str(broken), "--port", str(free_port())],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--chat-template" in run.stderr and "line 1" in run.stderr
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3)
    proc, url, _ = start_serve(["--model", str(model), "--chat-template", str(template), "--device", "cpu",
                                "--max-context", "256", "--port", str(free_port())])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="m", prompt="x", max_tokens=0)
        assert bad.value.param == "max_tokens"
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3, **GREEDY)
        assert reply.usage.completion_tokens == 3
        ids = AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
            [{"role": "user", "content": "Hi"}], chat_template=LLAMA3, add_generation_prompt=True, tokenize=True,
            return_dict=False)
        assert reply.usage.prompt_tokens == len(ids)
    finally:
        assert stop(proc) == 0


def test_demo_model_chats_with_no_flags() -> None:
    """The shipped demo model has a chat template: transformers renders it as written down here, and the openai
    client's chat completions (streamed and not) work on a server given no --chat-template."""
    from kobold_backend.demo import shipped_demo_dir

    demo = shipped_demo_dir()
    if demo is None:
        pytest.skip("the trained demo model is not shipped in this checkout")
    expected = ("<s>You keep the light.\n\nUser: What do you see from the top?\nAssistant: The sea.\n"
                "User: And then?\nAssistant:")
    messages = MESSAGES + [{"role": "assistant", "content": " The sea. "}, {"role": "user", "content": "And then?"}]
    hf = AutoTokenizer.from_pretrained(str(demo))
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    prompt_ids = hf(expected, add_special_tokens=False)["input_ids"]
    with live_server(make_app(demo)) as srv:
        client = client_for(srv)
        out = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
        assert out.choices[0].message.content and out.usage.prompt_tokens == len(prompt_ids)
        chunks = streamed_chat(client, model="demo", messages=messages, max_tokens=8, temperature=0)
        assert chat_texts(chunks) == {0: out.choices[0].message.content}
