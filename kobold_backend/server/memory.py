"""Hands memory back after large request bodies: parsing a body of megabytes (and tokenizing it) fills the C
allocator's per-thread arenas with freed pages that glibc keeps for good, so the server's resident memory only grew
(the outside probe: 279 MB to 2.35 GB over large bodies, staying there; tests/test_request_bounds_served.py).

After a request whose body reached TRIM_AFTER_BYTES, a trim (engine/release.py: gc, then malloc_trim) runs shortly
after the request is done, once for a burst of such requests, on a timer thread: the request's own objects are gone
by then, and no request waits for it.
"""

from __future__ import annotations

import threading
from typing import Optional

from flask import Flask, request

from kobold_backend.engine.release import return_freed_memory

TRIM_AFTER_BYTES = 1 << 20
TRIM_DELAY_SECONDS = 0.25


class _Trimmer:
    """At most one trim pending; a large request while one is pending joins it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Optional[threading.Timer] = None

    def soon(self) -> None:
        with self._lock:
            if self._pending is not None:
                return
            self._pending = threading.Timer(TRIM_DELAY_SECONDS, self._run)
            self._pending.daemon = True
            self._pending.start()

    def _run(self) -> None:
        with self._lock:
            self._pending = None
        return_freed_memory()


def trim_after_large_bodies(app: Flask) -> None:
    """Schedule a trim after every request whose body had TRIM_AFTER_BYTES or more."""
    trimmer = _Trimmer()

    @app.teardown_request
    def _after(_exc: Optional[BaseException]) -> None:
        if (request.content_length or 0) >= TRIM_AFTER_BYTES:
            trimmer.soon()
