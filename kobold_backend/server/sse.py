"""KoboldCpp's server-sent events: `event: message` + one `data:` line of JSON per event, finish_reason the
string "null" until the final event ("stop" for EOS, otherwise "length")."""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterator, Optional, Tuple

from kobold_backend.server.queue import Job, WorkQueue

log = logging.getLogger(__name__)

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MIMETYPE = "text/event-stream"


def format_event(token: str, finish_reason: str) -> bytes:
    """One SSE event, byte for byte as KoboldCpp writes it."""
    data = json.dumps({"token": token, "finish_reason": finish_reason})
    return f"event: message\ndata: {data}\n\n".encode()


def event_stream(job: Job, work: WorkQueue, first: Optional[Tuple[str, Optional[str]]],
                 rest: Iterator[Tuple[str, Optional[str]]], disconnected: Callable[[], bool]) -> Iterator[bytes]:
    """Format the job's events. Closing this iterator early (the client went away) aborts the job."""
    finished = False
    try:
        items = ([first] if first is not None else [])
        for text, reason in _chain(items, rest):
            finished = reason is not None
            yield format_event(text, reason if finished else "null")
        if not finished and not disconnected():
            finished = True
            yield format_event("", "length")
    except Exception:
        log.exception("generation failed while streaming")
        if not finished:
            finished = True
            yield format_event("", "length")
    finally:
        if not job.done_event.is_set():
            work.cancel(job)


def _chain(items: list, rest: Iterator[Tuple[str, Optional[str]]]) -> Iterator[Tuple[str, Optional[str]]]:
    yield from items
    yield from rest
