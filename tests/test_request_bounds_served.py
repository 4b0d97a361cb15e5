"""Issue 35's request-side reproducers, run from the outside: one `kobold-backend serve` subprocess (speculative
n-gram decoding, an API key, --queue 2) on a tiny model whose chat template and tokenizer are hostile on purpose.
Each bad request gets a clear 4xx within 2 s and at most 256 MB of extra memory (the server and its template
workers together), /api/extra/version answers within 1 s meanwhile, and the model serves afterwards."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import requests

from kobold_backend.server.openapi import openapi_document
from tests.test_server_cli import free_port, start_serve, stop

KEY = "k35"
AUTH = {"Authorization": f"Bearer {KEY}"}
RSS_GROWTH_MB = 256
ANSWER_SECONDS = 2.0
OTHER_ROUTE_SECONDS = 1.0
GREEDY = {"max_length": 4, "rep_pen": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "sampler_seed": 3}

# One template, a branch per hostile case, chosen by the first message; the last branch is a working template.
CASES = {
    "concat": "{% set ns=namespace(s='a') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
              "{{ ns.s|length }}",
    "listrep": "{{ (['x'*99999]*10000) }}",
    "lipsum": "{{ lipsum(n=200, min=99998, max=99999)|length }}",
    "tojson": "{{ messages | tojson(indent=20000) }}",
    "format": "{{ '{0:{1}}'.format('x','999999999') }}",
    "indent": "{{ ('\\n' * 99999) | indent(99999) }}",
    "wordwrap": "{{ ('a ' * 99999) | wordwrap(1, wrapstring='x' * 99999) }}",
    "string": "{{ (['x'*99999]*10000) | string | length }}",
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}
REFUSALS = {"concat": "joined string", "listrep": "written value", "lipsum": "at most 10000 words",
            "tojson": "indent of 20000", "format": "format width", "indent": "indent filter",
            "wordwrap": "wordwrap filter", "string": "string filter",
            "loop": "the chat template ran "}  # longer than 1.0 s, or more than 1000000 steps on a fast machine
TEMPLATE = "{%- set c = messages[0]['content'] -%}" + "".join(
    f"{{%- {'if' if i == 0 else 'elif'} c == '{name}' -%}}{body}" for i, (name, body) in enumerate(CASES.items())
) + "{%- else -%}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:{%- endif -%}"
BACKTRACKING = "a" * 30 + "!"  # (a+)+$ on this: onig gives up (a Rust panic in tokenizers)


def hostile_model(src: Path, dest: Path) -> Path:
    """A copy of a byte-level BPE fixture model with TEMPLATE as its chat template and a Split (a+)+$ in front of
    its pre-tokenizer."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    spec = json.loads((dest / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split] + (
        [spec["pre_tokenizer"]] if spec.get("pre_tokenizer") else [])}
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    return dest


class Served:
    def __init__(self, proc: Any, url: str) -> None:
        self.proc, self.url = proc, url
        self.lines: List[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def post(self, path: str, body: Any, **kw: Any) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=kw.pop("headers", AUTH), timeout=60, **kw)

    def rss_mb(self) -> float:
        """Resident memory of the server and its children (the template workers), in MB."""
        pids = [self.proc.pid] + [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) ==
                                  self.proc.pid]
        total = 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/statm") as fh:
                    total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total / 2**20


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.fixture(scope="module")
def served(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = hostile_model(checkpoints.get("llama3_rope").path, tmp_path_factory.mktemp("issue35") / "hostile")
    proc, url, _ = start_serve(["--model", str(model), "--device", "cpu", "--max-context", "256", "--port",
                                str(free_port()), "--api-key", KEY, "--queue", "2", "--speculative", "ngram"])
    srv = Served(proc, url)
    try:
        yield srv
    finally:
        assert stop(proc) == 0


def watched(srv: Served, call: Callable[[], Any]) -> Tuple[Any, float, float, float]:
    """(call's result, its seconds, the slowest /api/extra/version meanwhile, the memory growth in MB)."""
    before, peak, slowest = srv.rss_mb(), [0.0], [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert requests.get(srv.url + "/api/extra/version", timeout=30).status_code == 200
            slowest[0] = max(slowest[0], time.monotonic() - t)
            peak[0] = max(peak[0], srv.rss_mb())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = time.monotonic()
    try:
        result = call()
    finally:
        took = time.monotonic() - t
        done.set()
        watcher.join()
    return result, took, slowest[0], max(peak[0], srv.rss_mb()) - before


def assert_refused(srv: Served, call: Callable[[], requests.Response], status: int, words: str) -> Dict[str, Any]:
    resp, took, slowest, grew = watched(srv, call)
    assert resp.status_code == status, resp.text[:300]
    assert words in resp.text and "Traceback" not in resp.text, resp.text[:300]
    assert took < ANSWER_SECONDS and slowest < OTHER_ROUTE_SECONDS and grew < RSS_GROWTH_MB, (took, slowest, grew)
    still_serving(srv)
    return resp.json()


def still_serving(srv: Served) -> None:
    resp = srv.post("/api/v1/generate", dict(GREEDY, prompt="Hello there"))
    assert resp.status_code == 200 and resp.json()["results"][0]["text"], resp.text[:300]


def chat(srv: Served, content: str) -> requests.Response:
    return srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})


# -- 1: the chat-template sandbox ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_hostile_chat_templates_are_refused_quickly(served: Served, case: str) -> None:
    body = assert_refused(served, lambda: chat(served, case), 400, REFUSALS[case])
    assert body["error"]["code"] == "chat_template_error"


def test_hostile_renders_at_once_do_not_stall_other_routes(served: Served) -> None:
    def six() -> List[requests.Response]:
        out: List[Any] = [None] * 6
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, chat(served, "loop"))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    answers, took, slowest, grew = watched(served, six)
    codes = sorted(a.status_code for a in answers)
    # two render (each stopped after its time), one waits, the others are told at once that the renderers are busy
    assert codes.count(400) >= 3 and set(codes) <= {400, 503}, codes
    assert all("busy" in a.json()["error"]["message"] for a in answers if a.status_code == 503)
    assert slowest < OTHER_ROUTE_SECONDS and grew < RSS_GROWTH_MB, (slowest, grew)
    assert took < 2 * ANSWER_SECONDS + 1
    reply = chat(served, "hello")
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


# -- 2, 3: the tokenizer ----------------------------------------------------------------------------------------

def test_a_tokenizer_panic_is_422(served: Served) -> None:
    body = assert_refused(served, lambda: served.post("/api/extra/tokencount", {"prompt": BACKTRACKING}), 422,
                          "tokenizer failed")
    assert list(body["detail"]) == ["prompt"]
    body = assert_refused(served, lambda: served.post("/v1/completions", {"prompt": BACKTRACKING, "max_tokens": 1}),
                          422, "tokenizer failed")
    assert body["error"]["code"] == "tokenizer_error"


def test_tokencount_is_bounded_and_long_texts_do_not_stall_other_routes(served: Served) -> None:
    assert_refused(served, lambda: served.post("/api/extra/tokencount", {"prompt": "word " * 500_000}), 422,
                   "at most 2097152")
    resp, _, slowest, _ = watched(served, lambda: served.post("/api/extra/tokencount",
                                                              {"prompt": "word " * 60_000}))
    assert resp.status_code == 200 and resp.json()["value"] == len(resp.json()["ids"]) > 60_000
    assert slowest < OTHER_ROUTE_SECONDS, slowest


# -- 4, 5, 6: banned strings, deep JSON, temperature under speculation, grammars ------------------------------

def test_long_banned_strings_are_refused_before_work(served: Served) -> None:
    body = dict(GREEDY, prompt="Hello", banned_tokens=["x" * 100_000] * 48)
    assert_refused(served, lambda: served.post("/api/v1/generate", body), 422, "at most 512")


@pytest.mark.parametrize("field", ["dry_sequence_breakers", "json_schema"])
def test_deeply_nested_json_strings_are_4xx(served: Served, field: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    body = dict(GREEDY, prompt="Hello", **{field: deep, "dry_multiplier": 0.8})
    resp = assert_refused(served, lambda: served.post("/api/v1/generate", body), 422, field)
    assert list(resp["detail"]) == [field]


def test_a_tiny_temperature_under_speculation_is_greedy(served: Served) -> None:
    greedy = served.post("/api/v1/generate", dict(GREEDY, prompt="Hello there", temperature=0))
    tiny = served.post("/api/v1/generate", dict(GREEDY, prompt="Hello there", temperature=1e-300))
    assert tiny.status_code == 200 and greedy.status_code == 200, tiny.text[:300]
    assert tiny.json()["results"][0]["text"] == greedy.json()["results"][0]["text"]


def test_over_complex_grammars_are_4xx_without_a_log_flood(served: Served) -> None:
    lines = len(served.lines)
    huge = "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))
    assert_refused(served, lambda: served.post("/api/v1/generate", dict(GREEDY, prompt="Hi", grammar=huge)), 422,
                   "at most 65536")
    wide = "root ::= " + " | ".join(f'"w{i}"' for i in range(2_500))  # within the size bound, past llguidance's rows
    assert_refused(served, lambda: served.post("/api/v1/generate", dict(GREEDY, prompt="Hi", grammar=wide)), 422,
                   "max is 2000")
    assert len(served.lines) - lines < 20, "".join(served.lines[lines:])[-2000:]


# -- 7: /v1 consistency -----------------------------------------------------------------------------------------

def test_every_v1_path_checks_the_key_and_answers_in_openai_shape(served: Served) -> None:
    for path in ("/v1/models/x%0Ay", "/v1/nothing%0Ahere", "/v1/models"):
        resp = requests.get(served.url + path, timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", (path, resp.text)
    resp = requests.get(served.url + "/v1/models/x%0Ay", headers=AUTH, timeout=10)
    assert resp.status_code == 404 and "message" in resp.json()["error"], resp.text


def _openapi_to_jsonschema(node: Any, schemas: Dict[str, Any]) -> Any:
    """OpenAPI 3.0 schema -> JSON Schema: $refs inlined, nullable as a null type."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n, schemas) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _openapi_to_jsonschema(schemas[node["$ref"].rsplit("/", 1)[1]], schemas)
    out = {k: _openapi_to_jsonschema(v, schemas) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n": 2, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}}),
])
def test_streamed_events_match_the_published_schema(served: Served, path: str, body: Dict[str, Any]) -> None:
    import jsonschema

    doc = openapi_document()
    media = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    schema = _openapi_to_jsonschema(media["x-sse-data"], doc["components"]["schemas"])
    resp = served.post(path, body, stream=True)
    events = [line[6:] for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    for event in events[:-1]:
        jsonschema.validate(json.loads(event), schema)


# -- 10: memory kept after large request bodies -----------------------------------------------------------------

def test_memory_comes_back_after_large_bodies(served: Served) -> None:
    """Large bodies (refused or tokenized) leave the C allocator's per-thread arenas full of freed pages, which glibc
    keeps for good: the server hands them back after a large request (the probe saw 279 MB grow to 2.35 GB and
    stay). Three rounds of four concurrent requests of 6-24 MB, then the resident memory is back within the issue's
    256 MB of where it started (here, 2026-12-03: +781 MB kept without the trim; +170 MB with it after the suite's
    other tests, whose objects and workers stay around)."""
    requests.get(served.url + "/api/extra/version", timeout=30)
    before = served.rss_mb()
    bodies = [{"prompt": "word " * 1_200_000}, {"prompt": "x" * 24_000_000}, {"prompt": "word " * 400_000},
              {"prompt": ["a " * 1_000_000] * 3}]
    for _ in range(3):
        threads = [threading.Thread(target=served.post, args=("/api/extra/tokencount", body)) for body in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    deadline = time.monotonic() + 5
    while served.rss_mb() - before > RSS_GROWTH_MB and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served.rss_mb() - before < RSS_GROWTH_MB, (before, served.rss_mb())
