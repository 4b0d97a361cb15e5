"""A real waitress server on 127.0.0.1 (ephemeral port) driven by the PyPI `koboldapi` client and by raw HTTP:
streaming through waitress, queueing and 503, abort, disconnects, API key, and no thread or job leak."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest
import requests
import sentencepiece as spm

from kobold_backend.server.queue import FINISHED_KEEP, Job
from tests.server_helpers import live_server, make_app, perf, wait_for

BUSY = {"detail": {"msg": "Server is busy; please try again later.", "type": "service_unavailable"}}
DELAY = 0.05  # seconds added to every forward pass of the "slow" server
SLOW_TOKENS = 100  # a slow generation of this many tokens takes ~5 s, far longer than any check below


@pytest.fixture(scope="module")
def ckpt(checkpoints: Any) -> Any:
    return checkpoints.get("dense_fp32")


@pytest.fixture(scope="module")
def fast(ckpt: Any) -> Any:
    with live_server(make_app(ckpt.path)) as server:
        yield server


@pytest.fixture()
def slow(ckpt: Any) -> Any:
    with live_server(make_app(ckpt.path, delay=DELAY, max_queue=1)) as server:
        yield server




def slow_body(**extra: Any) -> Dict[str, Any]:
    body = {"prompt": "Tell me a long story", "max_length": SLOW_TOKENS, "temperature": 0,
            "use_default_badwordsids": True}
    body.update(extra)
    return body


def raw_request(server: Any, path: str, body: Dict[str, Any]) -> socket.socket:
    """Send a POST on a plain socket (so the test controls reading and closing)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_sse_events(sock: socket.socket, stop_after: Optional[int] = None) -> List[Tuple[float, Dict[str, Any]]]:
    """Read a chunked SSE response, timestamping each event as it arrives."""
    buf = b""
    events: List[Tuple[float, Dict[str, Any]]] = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return events
        buf += chunk
        now = time.monotonic()
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            line = [x for x in block.split(b"\n") if x.startswith(b"data: ")]
            if line:
                event = json.loads(line[0][6:])
                events.append((now, event))
                if event["finish_reason"] != "null" or (stop_after and len(events) >= stop_after):
                    return events


# -- the koboldapi client ----------------------------------------------------------------------------------

def test_koboldapi_client_routes(fast: Any, ckpt: Any) -> None:
    from koboldapi.core.api import KoboldAPI

    api = KoboldAPI(fast.url)
    assert api.get_model() == "kobold_backend/dense_fp32"
    assert api.get_version()["result"] == "KoboldCpp"
    assert api.get_max_context_length() == 128
    sp = spm.SentencePieceProcessor(model_file=str(ckpt.path / "tokenizer.model"))
    count = api.count_tokens("Hello there, world")
    assert count == {"count": len(sp.encode("Hello there, world")) + 1,
                     "tokens": [1] + sp.encode("Hello there, world")}
    assert api.tokenize("Hello") == [1] + sp.encode("Hello")
    assert api.detokenize(sp.encode("Hello there")) == "Hello there"
    text = api.generate("Once upon a time", max_length=12, temperature=0, use_default_badwordsids=True)
    assert text
    streamed = api.generate_sync("Once upon a time", max_length=12, temperature=0, use_default_badwordsids=True)
    assert streamed == text
    stats = api.get_performance_stats()
    assert stats["last_token_count"] == 12 and stats["idle"] == 1


def test_koboldapi_check_and_abort(slow: Any) -> None:
    from koboldapi.core.api import KoboldAPI

    api = KoboldAPI(slow.url)
    result: Dict[str, Any] = {}

    def run() -> None:
        result["text"] = api.generate("Tell me a long story", max_length=SLOW_TOKENS, temperature=0,
                                      use_default_badwordsids=True)

    worker = threading.Thread(target=run)
    worker.start()
    wait_for(lambda: len(api.check_generation() or "") > 0)
    partial = api.check_generation()
    assert api.abort_generation() == "true"
    worker.join(10)
    assert not worker.is_alive()
    assert result["text"].startswith(partial)
    assert perf(slow)["last_token_count"] < SLOW_TOKENS


def test_koboldapi_stream_is_incremental(slow: Any) -> None:
    from koboldapi.core.api import KoboldAPI

    api = KoboldAPI(slow.url)
    arrivals: List[float] = []

    async def collect() -> None:
        async for _token in api.stream_generate("Once", max_length=20, temperature=0,
                                                use_default_badwordsids=True):
            arrivals.append(time.monotonic())

    asyncio.run(collect())
    assert len(arrivals) >= 10
    assert arrivals[-1] - arrivals[0] > 10 * DELAY * 0.5


# -- waitress flushes every SSE event ----------------------------------------------------------------------

def test_sse_events_arrive_before_generation_finishes(slow: Any) -> None:
    sock = raw_request(slow, "/api/extra/generate/stream", slow_body(max_length=30))
    try:
        events = read_sse_events(sock)
    finally:
        sock.close()
    assert events[-1][1]["finish_reason"] == "length"
    times = [t for t, _ in events]
    assert len(events) >= 20
    # 30 tokens take >= 1.5 s; the first event must come long before the last.
    assert times[-1] - times[0] > 30 * DELAY * 0.6
    distinct = len({round(t, 2) for t in times})
    assert distinct > len(times) // 2


# -- queue, busy, abort, disconnects ------------------------------------------------------------------------

def test_queue_full_gives_503_and_queued_abort(slow: Any) -> None:
    responses: Dict[str, Any] = {}

    def post(name: str, body: Dict[str, Any]) -> None:
        responses[name] = requests.post(slow.url + "/api/v1/generate", json=body, timeout=60)

    a = threading.Thread(target=post, args=("a", slow_body(genkey="KCPPA001")))
    a.start()
    wait_for(lambda: perf(slow)["idle"] == 0)
    b = threading.Thread(target=post, args=("b", slow_body(genkey="KCPPB002")))
    b.start()
    wait_for(lambda: perf(slow)["queue"] == 1)
    busy = requests.post(slow.url + "/api/v1/generate", json=slow_body(), timeout=10)
    assert busy.status_code == 503 and busy.json() == BUSY
    busy_stream = requests.post(slow.url + "/api/extra/generate/stream", json=slow_body(), timeout=10)
    assert busy_stream.status_code == 503 and busy_stream.json() == BUSY
    # Without a genkey abort refuses while someone else waits (KoboldCpp's multi-user rule).
    assert requests.post(slow.url + "/api/extra/abort", timeout=10).json() == {"success": "false", "done": "false"}
    # The queued request is dropped at once; the running one stops within a token.
    assert requests.post(slow.url + "/api/extra/abort", json={"genkey": "KCPPB002"}, timeout=10).json() == {
        "success": "true", "done": "true"}
    b.join(10)
    assert responses["b"].status_code == 200 and responses["b"].json()["results"][0]["text"] == ""
    assert requests.post(slow.url + "/api/extra/abort", json={"genkey": "KCPPA001"}, timeout=10).json() == {
        "success": "true", "done": "true"}
    a.join(10)
    assert responses["a"].status_code == 200
    assert responses["a"].json()["results"][0]["completion_tokens"] < SLOW_TOKENS
    wait_for(lambda: perf(slow)["idle"] == 1)


def test_abort_takes_effect_within_one_token(ckpt: Any) -> None:
    delay = 0.2
    with live_server(make_app(ckpt.path, delay=delay)) as server:
        sock = raw_request(server, "/api/extra/generate/stream", slow_body(genkey="KCPP7777"))
        try:
            before = read_sse_events(sock, stop_after=3)
            t0 = time.monotonic()
            answer = requests.post(server.url + "/api/extra/abort", json={"genkey": "KCPP7777"}, timeout=10)
            assert answer.json() == {"success": "true", "done": "true"}
            after = read_sse_events(sock)
        finally:
            sock.close()
        assert len(before) == 3
        assert after[-1][1]["finish_reason"] == "length"
        # At most the token already being computed is still sent, then the final event.
        assert len(after) <= 2
        assert after[-1][0] - t0 < 2 * delay + 0.3


def test_stream_disconnect_aborts_generation(slow: Any) -> None:
    sock = raw_request(slow, "/api/extra/generate/stream", slow_body())
    events = read_sse_events(sock, stop_after=2)
    assert len(events) == 2
    sock.close()
    t0 = time.monotonic()
    wait_for(lambda: perf(slow)["idle"] == 1, timeout=3)
    assert time.monotonic() - t0 < 2.0
    assert perf(slow)["last_token_count"] < SLOW_TOKENS // 2


def test_sync_disconnect_aborts_generation(slow: Any) -> None:
    sock = raw_request(slow, "/api/v1/generate", slow_body())
    wait_for(lambda: perf(slow)["idle"] == 0)
    time.sleep(0.2)
    sock.close()
    wait_for(lambda: perf(slow)["idle"] == 1, timeout=3)
    assert perf(slow)["last_token_count"] < SLOW_TOKENS // 2


def test_queued_stream_disconnect_leaves_the_queue(slow: Any) -> None:
    first = raw_request(slow, "/api/extra/generate/stream", slow_body(genkey="KCPP0001"))
    try:
        read_sse_events(first, stop_after=1)
        queued = raw_request(slow, "/api/extra/generate/stream", slow_body())
        wait_for(lambda: perf(slow)["queue"] == 1)
        queued.close()
        wait_for(lambda: perf(slow)["queue"] == 0, timeout=3)
    finally:
        requests.post(slow.url + "/api/extra/abort", json={"genkey": "KCPP0001"}, timeout=10)
        first.close()
    wait_for(lambda: perf(slow)["idle"] == 1, timeout=3)


# -- API key -----------------------------------------------------------------------------------------------

def test_api_key_over_http(ckpt: Any) -> None:
    from koboldapi.core.api import KoboldAPI

    with live_server(make_app(ckpt.path, api_key="k3y")) as server:
        denied = requests.post(server.url + "/api/v1/generate", json={"prompt": "x", "max_length": 1}, timeout=10)
        assert denied.status_code == 401
        assert denied.json() == {"detail": {"error": "Unauthorized", "msg": "Authentication key is missing or invalid.",
                                            "type": "unauthorized"}}
        assert requests.get(server.url + "/api/extra/version", timeout=10).json()["protected"] is True
        api = KoboldAPI(server.url, api_password="k3y")
        assert api.generate("Hi", max_length=2, temperature=0)
        assert api.count_tokens("Hi")["count"] >= 1


# -- no leaks ----------------------------------------------------------------------------------------------

def _live_jobs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Job)


def test_no_thread_or_job_leak_over_thousands_of_requests(fast: Any) -> None:
    session = requests.Session()
    url = fast.url

    def burst(n: int) -> None:
        for i in range(n):
            kind = i % 5
            if kind in (0, 1):
                r = session.post(url + "/api/v1/generate", json={"prompt": "Hi", "max_length": 1,
                                                                 "genkey": f"KCPP{i % 50:04d}"})
                assert r.status_code == 200
            elif kind == 2:
                r = session.post(url + "/api/extra/generate/stream", json={"prompt": "Hi", "max_length": 1})
                assert r.content.endswith(b'"finish_reason": "length"}\n\n') or b'"stop"' in r.content
            elif kind == 3:
                assert session.post(url + "/api/extra/tokencount", json={"prompt": "Hi"}).status_code == 200
            else:
                assert session.post(url + "/api/extra/generate/check", json={"genkey": "KCPP0001"}).ok
            if i % 100 == 99:
                # A stream whose client vanishes after sending the request.
                raw_request(fast, "/api/extra/generate/stream", {"prompt": "Hi", "max_length": 2}).close()

    burst(200)
    wait_for(lambda: perf(fast)["idle"] == 1)
    threads_before = threading.active_count()
    jobs_before = _live_jobs()
    burst(2500)
    wait_for(lambda: perf(fast)["idle"] == 1)
    time.sleep(0.2)
    assert threading.active_count() == threads_before
    assert _live_jobs() <= max(jobs_before, FINISHED_KEEP + 2)
    session.close()


def test_http_client_sees_chunked_stream(fast: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", fast.port, timeout=10)
    conn.request("POST", "/api/extra/generate/stream", body=json.dumps({"prompt": "Hi", "max_length": 3}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    body = resp.read()
    conn.close()
    assert body.startswith(b"event: message\ndata: {")
