"""Chat templates rendered in worker processes, so that a template from a model file can neither take the server's
memory nor stall its request threads.

Why processes: the sandbox (template_sandbox.py) checks sizes before every operation it can see and the CPU time
every 256 steps, but one operation is a C loop no thread can interrupt, and a CPU-bound render holds Python's GIL
against every request thread. A worker process runs with its address space capped (MEMORY_BYTES beyond its start,
RLIMIT_AS) at a lower priority; a render that has not answered after RENDER_SECONDS is killed and refused. At most
WORKERS render at once (started on first use, restarted after a kill) and WAITERS more wait (at most WAIT_SECONDS);
any further render is refused as busy at once, so renders never hold more than WORKERS + WAITERS request threads and
the other routes keep theirs. Where no worker process can be started, the render runs in the calling thread under
the sandbox's own bounds.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from kobold_backend.engine.template_sandbox import MAX_SECONDS
from kobold_backend.errors import KoboldBackendError

log = logging.getLogger(__name__)

MEMORY_BYTES = 192 << 20
RENDER_SECONDS = MAX_SECONDS + 0.5
WORKERS = 2
WAITERS = 1
WAIT_SECONDS = 5.0
STARTUP_SECONDS = 30.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class RenderFailed(Exception):
    """The template refused the messages or crossed a bound (the message says which)."""


class RendererBusy(KoboldBackendError):
    """Every chat-template worker is busy (and WAITERS renders wait already, or one waited WAIT_SECONDS)."""


class _Worker:
    """One renderer process and a thread that reads its answers."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                                          if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kobold_backend.engine.template_worker", str(MEMORY_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="template-worker-reader", daemon=True).start()
        try:
            ready = self.answers.get(timeout=STARTUP_SECONDS)
        except queue.Empty:
            ready = None
        if ready is None:  # the render time starts once the process has started
            self.kill()
            raise RenderFailed("the chat-template renderer process did not start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(line)
        self.answers.put(None)

    def render(self, request: Dict[str, Any]) -> str:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode("utf-8") + b"\n")
            self.proc.stdin.flush()
            line = self.answers.get(timeout=RENDER_SECONDS)
        except queue.Empty:
            self.kill()
            raise RenderFailed(f"the chat template ran longer than {MAX_SECONDS} s") from None
        except OSError:
            line = None
        if line is None:
            self.kill()
            raise RenderFailed(f"the chat template's renderer stopped (it may have needed more than "
                               f"{MEMORY_BYTES >> 20} MiB of memory)")
        reply = json.loads(line)
        if "error" in reply:
            raise RenderFailed(reply["error"])
        return str(reply["text"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class RenderPool:
    """Up to WORKERS renderer processes shared by every caller."""

    def __init__(self) -> None:
        self._slots = threading.BoundedSemaphore(WORKERS)
        self._admitted = threading.BoundedSemaphore(WORKERS + WAITERS)
        self._idle: List[_Worker] = []
        self._lock = threading.Lock()
        self._unavailable = False

    def render(self, source: str, variables: Dict[str, Any], input_chars: int) -> Optional[str]:
        """The rendered text, or None where no worker process can be started (the caller renders in-process)."""
        if self._unavailable:
            return None
        if not self._admitted.acquire(blocking=False):
            raise RendererBusy("Every chat-template renderer is busy; try again shortly.")
        try:
            return self._render_admitted(source, variables, input_chars)
        finally:
            self._admitted.release()

    def _render_admitted(self, source: str, variables: Dict[str, Any], input_chars: int) -> Optional[str]:
        if not self._slots.acquire(timeout=WAIT_SECONDS):
            raise RendererBusy(f"Every chat-template renderer stayed busy for {WAIT_SECONDS:g} s; try again shortly.")
        try:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                try:
                    worker = _Worker()
                except OSError as e:
                    log.warning("no chat-template worker process (%s); rendering in-process", e)
                    self._unavailable = True
                    return None
            try:
                return worker.render({"source": source, "variables": variables, "input_chars": input_chars})
            finally:
                if worker.alive():
                    with self._lock:
                        self._idle.append(worker)
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


POOL = RenderPool()
