"""A bounded load test on loopback (issue 17): for LOAD_SECONDS, concurrent KoboldCpp and OpenAI streams, clients
that disconnect mid-stream, aborts by genkey, token counts and model switches; every answer is a success or a
documented busy/changed-model status, and afterwards the server's threads and memory are back where they were."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List

import psutil
import pytest
import requests

from kobold_backend.server import ServerConfig, create_app
from tests.server_helpers import live_server, make_holder, wait_for

LOAD_SECONDS = 40.0
MAX_OPERATIONS = 2000  # per worker: the test is bounded in count as well as in time
RSS_GROWTH_LIMIT = 150 * 2**20


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        self.failures: List[str] = []

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)


def kobold_stream(url: str, tally: Tally) -> None:
    body = {"prompt": "Once upon a time", "max_length": 24, "use_default_badwordsids": True}
    with requests.post(url + "/api/extra/generate/stream", json=body, stream=True, timeout=60) as resp:
        if resp.status_code == 503:
            return tally.add("busy")
        data = [json.loads(line[5:]) for line in resp.iter_lines(decode_unicode=True) if line.startswith("data:")]
        if resp.status_code != 200 or not data or data[-1]["finish_reason"] == "null":
            return tally.fail(f"kobold stream: {resp.status_code} {data[-1:] if data else 'no events'}")
    tally.add("kobold_stream")


def openai_stream(url: str, tally: Tally) -> None:
    body = {"prompt": "The lighthouse", "max_tokens": 16, "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        if resp.status_code == 503:
            return tally.add("busy")
        lines = [line for line in resp.iter_lines(decode_unicode=True) if line.startswith("data:")]
        if resp.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
            return tally.fail(f"openai stream: {resp.status_code} {lines[-2:]}")
        if any('"model_changed"' in line for line in lines):
            return tally.add("model_changed")
    tally.add("openai_stream")


def disconnect(url: str, tally: Tally) -> None:
    body = {"prompt": "A long story", "max_length": 100, "use_default_badwordsids": True}
    with requests.post(url + "/api/extra/generate/stream", json=body, stream=True, timeout=60) as resp:
        if resp.status_code == 503:
            return tally.add("busy")
        next(resp.iter_lines(), None)  # one event, then the client goes away
    tally.add("disconnect")


def abort(url: str, tally: Tally) -> None:
    key = uuid.uuid4().hex
    out: Dict[str, Any] = {}

    def run() -> None:
        out["resp"] = requests.post(url + "/api/v1/generate", json={"prompt": "x", "max_length": 100, "genkey": key,
                                                                  "use_default_badwordsids": True}, timeout=60)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.05)
    requests.post(url + "/api/extra/abort", json={"genkey": key}, timeout=10)
    t.join(60)
    if out["resp"].status_code not in (200, 503):
        return tally.fail(f"abort: {out['resp'].status_code}")
    tally.add("abort")


def tokencount(url: str, tally: Tally) -> None:
    resp = requests.post(url + "/api/extra/tokencount", json={"prompt": "count these words " * 50}, timeout=60)
    if resp.status_code == 503:
        return tally.add("busy")
    if resp.status_code != 200 or resp.json()["value"] < 50:
        return tally.fail(f"tokencount: {resp.status_code}")
    tally.add("tokencount")


def switch_model(url: str, tally: Tally, names: List[str] = ["a", "b"]) -> None:  # noqa: B006 - read only
    name = names[tally.counts.get("switch", 0) % 2]
    resp = requests.put(url + "/api/v1/model", json={"model": name}, timeout=60)
    if resp.status_code == 503:
        return tally.add("busy")
    if resp.status_code != 200:
        return tally.fail(f"switch: {resp.status_code} {resp.text[:200]}")
    tally.add("switch")
    time.sleep(1.0)


WORKERS: List[Callable[[str, Tally], None]] = [kobold_stream, kobold_stream, openai_stream, disconnect, abort,
                                               tokencount, switch_model]


def server_threads() -> int:
    return threading.active_count()


@pytest.mark.slow
def test_load_streams_disconnects_aborts_and_switches(checkpoints: Any, tmp_path: Path) -> None:
    ckpt = checkpoints.get("dense_fp32")
    models = tmp_path / "models"
    for name in ("a", "b"):
        shutil.copytree(ckpt.path, models / name)
    app = create_app(ServerConfig(models_dir=models, max_queue=4), make_holder(models / "a"))
    proc = psutil.Process()
    try:
        with live_server(app, threads=12) as server:
            url = server.url
            warm = Tally()
            for work in WORKERS:  # first use of every path: lazy imports, tokenizer tables, allocator pools
                work(url, warm)
            assert not warm.failures, warm.failures
            state = app.extensions["kobold_backend"]
            wait_for(state.queue.idle, timeout=30)
            gc.collect()
            threads_before, rss_before = server_threads(), proc.memory_info().rss

            tally = Tally()
            deadline = time.monotonic() + LOAD_SECONDS

            def loop(work: Callable[[str, Tally], None]) -> None:
                for _ in range(MAX_OPERATIONS):
                    if time.monotonic() > deadline:
                        return
                    try:
                        work(url, tally)
                    except requests.RequestException as e:
                        tally.fail(f"{work.__name__}: {e!r}")

            clients = [threading.Thread(target=loop, args=(w,), name=f"load-{w.__name__}") for w in WORKERS]
            for t in clients:
                t.start()
            for t in clients:
                t.join(LOAD_SECONDS + 120)
            assert not any(t.is_alive() for t in clients)
            assert not tally.failures, tally.failures[:5]
            for key in ("kobold_stream", "openai_stream", "disconnect", "abort", "tokencount", "switch"):
                assert tally.counts.get(key, 0) > 0, tally.counts

            wait_for(state.queue.idle, timeout=60)
            assert requests.get(url + "/api/v1/model", timeout=10).status_code == 200
            wait_for(lambda: server_threads() <= threads_before, timeout=30)
            gc.collect()
            growth = proc.memory_info().rss - rss_before
            print(f"load: {tally.counts}; threads {threads_before} -> {server_threads()}; "
                  f"RSS {rss_before / 2**20:.0f} MiB, grew {growth / 2**20:+.1f} MiB")
            assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / 2**20:.0f} MiB: {tally.counts}"
    finally:
        app.extensions["kobold_backend"].close()
