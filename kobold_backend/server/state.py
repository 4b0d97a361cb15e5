"""ServerState: what one app instance shares between its blueprints (config, engine holder, queue, counters)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from flask import current_app, request

from kobold_backend.server.config import ServerConfig
from kobold_backend.server.engine_holder import ActiveModel, EngineHolder
from kobold_backend.server.errors import ApiError, BadJson, NoModelLoaded
from kobold_backend.server.generation import PerfStats
from kobold_backend.server.queue import WorkQueue
from kobold_backend.server.text_checks import check_json_text


@dataclass
class ServerState:
    config: ServerConfig
    holder: EngineHolder
    queue: WorkQueue
    perf: PerfStats
    # /api/extra/tokencount runs outside the queue: one text at a time (api_extra).
    tokenize_slot: threading.Semaphore = field(default_factory=lambda: threading.BoundedSemaphore(1))

    def require_model(self) -> ActiveModel:
        active = self.holder.active
        if active is None:
            if self.holder.loading is not None:
                raise ApiError(f"The model {self.holder.loading} is loading; try again shortly.", 503,
                               "service_unavailable")
            raise NoModelLoaded()
        return active

    def close(self) -> None:
        self.queue.close()


def get_state() -> ServerState:
    return current_app.extensions["kobold_backend"]


def read_json(empty: Any = None) -> Any:
    """The request body parsed as JSON whatever its Content-Type; `empty` is returned for an empty body. Every
    string in it is checked once here (text_checks): a lone surrogate is a RequestError naming the field."""
    data = request.get_data(cache=True)
    if not data.strip():
        return empty
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise BadJson() from None
    check_json_text(body)
    return body


def client_disconnected() -> Callable[[], bool]:
    """A callable telling whether the client went away (waitress with channel_request_lookahead > 0)."""
    check = request.environ.get("waitress.client_disconnected")
    return check if check is not None else (lambda: False)
