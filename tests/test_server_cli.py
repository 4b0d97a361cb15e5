"""`kobold-backend serve` as a subprocess: it logs its URL when ready, serves the model (or the demo model), binds
127.0.0.1 by default, enforces --api-key, and exits cleanly on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
URL_LINE = re.compile(r"serving on (http://[^/\s]+)/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(args: List[str], env: Any = None, timeout: float = 120.0) -> Any:
    """Run `python -m kobold_backend.cli serve ...` and wait for the 'serving on' log line."""
    proc = subprocess.Popen([sys.executable, "-m", "kobold_backend.cli", "serve", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **(env or {})))
    lines: List[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = URL_LINE.search(line)
        if m:
            return proc, m.group(1), lines
    proc.kill()
    proc.wait()
    raise AssertionError("serve did not start:\n" + "".join(lines))


def stop(proc: Any) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture()
def served(checkpoints: Any) -> Iterator[Any]:
    ckpt = checkpoints.get("dense_fp32")
    port = free_port()
    proc, url, lines = start_serve(["--model", str(ckpt.path), "--port", str(port), "--device", "cpu",
                                    "--max-context", "96", "--api-key", "abc", "--queue", "2"])
    try:
        yield proc, url, port
    finally:
        stop(proc)


def test_serve_with_model(served: Any) -> None:
    proc, url, port = served
    assert url == f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer abc"}
    assert requests.get(url + "/api/v1/model", headers=auth, timeout=10).json() == {
        "result": "kobold_backend/dense_fp32", "architecture": "LlamaForCausalLM", "format": "float32",
        "bits_per_weight": 32.0}
    assert requests.get(url + "/api/extra/true_max_context_length", headers=auth, timeout=10).json() == {"value": 96}
    denied = requests.post(url + "/api/v1/generate", json={"prompt": "Hi", "max_length": 2}, timeout=10)
    assert denied.status_code == 401
    out = requests.post(url + "/api/v1/generate", json={"prompt": "Hi", "max_length": 3, "temperature": 0},
                        headers=auth, timeout=30).json()
    assert out["results"][0]["completion_tokens"] <= 3
    assert requests.get(url + "/", timeout=10).status_code == 200  # the page itself needs no key
    assert stop(proc) == 0


def test_serve_demo_model_without_model(tmp_path: Path) -> None:
    port = free_port()
    proc, url, lines = start_serve(["--port", str(port), "--device", "cpu", "--max-context", "256"],
                                   env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=300)
    try:
        assert any("demo model" in line for line in lines)
        status = requests.get(url + "/ui/status", timeout=10).json()
        assert status["is_demo"] is True and status["max_context"] == 256
        assert "trained" in status["demo_label"]
        assert not (tmp_path / "kobold_backend").exists()  # the shipped checkpoint is served; nothing is built
    finally:
        assert stop(proc) == 0


def test_sigterm_ends_streams_with_their_final_event(checkpoints: Any) -> None:
    """systemd and Docker stop with SIGTERM: like Ctrl-C, a running stream gets its final event, the server logs
    it and exits 0 (it used to die at once with 143, cutting streams)."""
    ckpt = checkpoints.get("dense_fp32")
    proc, url, lines = start_serve(["--model", str(ckpt.path), "--port", str(free_port()), "--device", "cpu",
                                    "--max-context", "512"])
    try:
        body = {"prompt": "Once", "max_length": 500, "use_default_badwordsids": True}
        with requests.post(url + "/api/extra/generate/stream", json=body, stream=True, timeout=30) as resp:
            events = resp.iter_lines(decode_unicode=True)
            first = next(line for line in events if line.startswith("data:"))
            assert '"finish_reason": "null"' in first
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in events if line.startswith("data:")]
        assert rest and '"finish_reason": "null"' not in rest[-1]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    log = "".join(lines) + proc.stdout.read()
    assert "SIGTERM received" in log and "stopped" in log
